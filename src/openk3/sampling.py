"""Sampling parameters and next-token sampling (greedy, temperature, top-k, top-p, per-request seed).

Shared by training's end-of-run sample, `openk3 generate` and the serving engine. `sample_token` cannot fail for
parameters that pass `SamplingParams`' checks:
- a temperature below `TEMPERATURE_FLOOR` (1e-5, the threshold vLLM also uses) samples greedily: dividing by a
  smaller one would overflow fp32 (1e-40 did) and the distribution is a point mass at that scale anyway;
- logits are taken in fp32 with NaN read as -inf (never chosen); the largest logit is subtracted before the
  temperature divides, so no value overflows; when no token has a finite logit, the pick is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TEMPERATURE_FLOOR = 1e-5  # temperatures below it mean greedy


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # < TEMPERATURE_FLOOR (0 included): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None  # None: the engine derives one from its own seed
    stop: list[str] = field(default_factory=list)  # stop strings: generation ends before them
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature < float("inf"):  # NaN fails too
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR or self.top_k == 1


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits [V] -> one token id. Sorting ties resolve to the lower id, as argmax does."""
    logits = logits.float().nan_to_num(nan=float("-inf"))
    top = logits.max()
    if params.greedy or not torch.isfinite(top):  # +inf wins outright; all -inf leaves nothing to sample
        return int(torch.argmax(logits))
    logits = (logits - top) / params.temperature  # <= 0 everywhere: no overflow for any temperature >= floor
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
        sorted_logits = sorted_logits.masked_fill(before >= params.top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
