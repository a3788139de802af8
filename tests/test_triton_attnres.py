"""Block AttnRes phase 2 in Triton (`ops.triton_attnres`, inference) against `attn_res_merge`'s PyTorch form, on
phase 1's strided rows, odd widths and extreme logits; and when `attn_res_merge` takes it. On CPU the kernel runs
under TRITON_INTERPRET=1 (tests/conftest.py), its output buffer NaN-poisoned so an unwritten element fails."""

from __future__ import annotations

import pytest
import torch

import openk3.ops.attnres as attnres
from openk3.ops import triton_attnres
from test_ops_fused import DEV, _Poisoned


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(triton_attnres, "torch", _Poisoned())


def merge_case(B, T, Q, D, partial_dtype, seed, lse_shift=0.0, scale=1.0):
    """Phase 1's result for Q queries ([B, T, Q, D] mix, [B, T, Q] lse) and a partial sum; the case's query q = 1
    row, as the stream slices it."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(B, T, Q, D, generator=g) * scale
    lse = torch.randn(B, T, Q, generator=g) * 3 + lse_shift
    partial = (torch.randn(B, T, D, generator=g) * scale).to(partial_dtype)
    query = torch.randn(D, generator=g)
    return [t.to(DEV) for t in (mix[..., 1, :], lse[..., 1], partial, query)]


def reference(mix, lse, partial, query, eps, dtype, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(attnres, "use_triton", lambda t: False)
        return attnres.attn_res_merge(mix, lse, partial, query, eps, dtype)


@pytest.mark.parametrize(("B", "T", "Q", "D", "partial_dtype", "lse_shift", "scale"), [
    (2, 3, 2, 5, torch.float32, 0.0, 1.0),  # D far from a power of two
    (1, 7, 3, 70, torch.bfloat16, 0.0, 1.0),  # the serving case: a bf16 partial sum, fp32 phase 1
    (3, 1, 2, 130, torch.float32, 80.0, 1.0),  # the blocks dominate (e^(lse - s) overflows unshifted)
    (1, 4, 2, 33, torch.float32, -80.0, 1e3),  # the partial sum dominates, large values
])
def test_merge_kernel_matches_reference(B, T, Q, D, partial_dtype, lse_shift, scale, monkeypatch):
    mix, lse, partial, query = merge_case(B, T, Q, D, partial_dtype, seed=D, lse_shift=lse_shift, scale=scale)
    for dtype in (partial_dtype, torch.float32):
        got = triton_attnres.attn_res_merge_triton(mix, lse, partial, query, 1e-5, dtype)
        want = reference(mix, lse, partial, query, 1e-5, dtype, monkeypatch)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        tol = dict(rtol=1e-5, atol=1e-5 * scale) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
        torch.testing.assert_close(got.cpu(), want.cpu(), **tol)


def test_attn_res_merge_takes_the_kernel_only_without_autograd(monkeypatch):
    """`use_triton` yes (forced here for CPU tensors) and no gradient wanted: the kernel; a partial sum that needs
    its gradient: the PyTorch form, whose backward exists."""
    mix, lse, partial, query = merge_case(2, 3, 2, 6, torch.float32, seed=1)
    calls = []
    kernel = triton_attnres.attn_res_merge_triton
    monkeypatch.setattr(triton_attnres, "attn_res_merge_triton", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setattr(attnres, "use_triton", lambda t: True)
    with torch.no_grad():
        fast = attnres.attn_res_merge(mix, lse, partial, query)
    assert calls == [1]
    slow = attnres.attn_res_merge(mix, lse, partial.requires_grad_(), query)
    assert calls == [1] and slow.requires_grad
    torch.testing.assert_close(fast, slow.detach(), rtol=1e-5, atol=1e-6)
