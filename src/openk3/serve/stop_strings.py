"""Stop strings (OpenAI's `stop`): where a reply's text ends, and how much of a growing text to hold back while
streaming so that no character that may still turn out to begin a stop string is sent. The engine calls these once
per token on the whole reply so far, so each looks only at the end a new token can change (`first_stop`'s
`after`, `sendable`): their time does not grow with the reply."""

from __future__ import annotations

from collections.abc import Sequence


def first_stop(text: str, stops: Sequence[str], after: int = 0) -> int:
    """The index where the earliest occurrence of any stop string begins in `text`, or -1 (the reply is the text
    before it; the stop string itself is not part of the reply). Stop strings match complete characters only: an
    occurrence that ends with the text's last character when that is U+FFFD does not count, since that may stand
    for a UTF-8 character whose last bytes are still to come (as openk3.tokenizer.TextStream shows one).
    `after`: no occurrence ends before the `after`-th character (an earlier call saw the first `after` characters,
    skipping only a final U+FFFD), so only occurrences ending there or later are looked for."""
    end = len(text) - (text[-1:] == "\ufffd")
    found = (text.find(s, max(0, after - len(s)), end) for s in stops if s)
    return min((i for i in found if i >= 0), default=-1)


def partial_stop(text: str, stop: str) -> int:
    """The length of the longest proper prefix of `stop` that `text` ends with (0 when none): those last characters
    may begin the stop string once more text comes. Candidates are the positions of stop[0] in the last
    len(stop) - 1 characters, longest first."""
    if not stop:
        return 0
    i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while i != -1:
        if stop.startswith(text[i:]):
            return len(text) - i
        i = text.find(stop[0], i + 1)
    return 0


def held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` (which holds no complete stop string) that may begin one of `stops`."""
    return max((partial_stop(text, s) for s in stops), default=0)


def sendable(text: str, stops: Sequence[str], sent: int) -> int:
    """How many characters of a growing reply `text` (holding no complete stop string) may be sent, never fewer than
    the `sent` already were: all but a trailing run of U+FFFD (a UTF-8 character whose last bytes are still to come,
    as a full decode shows it) and the end that may begin one of `stops`."""
    end = len(text)
    while end > sent and text[end - 1] == "\ufffd":
        end -= 1
    reach = max((len(s) - 1 for s in stops if s), default=0)  # held_back reads no further back than this
    return max(end - held_back(text[max(0, end - reach):end], stops), sent)
