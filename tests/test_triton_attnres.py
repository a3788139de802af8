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


def blocks_case(N, Q, shape, D, seed, scale=1.0, dtypes=(FP32, BF16)):
    """N block sums (the first in dtypes[0], as the fp32 embedding under autocast; the rest in dtypes[1]) with
    per-block scales from 1 to 1e3 * scale, and Q fp32 queries."""
    g = torch.Generator().manual_seed(seed)
    blocks = [(torch.randn(*shape, D, generator=g) * scale * 10.0 ** (3 * n / max(N - 1, 1)))
              .to(dtypes[min(n, 1)]) for n in range(N)]
    return blocks, torch.randn(Q, D, generator=g) * 2


@pytest.mark.parametrize(("N", "Q", "shape", "D", "scale", "dq_programs"), [
    (1, 3, (2, 3), 5, 1.0, 64),  # one block sum (the first epoch): the mixes are its fp32 copy
    (2, 1, (7,), 70, 1.0, 64),  # one query (a stream without a plan)
    (3, 8, (2, 25), 64, 1.0, 3),  # k3-debug's epochs: dq over several row ranges and column tiles, a partial last
    (5, 17, (1, 9), 33, 1e-3, 2),  # odd counts everywhere, more queries than a dq tile's 16, small values
    (3, 2, (3,), 130, 1e4, 64),  # large values: scores in the hundreds, the softmax one-hot
])
def test_blocks_kernel_matches_reference(N, Q, shape, D, scale, dq_programs, monkeypatch):
    """Phase 1 in Triton (`blocks_triton`) against `attn_res_blocks`' PyTorch form in fp64: every mix and lse and
    the gradients of the queries and of every block sum, for random gradients of all outputs."""
    monkeypatch.setattr(triton_attnres, "DQ_ROW_PROGRAMS", dq_programs)
    monkeypatch.setattr(triton_attnres, "DQ_BLOCK_R", 16)
    monkeypatch.setattr(triton_attnres, "DQ_BLOCK_C", 32)
    blocks, queries = blocks_case(N, Q, shape, D, seed=N * Q + D, scale=scale)
    g = torch.Generator().manual_seed(3)
    dmix = [torch.randn(*shape, D, generator=g) for _ in range(Q)]
    dlse = [torch.randn(*shape, generator=g) for _ in range(Q)]

    def run(fn, dtype):
        leaves = [b.detach().to(DEV, dtype if b.dtype == FP32 else b.dtype).requires_grad_() for b in blocks]
        q = queries.detach().to(DEV, dtype).requires_grad_()
        mix, lse = fn(leaves, q)
        outs = list(mix) + list(lse)
        torch.autograd.backward(outs, [t.to(DEV, o.dtype) for t, o in zip(dmix + dlse, outs)])
        return [t.detach() for t in outs] + [q.grad] + [b.grad for b in leaves]

    got = run(lambda b, q: triton_attnres.blocks_triton(b, q, 1e-5), FP32)
    want = run(lambda b, q: attnres.attn_res_blocks(b, q, 1e-5), torch.float64)
    assert [t.dtype for t in got[:2 * Q + 1]] == [FP32] * (2 * Q + 1)
    assert [t.dtype for t in got[2 * Q + 1:]] == [b.dtype for b in blocks]
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = a.double().cpu(), b.double().cpu()
        assert torch.isfinite(a).all(), f"tensor {i}: non-finite values (an unwritten element?)"
        if i > 2 * Q and blocks[i - 2 * Q - 1].dtype == BF16:
            b = b.to(BF16).double()  # the reference's fp64 gradient, rounded as the kernel's is
        err = float((a - b).norm() / b.norm().clamp_min(1e-30))
        assert err <= (8e-3 if i > 2 * Q and blocks[i - 2 * Q - 1].dtype == BF16 else 1e-5), (i, err)


def test_blocks_kernel_with_unused_outputs():
    """Mixes and lse rows that get no gradient (a query whose sublayer did not run backward) count as zeros."""
    blocks, queries = blocks_case(2, 3, (4,), 16, seed=5)

    def block_grads(fn):
        leaves = [b.to(DEV).requires_grad_() for b in blocks]
        mix, lse = fn(leaves, queries.to(DEV), 1e-5)
        (mix[1].sum() + lse[2].sum()).backward()
        return [b.grad.cpu() for b in leaves]

    for a, b in zip(block_grads(triton_attnres.blocks_triton), block_grads(attnres.attn_res_blocks_reference)):
        torch.testing.assert_close(a, b, rtol=8e-3, atol=1e-5)


def test_attn_res_blocks_takes_the_kernel_where_it_fits(monkeypatch):
    """`attn_res_blocks` calls the phase-1 kernel where `use_triton` says so (forced for CPU tensors here), also
    while torch.compile traces (a graph break), with fp32 queries and tiles that fit; otherwise the PyTorch form."""
    calls = []
    kernel = triton_attnres.blocks_triton
    monkeypatch.setattr(triton_attnres, "blocks_triton", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setattr(attnres, "use_triton", lambda t, compiled=False: compiled)
    blocks, queries = blocks_case(3, 4, (2, 3), 16, seed=6)
    blocks, queries = [b.to(DEV) for b in blocks], queries.to(DEV)
    fast = attnres.attn_res_blocks(blocks, queries)
    assert calls == [1]
    compiled = torch.compile(attnres.attn_res_blocks, backend="eager")(blocks, queries)
    assert calls == [1, 1] and all(torch.equal(a, b) for a, b in zip(fast.mix + fast.lse, compiled.mix + compiled.lse))
    attnres.attn_res_blocks(blocks, queries.double())
    monkeypatch.setattr(triton_attnres, "MAX_TILE_ELEMENTS", 16)
    slow = attnres.attn_res_blocks(blocks, queries)
    assert calls == [1, 1]
    for a, b in zip(fast.mix + fast.lse, slow.mix + slow.lse):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
