"""The row kernel over experts (`ops.triton_expert_rows`) with plain weights against one product per expert
(`ops.moe.grouped_matmul_loop`): odd sizes, empty experts (first, middle, last), several rows of one expert, split-K,
fp32 and bf16, large magnitudes; `ops.moe.experts_forward_rows` against the sorted path; and `experts_forward`'s
dispatch to it (fewer rows than experts, without autograd, where Triton runs). Its MXFP4 form is covered by
tests/test_triton_mxfp4.py (method "rows"). On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py),
its output NaN-poisoned."""

from __future__ import annotations

import pytest
import torch

from openk3.ops import moe as moe_ops
from openk3.ops import triton_expert_rows, triton_experts_common
from openk3.ops.activations import glu_activation
from test_ops_fused import DEV, _Poisoned
from test_ops_moe import moe_case


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(triton_experts_common, "torch", _Poisoned())  # (the output buffers: split_output)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("counts", "N", "K", "splits"), [
    ([3, 0, 2, 1, 0], 45, 96, 0),  # empty experts in the middle and last, N not a multiple of BLOCK_N
    ([0, 1, 1, 1], 33, 300, 0),  # the first expert empty, K not a multiple of the step
    ([1] * 7, 64, 520, 3),  # one row each, K split over three programs (the last part partial)
    ([4], 70, 32, 0),  # one expert, its rows re-reading its weights
])
def test_rows_match_one_product_per_expert(counts, N, K, splits, dtype):
    counts = torch.tensor(counts)
    E, M = counts.numel(), int(counts.sum())
    g = torch.Generator().manual_seed(M + N + K)
    weight = (torch.randn(E, N, K, generator=g) * torch.logspace(-3, 3, N).unsqueeze(-1)).to(dtype)
    x = torch.randn(M, K, generator=g).to(dtype)
    want = moe_ops.grouped_matmul_loop(x.float(), counts, weight.float())
    got = triton_expert_rows.expert_rows(x.to(DEV), counts.to(DEV), weight.to(DEV), splits=splits).cpu()
    assert got.dtype == dtype and torch.isfinite(got).all()
    eps = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    scale = want.abs().amax(-1, keepdim=True)
    assert ((got.float() - want) / scale).abs().max() <= 2 * eps


def test_bad_operands():
    x, counts = torch.randn(3, 16), torch.tensor([2, 1])
    with pytest.raises(ValueError, match=r"needs weight \[E, N, K\] and counts \[E\]"):
        triton_expert_rows.expert_rows(x, counts, torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"needs weight \[E, N, K\] and counts \[E\]"):
        triton_expert_rows.expert_rows(x, torch.tensor([3]), torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="splits must be >= 0"):
        triton_expert_rows.expert_rows(x, counts, torch.randn(2, 5, 16), splits=-1)
    assert triton_expert_rows.expert_rows(x[:0], torch.tensor([0, 0]), torch.randn(2, 5, 16)).shape == (0, 5)


def test_experts_forward_rows_equals_the_sorted_path_and_is_dispatched(monkeypatch):
    """Three tokens, two experts each, among 9 (6 rows < 9 experts, one expert without a token): the row kernel's
    MoE against the sorted path; `experts_forward` takes it without autograd where Triton runs (patched on here),
    not with autograd, nor for as many rows as experts."""
    (x, gate_up, down), r = moe_case(E=9, I=16, Din=40, Dout=24, N=3, k=2, seed=5, dead=(4,))
    act = glu_activation("swiglu")
    with torch.enable_grad():
        want = moe_ops.experts_forward(x, r.indices, r.weights, gate_up, down, act)
    dev = [t.to(DEV) for t in (x, r.indices, r.weights, gate_up, down)]
    with torch.no_grad():
        got = moe_ops.experts_forward_rows(*dev, act).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (x9, gate_up9, down9), r9 = moe_case(E=9, I=16, Din=40, Dout=24, N=5, k=2, seed=6)  # 10 rows >= 9 experts
    calls = []  # (the cases are routed before use_triton is patched: on a GPU the routing kernel takes CUDA only)
    monkeypatch.setattr(moe_ops, "use_triton", lambda *a, **kw: True)
    monkeypatch.setattr(moe_ops, "experts_forward_rows", lambda *a: calls.append(a[0].shape[0]) or got)
    with torch.no_grad():
        moe_ops.experts_forward(x, r.indices, r.weights, gate_up, down, act)
    moe_ops.experts_forward(x, r.indices, r.weights, gate_up, down, act)  # autograd on: the sorted path
    with torch.no_grad():
        moe_ops.experts_forward(x9, r9.indices, r9.weights, gate_up9, down9, act)
    assert calls == [3]


def test_rows_stay_whole_in_inductor_compiled_code():
    """The compiled decode step (Inductor) keeps the row kernel's custom op whole around the rest of the MoE."""
    (x, gate_up, down), r = moe_case(E=9, I=16, Din=40, Dout=24, N=3, k=2, seed=7)
    act = glu_activation("swiglu")
    dev = [t.to(DEV) for t in (x, r.indices, r.weights, gate_up, down)]
    with torch.no_grad():
        want = moe_ops.experts_forward_rows(*dev, act)
        torch._dynamo.reset()
        got = torch.compile(lambda x: moe_ops.experts_forward_rows(x, *dev[1:], act), backend="inductor",
                            fullgraph=True)(dev[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
