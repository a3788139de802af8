"""Sampling parameters and next-token sampling (greedy, temperature, top-k, top-p, penalties, logit bias, per-request
seed) and the log-probabilities reported for each sampled token.

Shared by training's end-of-run sample, `openk3 generate` and the serving engine. A logits row goes through, in fp32:
1. NaN read as -inf (never chosen);
2. `adjusted_logits` (one row: `adjust_logits`): OpenAI's logit bias and presence / frequency penalties,
   mu[j] - c[j] * frequency - [c[j] > 0] * presence, where c[j] counts how often token j was generated before this
   position (the prompt does not count, as in OpenAI's definition and vLLM's);
3. temperature, top-k, top-p, then one draw by inversion of the cumulative distribution with one uniform from the
   request's own random source (`request_rng`), so a seeded request draws the same tokens whatever else runs beside
   it. The whole batch samples in a few tensor operations on the logits' own device (a GPU batch sends one uniform
   per row there and its tokens back, not its logits to the host); the CPU and GPU results agree up to the fp32
   rounding of the softmax.
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
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from openk3.ops.fused import use_triton
from openk3.ops.transfer import queued, to_device

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
    def unadjusted(self) -> bool:
        """No bias, no penalties: the distribution comes from the raw logits (and the temperature and cuts)."""
        return not (self.logit_bias or self.presence_penalty or self.frequency_penalty)

    @property
    def whole_distribution(self) -> bool:
        """The temperature alone shapes the distribution: no top-k / top-p cut, no bias, no penalties."""
        return self.unadjusted and not (self.top_k or self.top_p < 1)

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
    generated so far (`previous`) subtracted (module docstring). Ids outside [0, V) are ignored. The plain one-row
    reference of `adjusted_logits`."""
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


def adjusted_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                    previous: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Raw logits [B, V] (any float dtype and device) -> fp32 logits with NaN read as -inf and each row adjusted by
    its own bias and penalties: `adjust_logits` for the whole batch in a few tensor operations (the rows' biases and
    generated tokens travel to the device in one copy each), the same values bitwise."""
    logits = logits.float().masked_fill(logits.isnan(), float("-inf"))
    B, V = logits.shape
    device = logits.device
    biased = [i for i, p in enumerate(params) if any(t < V for t in p.logit_bias)]
    if biased:  # x + bias[j], ids outside [0, V) ignored
        ids = [(row, t) for row, i in enumerate(biased) for t in params[i].logit_bias if t < V]
        bias = torch.zeros(len(biased), V, dtype=logits.dtype)
        bias[tuple(torch.tensor(ids).T)] = torch.tensor([params[biased[row]].logit_bias[t] for row, t in ids])
        logits = logits.index_put((to_device(biased, device),), logits[biased] + queued(bias, device))
    penalised = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and previous
                 and previous[i]]
    if penalised:  # - (c[j] frequency + presence) where c[j] > 0; ids >= V counted in a spare column and dropped
        tokens = [torch.tensor(previous[i], dtype=torch.long).clamp_max(V) for i in penalised]
        owner = torch.repeat_interleave(torch.arange(len(penalised)), torch.tensor([len(t) for t in tokens]))
        where = queued(owner * (V + 1) + torch.cat(tokens), device)
        counts = torch.zeros(len(penalised) * (V + 1), dtype=logits.dtype, device=device)
        counts = counts.index_add_(0, where, torch.ones_like(where, dtype=logits.dtype)).view(-1, V + 1)[:, :V]
        rates = to_device([[params[i].frequency_penalty, params[i].presence_penalty] for i in penalised], device,
                          logits.dtype)
        penalty = torch.where(counts > 0, counts * rates[:, :1] + rates[:, 1:], 0.0)
        logits = logits.index_put((to_device(penalised, device),), logits[penalised] - penalty)
    return logits


def request_rng(seed: int | None) -> random.Random:
    """A request's own random source (seed None: 0). Every random choice of sampling and speculation is a draw by
    inversion with uniforms from it: a few hundred nanoseconds per uniform, where a `torch.Generator` draw costs
    microseconds in a batch's hot loop. Seeds are taken modulo 2^64 (`random.Random` alone would give s and -s one
    stream)."""
    return random.Random((seed if seed is not None else 0) % (1 << 64))


def sample_token(logits: torch.Tensor, params: SamplingParams, rng: random.Random,
                 previous: Sequence[int] = ()) -> int:
    """logits [V] -> one token id; `previous`: the tokens generated before it (for the penalties). One row of
    `sample_tokens`."""
    return int(sample_tokens(logits.unsqueeze(0), [params], [rng], [previous])[0])


# Batches of rows with top-k / top-p cuts (and no bias or penalties) sample in one Triton launch that finds the k-th
# logit and the nucleus by radix selection (`ops.triton_sampling.sample_rows_cut_triton`) from CUT_KERNEL_MIN_ROWS
# rows, or at any batch over at most CUT_KERNEL_MAX_VOCAB logits a row; others take the sort below. The kernel is
# one program a row, so its time is a row's walk on one SM until the rows fill the GPU. Measured with top_p 0.95 on
# an H100 (bench/sampling.py, 2026-12-07, host launch included), sort against kernel: 163,840 logits a row
# 0.56 / 1.15 / 2.42 / 7.61 ms against 1.74 / 1.76 / 2.32 / 6.01 at 1 / 16 / 64 / 256 rows; 32,768 logits
# 0.87 / 0.69 / 0.64 / 1.66 against 0.24 / 0.24 / 0.25 / 0.49.
CUT_KERNEL_MIN_ROWS = 128
CUT_KERNEL_MAX_VOCAB = 65536


def cut_kernel_takes(rows: int, vocab: int) -> bool:
    """Whether a batch of `rows` rows of `vocab` logits with cuts samples in the Triton kernel (see above)."""
    return rows >= CUT_KERNEL_MIN_ROWS or vocab <= CUT_KERNEL_MAX_VOCAB


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], rngs: Sequence[random.Random],
                  previous: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Raw logits [B, V] on any device -> one token id per row [B] (long, on that device), each row with its own
    parameters, random source and generated tokens (`previous`, for the penalties). Greedy rows, and rows with no
    finite logit to sample from (+inf wins outright; all -inf leaves nothing), take the argmax of their adjusted
    logits; each other row draws by inversion (`draw_by_inversion`) with one uniform from its own source, which is
    all the randomness it uses: a seeded row draws the same token whatever rows run beside it, on any device. Ties
    in the argmax and the sorts resolve to the lower id."""
    whole = all(p.whole_distribution for p in params)
    if use_triton(logits) and (whole or (cut_kernel_takes(*logits.shape) and all(p.unadjusted for p in params))):
        from openk3.ops import triton_sampling  # one launch; triton is an optional dependency

        temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float64)
        u = uniforms([None if p.greedy else rng for p, rng in zip(params, rngs)])[:, 0]
        if whole:
            return triton_sampling.sample_rows_triton(logits, temperature, u)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.float64)
        return triton_sampling.sample_rows_cut_triton(logits, temperature, u, top_p, top_k)
    logits = adjusted_logits(logits, params, previous)
    picks = logits.argmax(-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return picks
    every = len(sampled) == len(params)
    rows = None if every else to_device(sampled, logits.device)
    part = logits if every else logits[rows]
    finite = part.amax(-1, keepdim=True).isfinite()
    part = torch.where(finite, part, 0.0)  # rows with nothing to sample keep their argmax below
    probs = sampling_probs(part, params if every else [params[i] for i in sampled])
    drawn = draw_by_inversion(probs, uniforms([rngs[i] for i in sampled], logits.device)[:, 0])
    if every:
        return torch.where(finite[:, 0], drawn, picks)
    return picks.index_copy(0, rows, torch.where(finite[:, 0], drawn, picks[rows]))


def uniforms(rngs: Sequence[random.Random | None], device: torch.device | str = "cpu", count: int = 1) -> torch.Tensor:
    """`count` U[0, 1) draws from each random source, as a tensor [len(rngs), count] (fp64) on `device`; a None
    source gives zeros and draws nothing."""
    values = [[rng.random() for _ in range(count)] if rng is not None else [0.0] * count for rng in rngs]
    return to_device(values, device, torch.float64)


def draw_by_inversion(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (each row with positive mass, not necessarily normalised), u [B] in [0, 1) -> per row the first
    token whose cumulative mass exceeds u times the row's total: a draw from the row's distribution. A token of zero
    mass is never drawn (its cumulative mass equals its predecessor's); u * total is kept below the total so that a
    token is always found."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u.to(cdf).unsqueeze(-1) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def sampling_probs(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """Adjusted fp32 logits [V] or [B, V] with a finite maximum per row, and the row's (rows') parameters -> the
    distribution a token is drawn from: softmax of the logits over the temperature, restricted to the top-k and then
    to the top-p nucleus (greedy rows: temperature 1, as if sampled)."""
    if logits.dim() == 1:
        return sampling_probs(logits.unsqueeze(0), [params])[0]
    vocab, device = logits.shape[-1], logits.device
    temperature = to_device([1.0 if p.greedy else p.temperature for p in params], device).unsqueeze(-1)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature  # <= 0: no overflow for any temperature >= floor
    if any(0 < p.top_k < vocab for p in params):
        k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device)
        kth = logits.sort(-1, descending=True).values.gather(-1, k.unsqueeze(-1) - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1 for p in params):
        top_p = to_device([p.top_p if p.top_p < 1 else float("inf") for p in params], device)
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
        cut = before >= top_p.unsqueeze(-1)
        cut[:, 0] = False  # the most likely token stays, whatever top_p (one under fp32's smallest rounds to 0)
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
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
