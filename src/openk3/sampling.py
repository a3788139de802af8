"""Sampling parameters and next-token sampling (greedy, temperature, top-k, top-p, penalties, logit bias, per-request
seed) and the log-probabilities reported for each sampled token.

Shared by training's end-of-run sample, `openk3 generate` and the serving engine. A logits row goes through, in fp32:
1. NaN read as -inf (never chosen);
2. `adjust_logits`: OpenAI's logit bias and presence / frequency penalties, mu[j] - c[j] * frequency -
   [c[j] > 0] * presence, where c[j] counts how often token j was generated before this position (the prompt does
   not count, as in OpenAI's definition and vLLM's);
3. temperature, top-k, top-p, then one multinomial draw from the request's own `torch.Generator`, so a seeded
   request draws the same tokens whatever else runs beside it.
`sample_token` cannot fail for parameters that pass `SamplingParams`' checks:
- a temperature below `TEMPERATURE_FLOOR` (1e-5, the threshold vLLM also uses) samples greedily (the argmax of the
  adjusted logits): dividing by a smaller one would overflow fp32 (1e-40 did) and the distribution is a point mass
  at that scale anyway;
- the largest logit is subtracted before the temperature divides, so no value overflows; when no token has a finite
  logit, the pick is greedy.
`token_logprobs` reports the model's own distribution: log_softmax of the raw logits, before bias, penalties,
temperature and the top-k / top-p cuts (what OpenAI reports, and vLLM by default).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

TEMPERATURE_FLOOR = 1e-5  # temperatures below it mean greedy
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI's range)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
LOGPROB_FLOOR = -9999.0  # what a token of zero probability reports (OpenAI's value; JSON has no -inf)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # < TEMPERATURE_FLOOR (0 included): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None  # None: the engine derives one from its own seed
    stop: list[str] = field(default_factory=list)  # stop strings: generation ends before them
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # report each sampled token's logprob and this many top alternatives (None: none)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature < float("inf"):  # NaN fails too
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not PENALTY_RANGE[0] <= getattr(self, name) <= PENALTY_RANGE[1]:
                raise ValueError(f"{name} must be in {list(PENALTY_RANGE)}, got {getattr(self, name)}")
        for token, bias in self.logit_bias.items():
            if token < 0 or not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
                raise ValueError(f"logit_bias maps token ids >= 0 to {list(LOGIT_BIAS_RANGE)}, got {token}: {bias}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR or self.top_k == 1

    @property
    def plain(self) -> bool:
        """No logit bias, no penalties, no logprobs: the raw logits decide (a greedy pick is their argmax)."""
        return not (self.logit_bias or self.presence_penalty or self.frequency_penalty) and self.logprobs is None


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `seed` (OpenAI's `n`): choice 0 uses the seed itself, so n = 1
    and the first of n choices agree; the others get independent 64-bit seeds derived from (seed, index)."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest(), "little")


def adjust_logits(logits: torch.Tensor, params: SamplingParams, previous: Sequence[int] = ()) -> torch.Tensor:
    """logits [V] fp32 -> logits with the logit bias added and the presence / frequency penalties of the tokens
    generated so far (`previous`) subtracted (module docstring). Ids outside [0, V) are ignored."""
    vocab = logits.numel()
    if params.logit_bias:
        ids = torch.tensor([t for t in params.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([params.logit_bias[t] for t in ids.tolist()], dtype=logits.dtype)
        logits = logits.index_add(0, ids, bias)
    if previous and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.unique(torch.tensor(list(previous), dtype=torch.long), return_counts=True)
        keep = ids < vocab
        penalty = counts[keep].to(logits.dtype) * params.frequency_penalty + params.presence_penalty
        logits = logits.index_add(0, ids[keep], -penalty)
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                 previous: Sequence[int] = ()) -> int:
    """logits [V] -> one token id; `previous`: the tokens generated before it (for the penalties). Sorting ties
    resolve to the lower id, as argmax does."""
    logits = adjust_logits(logits.float().nan_to_num(nan=float("-inf")), params, previous)
    if params.greedy or not torch.isfinite(logits.max()):  # +inf wins outright; all -inf leaves nothing to sample
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, params), 1, generator=generator))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Adjusted fp32 logits [V] with a finite maximum -> the distribution a token is drawn from: softmax of the
    logits over the temperature, restricted to the top-k and then to the top-p nucleus."""
    logits = (logits - logits.max()) / params.temperature  # <= 0 everywhere: no overflow for any temperature >= floor
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
        sorted_logits = sorted_logits.masked_fill(before >= params.top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return torch.softmax(logits, dim=-1)


@dataclass
class TokenLogprob:
    """One sampled token's log-probability and the `top` most likely tokens at its position, best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """logits [V] (raw, any float dtype) -> the log-probability of `token` under log_softmax of the logits in fp32
    and the `top` largest (equal ones by id), each at least LOGPROB_FLOOR. A NaN logit counts as -inf; a +inf
    logit as the largest finite fp32 (it takes all the mass)."""
    inf = float("inf")
    finite = logits.float().nan_to_num(nan=-inf, posinf=torch.finfo(torch.float32).max, neginf=-inf)
    logprobs = torch.log_softmax(finite, dim=-1).nan_to_num(nan=LOGPROB_FLOOR).clamp(min=LOGPROB_FLOOR)
    best: list[tuple[int, float]] = []
    if top:
        kth = torch.topk(logprobs, min(top, logprobs.numel())).values[-1]
        above, tied = (logprobs > kth).nonzero().flatten(), (logprobs == kth).nonzero().flatten()
        ids = torch.cat([above, tied[: top - above.numel()]]).tolist()
        best = sorted(((i, float(logprobs[i])) for i in ids), key=lambda pair: (-pair[1], pair[0]))
    return TokenLogprob(token, float(logprobs[token]), best)
