"""Greedy and temperature sampling in one Triton launch (`ops.triton_sampling`) against `sample_tokens`' PyTorch
form with the same uniforms: odd vocabulary sizes (one entry, below one block, across blocks), bf16 logits, NaN,
+inf and all -inf rows, logits near fp32's limits, temperatures from the floor to large, the extreme uniforms 0 and
1 - 2^-53. On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py), its output poisoned with -1."""

from __future__ import annotations

import random

import pytest
import torch

from openk3.ops import triton_sampling
from openk3.sampling import TEMPERATURE_FLOOR, SamplingParams, sample_tokens
from test_ops_fused import DEV, _Poisoned

INF = float("inf")
# the interpreter's numpy warns where the huge logits overflow to inf on purpose (their exp is then 0)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(triton_sampling, "torch", _Poisoned())


class FixedUniforms:
    """A random source whose draws are given (the extreme uniforms the tests need)."""

    def __init__(self, value: float):
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.mark.parametrize("V", [1, 7, 4096, 4096 + 77, 3 * 4096 + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_draws_what_the_reference_draws(V, dtype):
    gen, rng = torch.Generator().manual_seed(V), random.Random(V)
    rows, params, sources = [], [], []
    for i in range(14):
        x = torch.randn(V, generator=gen) * rng.choice([0.5, 4.0, 30.0])
        case = i % 7
        if case == 1:
            x[rng.randrange(V)] = float("nan")
        elif case == 2:
            x[rng.randrange(V)] = INF
        elif case == 3:
            x.fill_(-INF)
        elif case == 4:
            x = x.sign() * 3e38 * (x.abs() > 1)  # the fp32 limits: exp of a huge difference underflows to 0
        elif case == 5:
            x.fill_(float("nan"))
        rows.append(x.to(dtype).float())  # the reference sees the same values as the kernel
        temperature = 0.0 if i % 5 == 0 else rng.choice([TEMPERATURE_FLOOR, 0.3, 1.0, 7.0])
        params.append(SamplingParams(temperature=temperature))
        sources.append(rng.choice([random.Random(rng.randrange(1 << 30)), FixedUniforms(0.0),
                                   FixedUniforms(1 - 2.0**-53)]))
    logits = torch.stack(rows)
    copies = [FixedUniforms(s.value) if isinstance(s, FixedUniforms) else random.Random() for s in sources]
    for c, s in zip(copies, sources):
        if isinstance(s, random.Random):
            c.setstate(s.getstate())
    want = sample_tokens(logits, params, copies).tolist()
    temperature = torch.tensor([p.temperature if not p.greedy else 0.0 for p in params], dtype=torch.float64)
    u = torch.tensor([s.random() if not p.greedy else 0.0 for s, p in zip(sources, params)], dtype=torch.float64)
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
