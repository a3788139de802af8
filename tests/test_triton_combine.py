"""The MoE combine without autograd in one Triton launch (`ops.triton_combine`) against `experts_forward_sorted`'s
PyTorch form (the sorted rows put back by index_copy, then `weighted_sum` in fp32): random sort orders, k of 1, 2
and 8, widths across several column programs and not a multiple of them, bf16 and fp32 rows, weights from 1e-30 to
1e30, no tokens at all. On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) into a NaN-filled
output, so an element it forgets to write fails."""

from __future__ import annotations

import pytest
import torch

from openk3.ops import moe as moe_ops
from openk3.ops import triton_combine
from test_ops_fused import DEV, _Poisoned


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(triton_combine, "torch", _Poisoned())
    monkeypatch.setattr(triton_combine, "BLOCK_D", 64)  # several column programs at these widths


def reference(y_sorted, order, weights, dtype):
    N, k = weights.shape
    return moe_ops.weighted_sum(torch.empty_like(y_sorted).index_copy_(0, order, y_sorted).view(N, k, -1), weights,
                                dtype)


@pytest.mark.parametrize(("N", "k", "D"), [(5, 8, 150), (1, 1, 64), (9, 2, 1), (3, 8, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_matches_the_reference(N, k, D, dtype):
    g = torch.Generator().manual_seed(N * 100 + k * 10 + D)
    y_sorted = (torch.randn(N * k, D, generator=g) * torch.logspace(-3, 3, D)).to(dtype)
    order = torch.randperm(N * k, generator=g)
    weights = torch.rand(N, k, generator=g)
    weights[0, 0] = 1e-30  # (extremes: products far below and above the others)
    weights[-1, -1] = 1e30 if dtype == torch.float32 else 1e3
    want = reference(y_sorted, order, weights, dtype)
    got = triton_combine.combine_sorted_triton(y_sorted.to(DEV), order.to(DEV), weights.to(DEV), dtype).cpu()
    assert got.dtype == dtype and got.shape == (N, D) and torch.isfinite(got).all()
    # the same fp32 products, summed in another order with fused multiply-adds: within k fp32 roundings of the
    # terms' magnitudes, plus one rounding of the output
    terms = (torch.empty_like(y_sorted).index_copy_(0, order, y_sorted).view(N, k, D).float().abs()
             * weights.unsqueeze(-1)).sum(1)
    bound = terms * k * torch.finfo(torch.float32).eps + want.float().abs() * torch.finfo(dtype).eps + 1e-37
    assert ((got.float() - want.float()).abs() <= bound).all()


def test_no_tokens_and_a_bad_order():
    empty = triton_combine.combine_sorted_triton(torch.zeros(0, 7, device=DEV), torch.zeros(0, dtype=torch.long,
                                                 device=DEV), torch.zeros(0, 8, device=DEV), torch.bfloat16)
    assert empty.shape == (0, 7) and empty.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="order"):
        triton_combine.combine_sorted_triton(torch.zeros(6, 7), torch.arange(5), torch.zeros(3, 2), torch.float32)


def test_experts_forward_sorted_takes_the_kernel_without_autograd(monkeypatch):
    """`experts_forward_sorted` without autograd combines through the kernel where `use_triton` says so, with the
    reference's result (to the output's rounding); with autograd on, the differentiable combine."""
    g = torch.Generator().manual_seed(3)
    N, k, E, D = 6, 3, 5, 40
    x = torch.randn(N, D, generator=g)
    indices = torch.rand(N, E, generator=g).topk(k, dim=-1).indices
    weights = torch.rand(N, k, generator=g)
    scale = torch.linspace(0.5, 2.0, E)

    def mlp(x_sorted, counts):  # each expert scales its rows
        return x_sorted * scale.repeat_interleave(counts, output_size=x_sorted.shape[0]).unsqueeze(-1)

    with torch.no_grad():
        want = moe_ops.experts_forward_sorted(x, indices, weights, E, mlp)
        calls = []
        kernel = triton_combine.combine_sorted_triton
        monkeypatch.setattr(triton_combine, "combine_sorted_triton", lambda *a: calls.append(1) or kernel(*a))
        monkeypatch.setattr(moe_ops, "use_triton", lambda t, compiled=False: True)
        got = moe_ops.experts_forward_sorted(x, indices, weights, E, mlp)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with torch.enable_grad():
        moe_ops.experts_forward_sorted(x.requires_grad_(), indices, weights, E, mlp)
    assert calls == [1]
