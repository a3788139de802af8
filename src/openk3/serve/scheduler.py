"""Requests and the continuous-batching scheduler: queueing, admission control and per-step work selection.

Admission auto-throttles (SPEC §6, the rollout engine's rule, applied to serving) from four signals:
- queue length: `submit` refuses new requests once `max_queue` wait (the API answers 429);
- running requests: at most `max_running` sequences are live;
- memory: the engine's `fits` says whether the next request's prompt finds latent pages (free or evictable);
- cache utilisation: while more than `max_locked_fraction` of the prefix cache's device tier is locked by
  running sequences, new ones wait (they could neither hit nor write without thrashing).
A running sequence whose pages run out mid-decode is preempted (`preempt`): it goes back to the head of the queue
with what it has generated, and on re-admission prefills its prompt and output again (recompute; the prefix cache
usually holds most of it) before it decodes on.
A request with a leader (`after`: another choice of the same API request) waits at the head of the queue until its
leader has prefilled, so that it finds the prompt in the prefix cache. Each step then runs every decoding sequence
(one token each) and spends at most `prefill_tokens_per_step` on prefill chunks, oldest requests first; requests
join and leave only between steps.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

from openk3.sampling import SamplingParams, TokenLogprob
from openk3.serve.prefix_cache import Lease


class QueueFull(RuntimeError):
    pass


@dataclass
class RequestEvent:
    """What a client sees after a step: new text (stop strings and partial UTF-8 held back), the logprobs of the
    tokens sampled since the last event (when asked for; aligned with the text by the API), the outcome and the
    time it was sent (for the latency histograms)."""

    rid: str
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    at: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    on_event: Callable[[RequestEvent], None] | None = None
    output: list[int] = field(default_factory=list)
    fed: int = 0  # tokens the model has consumed: the sequence's cache length
    slot: int | None = None  # its KDA state-pool slot and block-table row while it runs
    lease: Lease | None = None
    rng: random.Random | None = None  # its own random source (`openk3.sampling.request_rng`)
    cached_tokens: int = 0
    text: str = ""  # decoded output so far (cut at a stop string when one appears)
    sent: int = 0  # characters of `text` already delivered
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # sampled since the last event, not yet sent
    after: Request | None = None  # admitted only once this request (same prompt) has prefilled
    images: Any = None  # the prompt's images (openk3.serve.prompts.PromptImages), None for a text prompt
    every_token: bool = True  # an event per token; False: the first token's and the last (Engine.add_request)

    preemptions: int = 0

    @property
    def prefill_len(self) -> int:
        """Tokens to consume before decoding: the prompt, and after a preemption the output but its last token
        (which the next decode step feeds)."""
        return len(self.prompt) + max(0, len(self.output) - 1)

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prefill_len

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclass
class SchedulerConfig:
    max_running: int = 32  # sequences running at once (--max-num-seqs)
    max_queue: int = 1024
    # prompt tokens per engine step (--max-num-batched-tokens); None: the engine's default for its device
    # (openk3.serve.capacity.default_batched_tokens)
    prefill_tokens_per_step: int | None = None
    max_locked_fraction: float = 0.9

    def __post_init__(self) -> None:
        for name in ("max_running", "max_queue", "prefill_tokens_per_step"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"scheduler field {name!r} must be >= 1, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def submit(self, request: Request) -> None:
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFull(f"the queue holds {len(self.waiting)} requests (max_queue={self.config.max_queue})")
        self.waiting.append(request)

    def admit(self, locked_fraction: float, fits: Callable[[Request], bool] = lambda r: True) -> list[Request]:
        """Move waiting requests to running while the throttles allow; FIFO, no overtaking. `fits(request)`: the
        engine's memory check, called in order; it may count what the earlier admissions of this call take."""
        cfg, admitted = self.config, []
        while self.waiting and len(self.running) < cfg.max_running and locked_fraction <= cfg.max_locked_fraction:
            leader = self.waiting[0].after
            if leader is not None and leader.finish_reason is None and leader.prefilling:
                break  # it would prefill the prompt its leader is about to put in the prefix cache
            if not fits(self.waiting[0]) and self.running:  # (asked first: it counts what each admission takes)
                break
            request = self.waiting.popleft()
            self.running.append(request)
            admitted.append(request)
        return admitted

    def preempt(self, request: Request) -> None:
        """A running request back to the head of the queue (it keeps its output; the engine freed its state)."""
        self.running.remove(request)
        self.waiting.appendleft(request)
        request.preemptions += 1

    def prefill_rounds(self, chunk_end: Callable[[Request, int], int], budget: int | None = None,
                       align: int = 1, skip: Container[Request] = ()) -> list[list[tuple[Request, int]]]:
        """Prefill work of one step: rounds of (request, end of its next chunk), oldest first, within the token
        budget. The chunk that reaches the budget is cut there, at a multiple of `align` where that leaves it
        non-empty (the engine's hash block: its next chunk then starts on a block boundary, where its KDA
        checkpoints fall at the same offsets as other aligned chunks'). A request may get several chunks (one
        per round) when few are prefilling. The requests in `skip` (a forward of theirs is under way) get none."""
        budget, fed = budget or self.config.prefill_tokens_per_step, {}
        rounds: list[list[tuple[Request, int]]] = []
        while budget > 0:
            this_round = []
            for r in self.running:
                pos = fed.get(r, r.fed)
                if pos >= r.prefill_len or budget <= 0 or r in skip:
                    continue
                end = chunk_end(r, pos)
                if end > pos + budget:
                    cut = (pos + budget) // align * align
                    end = cut if cut > pos else pos + budget
                fed[r] = end
                budget -= end - pos
                this_round.append((r, end))
            if not this_round:
                break
            rounds.append(this_round)
        return rounds

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
