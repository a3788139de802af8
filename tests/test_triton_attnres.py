"""Block AttnRes phase 2 in Triton (`ops.triton_attnres`, inference) against `attn_res_merge`'s PyTorch form, on
phase 1's strided rows, odd widths and extreme logits; and when `attn_res_merge` takes it. On CPU the kernel runs
under TRITON_INTERPRET=1 (tests/conftest.py), its output buffer NaN-poisoned so an unwritten element fails."""

from __future__ import annotations

import os

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


def merge_norm_case(rows, D, seed, lse_shift=0.0, scale=1.0, addend_dtype=torch.bfloat16,
                    partial_dtype=torch.bfloat16):
    """mix, lse, partial, addend (or None), query, norm weight for `merge_norm_triton`: fp32 phase 1, partial sums
    in the given dtypes (bf16 under autocast: the sublayers' outputs and their sums within a block)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(2, rows, D, generator=g) * scale
    lse = torch.randn(2, rows, generator=g) * 3 + lse_shift
    partial = (torch.randn(2, rows, D, generator=g) * scale).to(partial_dtype)
    addend = (torch.randn(2, rows, D, generator=g) * scale).to(addend_dtype) if addend_dtype is not None else None
    query = torch.randn(D, generator=g)
    weight = 1 + 0.3 * torch.randn(D, generator=g)
    return mix, lse, partial, addend, query, weight


BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize(("rows", "D", "lse_shift", "scale", "partial_dtype", "addend_dtype", "out_dtype"), [
    (3, 5, 0.0, 1.0, BF16, BF16, BF16),  # D far from a power of two, the training step's dtypes
    (7, 70, 0.0, 1.0, FP32, FP32, FP32),
    (6, 64, 0.0, 1.0, FP32, BF16, BF16),  # the embedding (fp32) as the partial sum, a bf16 sublayer output
    (5, 130, 80.0, 1.0, FP32, FP32, FP32),  # the blocks dominate the merge
    (4, 33, -80.0, 1e3, FP32, None, BF16),  # the partial sum dominates, large values, nothing to add
    (2, 40, 0.0, 1.0, BF16, None, FP32),
])
def test_merge_norm_kernel_matches_reference(rows, D, lse_shift, scale, partial_dtype, addend_dtype, out_dtype):
    """The Triton merge + norm (`merge_norm_triton`) against `attn_res_merge_norm`'s PyTorch form in fp64: both
    outputs and the gradients of every input (mix, lse, partial, addend, query, norm weight), for random output
    gradients of both outputs."""
    case = merge_norm_case(rows, D, seed=D, lse_shift=lse_shift, scale=scale, addend_dtype=addend_dtype,
                           partial_dtype=partial_dtype)
    g = torch.Generator().manual_seed(1)
    dx = torch.randn(2, rows, D, generator=g).to(out_dtype)
    dp = torch.randn(2, rows, D, generator=g) * scale

    def run(fn, dtype):
        leaves = [t.detach().to(DEV, dtype if t.is_floating_point() and t.dtype == torch.float32 else t.dtype)
                  .requires_grad_() if t is not None else None for t in case]
        x, partial = fn(*leaves)
        outs, grads = [x, partial], [dx.to(DEV, x.dtype), dp.to(DEV, partial.dtype)]
        torch.autograd.backward(outs, grads)
        tensors = outs + [t.grad for t in leaves if t is not None]
        return [t.detach().double().cpu() for t in tensors], [t.dtype for t in tensors]

    kernel = lambda mix, lse, p, a, q, w: triton_attnres.merge_norm_triton(mix, lse, p, a, q, 1e-5, w, 1e-6,
                                                                           out_dtype)
    ref = lambda mix, lse, p, a, q, w: attnres.attn_res_merge_norm(mix, lse, p, a, q, 1e-5, mix.dtype, w, 1e-6)
    (got, dtypes), (want, _) = run(kernel, torch.float32), run(ref, torch.float64)
    assert dtypes[0] == out_dtype and len(got) == len(want) == 7 + (addend_dtype is not None)
    # Triton's interpreter converts fp32 to bf16 by truncation, not to nearest as the GPU and PyTorch do: on CPU a
    # bf16 new partial sum (partial + addend) differs from the reference's by up to an ulp, and all that follows
    # from it by that much
    truncated = os.environ.get("TRITON_INTERPRET") == "1" and BF16 in (partial_dtype, addend_dtype)
    for i, (a, b, dtype) in enumerate(zip(got, want, dtypes)):
        assert torch.isfinite(a).all(), f"tensor {i}: non-finite values (an unwritten element?)"
        if i == 0:
            b = b.to(out_dtype).double()  # the reference's fp64 x, rounded as the kernel's output is
        err = float((a - b).norm() / b.norm().clamp_min(1e-30))
        assert err <= (8e-3 if dtype == BF16 else 4e-3 if truncated else 1e-5), (i, err)


def test_merge_norm_takes_the_kernel_on_the_fp32_stream(monkeypatch):
    """`attn_res_merge_norm` calls the kernel for the fp32 stream where `use_triton` says so (forced for CPU tensors
    here), also while torch.compile traces (a graph break), and keeps the PyTorch form for other dtypes."""
    calls = []
    kernel = triton_attnres.merge_norm_triton
    monkeypatch.setattr(triton_attnres, "merge_norm_triton", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setattr(attnres, "use_triton", lambda t, compiled=False: compiled)
    mix, lse, partial, addend, query, weight = (t.to(DEV) for t in merge_norm_case(3, 16, seed=2))
    args = (mix, lse, partial, addend, query, 1e-5, torch.float32, weight, 1e-6, torch.bfloat16)
    x, p = attnres.attn_res_merge_norm(*args)
    assert calls == [1] and x.dtype == torch.bfloat16 and p.dtype == torch.bfloat16
    compiled = torch.compile(attnres.attn_res_merge_norm, backend="eager")
    xc, pc = compiled(*args)
    assert calls == [1, 1] and torch.equal(xc, x) and torch.equal(pc, p)
    attnres.attn_res_merge_norm(mix.double(), lse.double(), partial.double(), addend, query.double(), 1e-5,
                                torch.float64, weight.double(), 1e-6)
    assert calls == [1, 1]

