"""OpenAI response objects for one request of `n` choices: full replies, stream chunks, usage and logprobs.

Logprobs come from the engine with every sampled token (`openk3.sampling.TokenLogprob`, the model's own
distribution); a choice sends a token's entry together with the text it starts, so a stream never shows, through
its logprobs, a token whose text is still held back (a possible stop string or a partial UTF-8 character). When a
choice ends with finish_reason "stop", the tokens whose text lies wholly in the stop string, or that have no text
(the end-of-reply token), are left out, as the text leaves them out; otherwise every sampled token is reported.
Two shapes: the legacy completions object {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (the top
alternatives as a dict, with the sampled token added when it is not among them) and chat's {"content": [{"token",
"logprob", "bytes", "top_logprobs"}], "refusal"}. A token whose bytes are not text on their own (part of a UTF-8
character) is named "bytes:\\xNN..." as OpenAI does; a control token by its name, with `bytes` null.
"""

from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass, field

from openk3.sampling import TokenLogprob
from openk3.serve.scheduler import RequestEvent


class TokenNames:
    """How tokens appear in logprobs: their text (or "bytes:..." / a control token's name) and their bytes."""

    def __init__(self, tokenizer, stop_ids: set[int]):
        self.tokenizer, self.stop_ids = tokenizer, stop_ids

    def text_bytes(self, token: int) -> bytes:
        """The bytes the token adds to the reply's text (none for a stop token, which the engine leaves out)."""
        return b"" if token in self.stop_ids else self.tokenizer.token_bytes(token) or b""

    def describe(self, token: int) -> tuple[str, list[int] | None]:
        raw = self.tokenizer.token_bytes(token)
        if raw is None:
            return self.tokenizer.decode([token]), None
        try:
            return raw.decode("utf-8"), list(raw)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


class ChoiceLogprobs:
    """One choice's logprob entries, each with the offset in the reply text of the character its token's first byte
    belongs to (decoding as the text does: UTF-8 with U+FFFD for each maximal invalid subpart), released as the text
    is sent."""

    def __init__(self, names: TokenNames):
        self.names = names
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0  # characters the decoder has completed
        self._pending: list[tuple[int, TokenLogprob]] = []

    def add(self, entries: list[TokenLogprob]) -> None:
        for entry in entries:
            self._pending.append((self.offset(self.names.text_bytes(entry.token)), entry))

    def offset(self, raw: bytes) -> int:
        """Decode the next token's bytes; returns the offset of the character its first byte belongs to: the last
        one of the text ended right after that byte (what the decoder has completed, then its held bytes and that
        byte decoded as a final piece). A token without text sits after the text before it."""
        tail = self._decoder.getstate()[0] + raw[:1]
        offset = self._chars + len(tail.decode("utf-8", errors="replace")) - (1 if raw else 0)
        self._chars += len(self._decoder.decode(raw))
        return offset

    def release(self, sent: int, finished: bool, reason: str | None) -> list[tuple[int, TokenLogprob]]:
        """The entries whose text starts within the first `sent` characters; at the end, the rest too unless the
        reply stopped (then the rest lie in the stop string or are the end-of-reply token)."""
        if finished and reason != "stop":
            out, self._pending = self._pending, []
            return out
        k = next((i for i, (offset, _) in enumerate(self._pending) if offset >= sent), len(self._pending))
        out, self._pending = self._pending[:k], ([] if finished else self._pending[k:])
        return out

    def legacy(self, entries: list[tuple[int, TokenLogprob]]) -> dict:
        tokens, top = [], []
        for _, e in entries:
            name = self.names.describe(e.token)[0]
            alternatives = {self.names.describe(t)[0]: lp for t, lp in e.top}
            alternatives.setdefault(name, e.logprob)
            tokens.append(name)
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [e.logprob for _, e in entries], "top_logprobs": top,
                "text_offset": [offset for offset, _ in entries]}

    def chat(self, entries: list[tuple[int, TokenLogprob]]) -> dict:
        def item(token: int, logprob: float) -> dict:
            text, raw = self.names.describe(token)
            return {"token": text, "logprob": logprob, "bytes": raw}

        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for _, e in entries], "refusal": None}


@dataclass
class Choice:
    logprobs: ChoiceLogprobs | None
    text: list[str] = field(default_factory=list)
    sent: int = 0  # characters of text received
    released: list[tuple[int, TokenLogprob]] = field(default_factory=list)  # logprob entries (non-streaming)
    last: RequestEvent | None = None  # the latest event
    sent_role: bool = False


class Reply:
    """The response to one completions or chat request with `n` choices. Usage counts the prompt once and the
    tokens of every choice; `cached_tokens` is the prompt's prefix-cache hit of the choice that reused least."""

    def __init__(self, rid: str, model: str, chat: bool, n: int, include_usage: bool, names: TokenNames,
                 logprobs: bool):
        self.rid, self.model, self.chat, self.include_usage = rid, model, chat, include_usage
        self.created = int(time.time())
        self.choices = [Choice(ChoiceLogprobs(names) if logprobs else None) for _ in range(n)]
        self.unfinished = n  # choices whose last event has not come
        # a stream chunk's JSON up to its choices (json.dumps of the same dict, cut before its choice list's end)
        self._chunk_head = json.dumps(self._envelope([], chunk=True))[:-2]

    @property
    def finished(self) -> bool:
        return self.unfinished == 0

    def reasons(self) -> list[str | None]:
        return [c.last.finish_reason if c.last is not None else None for c in self.choices]

    def add(self, index: int, event: RequestEvent) -> list[tuple[int, TokenLogprob]] | None:
        """Take one engine event of choice `index`; returns the logprob entries it releases (None: not asked)."""
        c = self.choices[index]
        c.last = event
        self.unfinished -= event.finished
        c.text.append(event.text)
        c.sent += len(event.text)
        if c.logprobs is None:
            return None
        c.logprobs.add(event.logprobs)
        return c.logprobs.release(c.sent, event.finished, event.finish_reason)

    def usage(self) -> dict:
        last = [c.last for c in self.choices if c.last is not None]
        prompt, completion = last[0].prompt_tokens, sum(e.completion_tokens for e in last)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": min(e.cached_tokens for e in last)}}

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, c: Choice, entries: list[tuple[int, TokenLogprob]] | None) -> dict | None:
        if c.logprobs is None:
            return None
        return c.logprobs.chat(entries) if self.chat else c.logprobs.legacy(entries)

    def sse(self, index: int, event: RequestEvent) -> str:
        """The server-sent events for one engine event: its stream chunk (none for an event with nothing to show),
        then, after the last choice's last event, the usage chunk when it was asked for."""
        entries = self.add(index, event)
        c, reason = self.choices[index], event.finish_reason if event.finished else None
        out = ""
        if event.text or entries or event.finished:
            logprobs = self._logprobs(c, entries)
            if self.chat:
                delta = {"content": event.text}
                if not c.sent_role:
                    delta, c.sent_role = {"role": "assistant", **delta}, True
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            else:
                choice = {"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": reason}
            out = f"data: {self._chunk_head}{json.dumps(choice)}]}}\n\n"
        if self.finished and self.include_usage:
            out += f"data: {json.dumps({**self._envelope([], chunk=True), 'usage': self.usage()})}\n\n"
        return out

    def collect(self, index: int, event: RequestEvent) -> None:
        entries = self.add(index, event)
        if entries:
            self.choices[index].released += entries

    def full(self) -> dict:
        choices = []
        for index, c in enumerate(self.choices):
            text, logprobs = "".join(c.text), self._logprobs(c, c.released)
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                          "finish_reason": c.last.finish_reason}
            else:
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.last.finish_reason}
            choices.append(choice)
        return {**self._envelope(choices, chunk=False), "usage": self.usage()}
