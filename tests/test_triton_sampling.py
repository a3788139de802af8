"""Greedy and temperature sampling in one Triton launch (`ops.triton_sampling`) against `sample_tokens`' PyTorch
form, and speculative decoding's rejection kernel against `accept_drafts`, with the same uniforms: odd vocabulary
sizes (one entry, below one block, across blocks), bf16 logits, NaN, +inf and all -inf rows, logits near fp32's
limits, temperatures from the floor to large, the extreme uniforms 0 and 1 - 2^-53; and the wrappers that take the
kernels where Triton applies. On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), their outputs
poisoned with -1."""

from __future__ import annotations

import random

import pytest
import torch

from openk3 import sampling
from openk3.draft import accept_drafts, speculative, target_distributions
from openk3.ops import triton_sampling
from openk3.sampling import TEMPERATURE_FLOOR, SamplingParams, sample_tokens
from test_ops_fused import DEV, _Poisoned

INF = float("inf")
# the interpreter's numpy warns where huge or infinite logits give inf or NaN on purpose (masked or exp'd to 0)
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(triton_sampling, "torch", _Poisoned())


class FixedUniforms:
    """A random source whose draws are given (the extreme uniforms the tests need)."""

    def __init__(self, value: float):
        self.value = value

    def random(self) -> float:
        return self.value


def awkward_row(V: int, kind: str, gen: torch.Generator, rng: random.Random) -> torch.Tensor:
    """Random logits [V] of a kind: "plain", "nan" / "inf" (one such entry), "-inf" / "all nan" (every entry),
    "limits" (+-3e38 and 0: exp of a huge difference underflows to 0), "ties" (a few distinct values)."""
    x = torch.randn(V, generator=gen) * rng.choice([0.5, 4.0, 30.0])
    if kind == "nan":
        x[rng.randrange(V)] = float("nan")
    elif kind == "inf":
        x[rng.randrange(V)] = INF
    elif kind == "-inf":
        x.fill_(-INF)
    elif kind == "limits":
        x = x.sign() * 3e38 * (x.abs() > 1)
    elif kind == "all nan":
        x.fill_(float("nan"))
    elif kind == "ties":
        x = torch.randint(0, 3, (V,), generator=gen).float() * rng.choice([0.01, 1.0])
    return x


def awkward_source(rng: random.Random):
    """A row's random source: seeded, or one that always gives the extreme uniforms 0 and 1 - 2^-53."""
    return rng.choice([random.Random(rng.randrange(1 << 30)), FixedUniforms(0.0), FixedUniforms(1 - 2.0**-53)])


def kernel_draws(params: list, sources: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' per-row temperature (0: greedy) and uniform (drawn from the row's source unless greedy), fp64."""
    temperature = torch.tensor([p.temperature if not p.greedy else 0.0 for p in params], dtype=torch.float64)
    u = torch.tensor([s.random() if not p.greedy else 0.0 for s, p in zip(sources, params)], dtype=torch.float64)
    return temperature, u


def replayed(sources: list) -> list:
    """Copies of the random sources that will draw what they draw."""
    copies = [FixedUniforms(s.value) if isinstance(s, FixedUniforms) else random.Random() for s in sources]
    for c, s in zip(copies, sources):
        if isinstance(s, random.Random):
            c.setstate(s.getstate())
    return copies


@pytest.mark.parametrize("V", [1, 7, 4096, 4096 + 77, 3 * 4096 + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_draws_what_the_reference_draws(V, dtype):
    gen, rng = torch.Generator().manual_seed(V), random.Random(V)
    rows, params, sources = [], [], []
    for i in range(14):
        x = awkward_row(V, ("plain", "nan", "inf", "-inf", "limits", "all nan", "plain")[i % 7], gen, rng)
        rows.append(x.to(dtype).float())  # the reference sees the same values as the kernel
        temperature = 0.0 if i % 5 == 0 else rng.choice([TEMPERATURE_FLOOR, 0.3, 1.0, 7.0])
        params.append(SamplingParams(temperature=temperature))
        sources.append(awkward_source(rng))
    logits = torch.stack(rows)
    want = sample_tokens(logits, params, replayed(sources)).tolist()
    temperature, u = kernel_draws(params, sources)
    got = triton_sampling.sample_rows_triton(logits.to(dtype).to(DEV), temperature, u).tolist()
    assert got == want
    assert [want[i] for i in range(3, 14, 7)] == [0, 0]  # all -inf: the argmax, whatever the temperature


def test_a_strided_batch_and_an_empty_one():
    """Rows of a wider buffer (the engine passes logits[:, :vocab]) and a batch of no rows."""
    wide = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    t, u = torch.full((5,), 0.7, dtype=torch.float64), torch.linspace(0, 0.99, 5, dtype=torch.float64)
    got = triton_sampling.sample_rows_triton(wide[:, :33].to(DEV), t, u).tolist()
    want = triton_sampling.sample_rows_triton(wide[:, :33].contiguous().to(DEV), t, u).tolist()
    assert got == want and all(0 <= g < 33 for g in got)
    assert triton_sampling.sample_rows_triton(wide[:0].to(DEV), t[:0], u[:0]).numel() == 0


@pytest.mark.parametrize("K,V", [(1, 1), (2, 7), (3, 50), (3, 4096 + 77)])
def test_rejection_kernel_keeps_what_the_reference_keeps(K, V):
    """reject_rows_triton against accept_drafts on the draft's target_distributions, with the same uniforms: sampled
    rows whose drafts come from the draft (so some are accepted) or are arbitrary ids (mostly rejected), greedy
    rows, the extreme uniforms, and target or draft rows with NaN, +inf or no finite logit."""
    gen, rng = torch.Generator().manual_seed(K * V), random.Random(K * V)
    B = 24
    target = torch.randn(B, K + 1, V, generator=gen) * 2
    draft = target[:, :K] + torch.randn(B, K, V, generator=gen)  # near the target: drafts are often accepted
    params, drafted, sources = [], [], []
    for b in range(B):
        case = b % 8
        if case == 1:
            target[b, rng.randrange(K + 1), rng.randrange(V)] = float("nan")
        elif case == 2:
            target[b, rng.randrange(K + 1), rng.randrange(V)] = INF
        elif case == 3:
            target[b, rng.randrange(K + 1)] = -INF
        elif case == 4:
            draft[b, rng.randrange(K), rng.randrange(V)] = INF
        temperature = 0.0 if case == 5 else rng.choice([TEMPERATURE_FLOOR, 0.5, 1.0, 3.0])
        params.append(SamplingParams(temperature=temperature))
        sources.append(rng.choice([random.Random(rng.randrange(1 << 30))] * 4 + [FixedUniforms(0.0),
                                                                               FixedUniforms(1 - 2.0**-53)]))
    q = target_distributions(draft.reshape(B * K, V), [p for p in params for _ in range(K)]).view(B, K, V)
    for b in range(B):
        if b % 3 == 2:  # arbitrary drafted ids
            drafted.append([rng.randrange(V) for _ in range(K)])
        else:  # drawn from the draft
            drafted.append([int(torch.multinomial(q[b, i], 1, generator=gen)) for i in range(K)])
    want = accept_drafts(drafted, q, target, params, replayed(sources))
    u = torch.tensor([[s.random() for _ in range(K + 1)] if not p.greedy else [0.0] * (K + 1)
                      for s, p in zip(sources, params)], dtype=torch.float64)
    temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float64)
    out = triton_sampling.reject_rows_triton(draft.to(DEV), target.to(DEV), torch.tensor(drafted), temperature, u)
    got = [[*d[:a], t] for d, (a, t) in zip(drafted, out.tolist())]
    assert got == want
    if V > 1:  # (one token: every draft is the target's)
        assert 0 < sum(len(w) - 1 for w in want) < B * K  # some drafts accepted, some rejected


def test_sample_tokens_and_accept_drafts_on_logits_take_the_kernels_where_triton_applies(monkeypatch):
    """The dispatching wrappers (the GPU's path, here under the interpreter) against their PyTorch paths, same seeds:
    temperature-only rows (greedy among them) through `sample_tokens` and `accept_drafts_on_logits`; a rejection
    kernel that fails leaves the same results."""
    gen = torch.Generator().manual_seed(4)
    B, K, V = 6, 2, 300
    params = [SamplingParams(temperature=t) for t in (0.0, 0.7, 1.0, 1.3, TEMPERATURE_FLOOR, 2.0)]
    logits, draft, target = torch.randn(B, V, generator=gen), torch.randn(B, K, V, generator=gen), \
        torch.randn(B, K + 1, V, generator=gen)
    def failing(*args):
        raise RuntimeError("injected kernel failure")

    results = []
    for kernels in (False, True, "failing"):
        monkeypatch.setattr(sampling, "use_triton", lambda t, compiled=False, on=bool(kernels): on)
        monkeypatch.setattr(speculative, "use_triton", lambda t, compiled=False, on=bool(kernels): on)
        monkeypatch.setattr(speculative, "_reject_kernel_failed", False)
        if kernels == "failing":  # the wrapper goes on with PyTorch operations, on the same uniforms
            monkeypatch.setattr(triton_sampling, "reject_rows_triton", failing)
        rngs = [random.Random(i) for i in range(B)]
        tokens = sample_tokens(logits.to(DEV), params, rngs).tolist()
        drafted = [[int(x) for x in torch.randint(0, V, (K,), generator=torch.Generator().manual_seed(b))]
                   for b in range(B)]
        drafted[1] = tokens[1:2] * K  # some plausible drafts
        kept = speculative.accept_drafts_on_logits(drafted, draft.to(DEV), target.to(DEV), params, rngs)
        results.append((tokens, kept, [r.random() for r in rngs]))
    assert results[0] == results[1] == results[2] and speculative._reject_kernel_failed


def separated_top_p(row: torch.Tensor, temperature: float, top_k: int, wanted: float) -> float:
    """A top_p near `wanted` halfway between two of the row's sorted cumulative masses (fp64), so that the nucleus
    does not hang on fp32 rounding (the reference sums in fp32, the kernel in fp64)."""
    z = (row.double() - row.double().max()) / temperature
    if 0 < top_k < z.numel():
        z = z.masked_fill(z < z.sort(descending=True).values[top_k - 1], -INF)
    masses = torch.softmax(z.sort(descending=True).values, 0)
    before = torch.cat([torch.zeros(1, dtype=torch.float64), masses.cumsum(0)])
    i = int(torch.searchsorted(before, torch.tensor([wanted], dtype=torch.float64)).clamp(1, before.numel() - 1))
    return float((before[i - 1] + before[i]) / 2)


@pytest.mark.parametrize("V", [1, 7, 300, 512 + 77, 3 * 4096 + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cut_kernel_draws_what_the_reference_draws(V, dtype, monkeypatch):
    """sample_rows_cut_triton against `sample_tokens`' sort (the reference), same uniforms: top-k (1, below V, V and
    more), top-p (a nucleus of one token to nearly all, its last key shared by many tokens), both, neither;
    greedy rows, ties, NaN, +inf, all -inf and fp32-limit logits."""
    monkeypatch.setattr(sampling, "use_triton", lambda t, compiled=False: False)
    gen, rng = torch.Generator().manual_seed(V + 1), random.Random(V)
    rows, params, sources = [], [], []
    for i in range(16):
        kind = ("plain", "nan", "inf", "-inf", "limits", "ties", "ties", "plain")[i % 8]
        x = awkward_row(V, kind, gen, rng).to(dtype).float()
        temperature = 0.0 if i % 7 == 0 else rng.choice([TEMPERATURE_FLOOR, 0.3, 1.0, 7.0])
        top_k = rng.choice([0, 0, 1, max(1, V // 3), V, V + 5])
        top_p = 1.0
        if rng.random() < 0.8 and torch.isfinite(x).any() and temperature > 0:
            top_p = separated_top_p(torch.nan_to_num(x, nan=-INF), max(temperature, TEMPERATURE_FLOOR), top_k,
                                    rng.choice([0.01, 0.5, 0.9, 0.999]))
        rows.append(x)
        params.append(SamplingParams(temperature=temperature, top_k=top_k, top_p=min(top_p, 1.0)))
        sources.append(awkward_source(rng))
    logits = torch.stack(rows)
    want = sample_tokens(logits, params, replayed(sources)).tolist()
    temperature, u = kernel_draws(params, sources)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.float64)
    got = triton_sampling.sample_rows_cut_triton(logits.to(dtype).to(DEV), temperature, u, top_p, top_k).tolist()
    assert got == want


def test_the_nucleus_takes_tied_tokens_in_index_order():
    """Every logit equal: top_p = (r + 1/2) / V keeps the first r + 1 tokens (the reference's stable sort), so the
    largest uniform draws token r."""
    V = 1000
    u = torch.full((3,), 1 - 2.0**-53, dtype=torch.float64)
    top_p = torch.tensor([0.5 / V, 10.5 / V, 700.5 / V], dtype=torch.float64)
    got = triton_sampling.sample_rows_cut_triton(torch.zeros(3, V, device=DEV), torch.ones(3, dtype=torch.float64),
                                                 u, top_p, torch.zeros(3, dtype=torch.float64)).tolist()
    assert got == [0, 10, 700]


def test_sample_tokens_takes_the_cut_kernel_from_enough_rows(monkeypatch):
    """Batches of rows with cuts (no bias or penalties) take sample_rows_cut_triton from CUT_KERNEL_MIN_ROWS rows on,
    with the reference's tokens; smaller batches (over a vocabulary past CUT_KERNEL_MAX_VOCAB), and any row with a
    bias, take the sort."""
    monkeypatch.setattr(sampling, "CUT_KERNEL_MAX_VOCAB", 199)
    calls = []
    kernel = triton_sampling.sample_rows_cut_triton
    monkeypatch.setattr(triton_sampling, "sample_rows_cut_triton", lambda *a: calls.append(1) or kernel(*a))
    B = sampling.CUT_KERNEL_MIN_ROWS
    logits = torch.randn(B, 200, generator=torch.Generator().manual_seed(5)) * 3
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=i % 3 * 50) for i in range(B)]
    results = []
    for kernels, rows, bias in ((False, B, False), (True, B, False), (True, B - 1, False), (True, B, True)):
        monkeypatch.setattr(sampling, "use_triton", lambda t, compiled=False, on=kernels: on)
        chosen = [SamplingParams(temperature=0.9, logit_bias={3: 1.0})] + params[1:] if bias else params
        calls.clear()
        tokens = sample_tokens(logits[:rows].to(DEV), chosen[:rows], [random.Random(i) for i in range(rows)])
        results.append((tokens.tolist(), len(calls)))
    assert results[1] == (results[0][0], 1)
    assert results[2] == (results[0][0][: B - 1], 0) and results[3][1] == 0
    assert sampling.cut_kernel_takes(1, 199) and not sampling.cut_kernel_takes(B - 1, 200)
