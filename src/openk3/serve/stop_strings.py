"""Stop strings (OpenAI's `stop`): where a reply's text ends, and how much of a growing text to hold back while
streaming so that no character that may still turn out to begin a stop string is sent."""

from __future__ import annotations

from collections.abc import Sequence


def first_stop(text: str, stops: Sequence[str]) -> int:
    """The index where the earliest occurrence of any stop string begins in `text`, or -1 (the reply is the text
    before it; the stop string itself is not part of the reply)."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)


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
