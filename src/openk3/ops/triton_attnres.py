"""Block AttnRes in Triton (SPEC-K3 §4): phase 1 (`blocks_triton`, at the end; the reference is
`openk3.ops.attnres.attn_res_blocks_reference`) and phase 2 (`openk3.ops.attnres.attn_res_merge`, the reference) in
one pass per row.

Phase 2 forward only (`attn_res_merge_triton`): what inference runs (`attn_res_merge` takes it for CUDA tensors when
no gradient is wanted); in PyTorch the merge is 13 small operations, two per decoder layer, and a serving prefill
of a short prompt is bound by launching such operations, not by their arithmetic.

    s   = (p . q) r0,  r0 = 1 / sqrt(mean(p^2) + eps)     p: the partial sum in fp32, q: the query (norm weight * w)
    out = w0 p + w1 mix,  (w0, w1) = softmax(s, lse)      shifted by their max

With the residual add before it and the sublayer's pre-norm after it, forward and backward (`merge_norm_triton`,
the training step's form; the reference is `attn_res_merge_norm`'s PyTorch path):

    p = partial + addend (rounded to their dtype);   x = out r1 weight,  r1 = 1 / sqrt(mean(out^2) + norm_eps)
    backward, per row (y = out r1, g = dx weight):
      d out  = r1 (g - y mean(g y));          d mix = w1 d out;   dweight = sum over rows of dx y
      dw0 = d out . p,  dw1 = d out . mix;    t = w0 dw0 + w1 dw1;  ds = w0 (dw0 - t),  dlse = w1 (dw1 - t)
      dp = w0 d out + ds r0 q - ds (p . q) r0^3 p / D  (+ the gradient of the returned p);  dq = sum of ds r0 p
One pass over the rows each way, the two sums over rows (dweight, dq) as per-program partials: torch.compile's
version took a forward and four backward kernels, re-reading the rows for each sum over them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(p_ptr, mix_ptr, lse_ptr, q_ptr, out_ptr, n_cols, mix_row_stride, lse_stride, eps,
                  BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    m = c < n_cols
    p = tl.load(p_ptr + row * n_cols + c, mask=m, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + c, mask=m, other=0.0).to(tl.float32)
    s = tl.sum(p * q, axis=0) / tl.sqrt(tl.sum(p * p, axis=0) / n_cols + eps)
    lse = tl.load(lse_ptr + row * lse_stride).to(tl.float32)
    top = tl.maximum(s, lse)
    e_p, e_b = tl.exp(s - top), tl.exp(lse - top)
    mix = tl.load(mix_ptr + row * mix_row_stride + c, mask=m, other=0.0).to(tl.float32)
    out = (e_p * p + e_b * mix) / (e_p + e_b)
    tl.store(out_ptr + row * n_cols + c, out.to(out_ptr.dtype.element_ty), mask=m)


def attn_res_merge_triton(mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, query: torch.Tensor,
                          eps: float, dtype: torch.dtype) -> torch.Tensor:
    """`attn_res_merge`'s value (mix [..., D] and lse [...] may be strided views of phase 1's [..., Q, D] and
    [..., Q]) in `dtype`; no autograd."""
    D = partial.shape[-1]
    p2 = partial.reshape(-1, D).contiguous()
    mix2, lse1 = _mix_rows(mix, D), lse.reshape(-1)  # views: the collapsed rows keep one stride
    out = torch.empty(p2.shape, dtype=dtype, device=partial.device)
    if out.numel():
        _merge_kernel[(p2.shape[0],)](p2, mix2, lse1, query.contiguous(), out, D, mix2.stride(0), lse1.stride(0),
                                      eps, **_row_block(D))
    return out.view(partial.shape)


def _mix_rows(mix: torch.Tensor, D: int) -> torch.Tensor:
    """mix [..., D] as rows [n, D] with unit column stride (a view of phase 1's result where possible)."""
    mix2 = mix.reshape(-1, D)
    return mix2 if mix2.stride(-1) == 1 else mix2.contiguous()


def _row_block(D: int, warps: int | None = None) -> dict:
    """One program per row of D: the block and warps (by the width unless given)."""
    block = triton.next_power_of_2(D)
    return dict(BLOCK_D=block, num_warps=warps or (8 if block >= 4096 else 4 if block >= 1024 else 2))


# ---- the merge with the residual add before it and the pre-norm after it, forward and backward ----------------

# backward programs (each sums dweight and dq over its rows) and their warps (None: by the row width, as the
# forward). At k3-debug's merge (8 x 4096 rows of 1024) on an H200, fwd + bwd: 1024 programs 0.93 ms, 2048
# 0.90, 4096 0.63, 8192 0.83; 8 warps slower at all but 2048 (`python bench/attnres.py --sweep`, 2026-12-02)
MAX_BWD_PROGRAMS = 4096
BWD_WARPS: int | None = None
N_STATS = 5  # per row, kept for backward: w0, w1, r0, r1, p . q


@triton.jit
def _merge_norm_fwd_kernel(p_ptr, a_ptr, mix_ptr, lse_ptr, q_ptr, w_ptr, x_ptr, pnew_ptr, stats_ptr, n_rows, n_cols,
                           mix_row_stride, lse_stride, eps, norm_eps, HAS_ADD: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    m = c < n_cols
    offs = row * n_cols + c
    p = tl.load(p_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_ADD:  # the new partial sum in its own dtype (the inputs' promoted one), and the merge reads it so
        p_new = (p + tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)).to(pnew_ptr.dtype.element_ty)
        tl.store(pnew_ptr + offs, p_new, mask=m)
        p = p_new.to(tl.float32)
    q = tl.load(q_ptr + c, mask=m, other=0.0)
    dot = tl.sum(p * q, axis=0)
    r0 = 1.0 / tl.sqrt(tl.sum(p * p, axis=0) / n_cols + eps)
    s = dot * r0
    lse = tl.load(lse_ptr + row * lse_stride)
    top = tl.maximum(s, lse)
    e_p, e_b = tl.exp(s - top), tl.exp(lse - top)
    w0, w1 = e_p / (e_p + e_b), e_b / (e_p + e_b)
    mix = tl.load(mix_ptr + row * mix_row_stride + c, mask=m, other=0.0)
    out = w0 * p + w1 * mix
    r1 = 1.0 / tl.sqrt(tl.sum(out * out, axis=0) / n_cols + norm_eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0)
    tl.store(x_ptr + offs, (out * r1 * w).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(stats_ptr + row, w0)
    tl.store(stats_ptr + n_rows + row, w1)
    tl.store(stats_ptr + 2 * n_rows + row, r0)
    tl.store(stats_ptr + 3 * n_rows + row, r1)
    tl.store(stats_ptr + 4 * n_rows + row, dot)


@triton.jit
def _merge_norm_bwd_kernel(p_ptr, mix_ptr, q_ptr, w_ptr, stats_ptr, dx_ptr, dpo_ptr, dp_ptr, da_ptr, dmix_ptr,
                           dlse_ptr, dw_part_ptr, dq_part_ptr, n_rows, n_cols, mix_row_stride, rows_per_prog,
                           HAS_DPO: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_D)
    m = c < n_cols
    q = tl.load(q_ptr + c, mask=m, other=0.0)
    w = tl.load(w_ptr + c, mask=m, other=0.0)
    dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    dq_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, rows_per_prog):
        row = pid.to(tl.int64) * rows_per_prog + i
        rows = row + c * 0  # the row index broadcast over the columns (a scalar mask trips the interpreter)
        mr = m & (rows < n_rows)
        offs = row * n_cols + c
        w0 = tl.load(stats_ptr + rows, mask=mr, other=0.0)
        w1 = tl.load(stats_ptr + n_rows + rows, mask=mr, other=0.0)
        r0 = tl.load(stats_ptr + 2 * n_rows + rows, mask=mr, other=0.0)
        r1 = tl.load(stats_ptr + 3 * n_rows + rows, mask=mr, other=0.0)
        dot = tl.load(stats_ptr + 4 * n_rows + rows, mask=mr, other=0.0)
        p = tl.load(p_ptr + offs, mask=mr, other=0.0).to(tl.float32)
        mix = tl.load(mix_ptr + row * mix_row_stride + c, mask=mr, other=0.0)
        dx = tl.load(dx_ptr + offs, mask=mr, other=0.0).to(tl.float32)
        y = (w0 * p + w1 * mix) * r1
        dw_acc += dx * y
        g = dx * w
        dout = r1 * (g - y * (tl.sum(g * y, axis=0) / n_cols))
        tl.store(dmix_ptr + offs, w1 * dout, mask=mr)
        dw0 = tl.sum(dout * p, axis=0)
        dw1 = tl.sum(dout * mix, axis=0)
        t = w0 * dw0 + w1 * dw1
        ds = w0 * (dw0 - t)
        tl.store(dlse_ptr + rows, w1 * (dw1 - t), mask=mr & (c == 0))
        dp = w0 * dout + (ds * r0) * q - (ds * dot * r0 * r0 * r0 / n_cols) * p
        if HAS_DPO:
            dp += tl.load(dpo_ptr + offs, mask=mr, other=0.0).to(tl.float32)
        dq_acc += (ds * r0) * p
        tl.store(dp_ptr + offs, dp.to(dp_ptr.dtype.element_ty), mask=mr)
        if HAS_ADD:
            tl.store(da_ptr + offs, dp.to(da_ptr.dtype.element_ty), mask=mr)
    tl.store(dw_part_ptr + pid.to(tl.int64) * n_cols + c, dw_acc, mask=m)
    tl.store(dq_part_ptr + pid.to(tl.int64) * n_cols + c, dq_acc, mask=m)


class _MergeNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mix, lse, partial, addend, query, weight, eps, norm_eps, out_dtype):
        D = partial.shape[-1]
        p2 = partial.reshape(-1, D).contiguous()
        n_rows = p2.shape[0]
        mix2, lse1 = _mix_rows(mix, D), lse.reshape(-1)
        a2 = addend.reshape(-1, D).contiguous() if addend is not None else None
        x = torch.empty(p2.shape, dtype=out_dtype, device=p2.device)
        pnew = torch.empty(p2.shape, dtype=torch.promote_types(partial.dtype, addend.dtype),
                           device=p2.device) if a2 is not None else p2
        stats = torch.empty(N_STATS, n_rows, dtype=torch.float32, device=p2.device)
        if n_rows:
            _merge_norm_fwd_kernel[(n_rows,)](p2, a2 if a2 is not None else p2, mix2, lse1, query, weight, x, pnew,
                                              stats, n_rows, D, mix2.stride(0), lse1.stride(0), eps, norm_eps,
                                              HAS_ADD=a2 is not None, **_row_block(D))
        ctx.save_for_backward(pnew, mix2, query, weight, stats)
        ctx.shapes = (mix.shape, lse.shape, partial.shape)
        ctx.dtypes = (partial.dtype, addend.dtype if addend is not None else None)
        x = x.view(partial.shape)
        return (x, pnew.view(partial.shape)) if a2 is not None else x

    @staticmethod
    def backward(ctx, dx, dpo=None):
        pnew, mix2, query, weight, stats = ctx.saved_tensors
        mix_shape, lse_shape, shape = ctx.shapes
        n_rows, D = pnew.shape
        rows_per_prog = max(1, triton.cdiv(n_rows, MAX_BWD_PROGRAMS))
        programs = triton.cdiv(n_rows, rows_per_prog) if n_rows else 0
        partial_dtype, addend_dtype = ctx.dtypes
        dp = torch.empty(n_rows, D, dtype=partial_dtype, device=pnew.device)
        has_add = addend_dtype is not None
        da = torch.empty(n_rows, D, dtype=addend_dtype, device=pnew.device) if has_add else None
        dmix = torch.empty(n_rows, D, dtype=torch.float32, device=pnew.device)
        dlse = torch.empty(n_rows, dtype=torch.float32, device=pnew.device)
        parts = torch.empty(2, programs, D, dtype=torch.float32, device=pnew.device)  # dweight's and dq's
        if n_rows:
            dx2 = dx.reshape(n_rows, D).contiguous()
            dpo2 = dpo.reshape(n_rows, D).contiguous() if dpo is not None else None
            _merge_norm_bwd_kernel[(programs,)](pnew, mix2, query, weight, stats, dx2,
                                                dpo2 if dpo2 is not None else dp, dp, da if has_add else dp, dmix,
                                                dlse, parts[0], parts[1], n_rows, D, mix2.stride(0), rows_per_prog,
                                                HAS_DPO=dpo2 is not None, HAS_ADD=has_add, **_row_block(D, BWD_WARPS))
        dweight, dq = parts.sum(1)  # one reduction for both
        return (dmix.view(mix_shape), dlse.view(lse_shape), dp.view(shape), da.view(shape) if has_add else None,
                dq, dweight, None, None, None)


def merge_norm_triton(mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, addend: torch.Tensor | None,
                      query: torch.Tensor, eps: float, weight: torch.Tensor, norm_eps: float,
                      out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`attn_res_merge_norm`'s value and gradients where phase 1 ran in fp32 (mix, query and weight fp32, the
    merge's dtype fp32; partial and addend in any float dtype, bf16 under autocast): the normalised input in
    `out_dtype` and the new partial sum (partial + addend in their promoted dtype; partial itself when addend is
    None)."""
    query, weight = query.contiguous(), weight.contiguous()
    if addend is None:
        return _MergeNorm.apply(mix, lse, partial, None, query, weight, eps, norm_eps, out_dtype), partial
    return _MergeNorm.apply(mix, lse, partial, addend, query, weight, eps, norm_eps, out_dtype)


# ---- phase 1: every query of an epoch scored against the block sums, forward and backward ---------------------
#
# Per row (v_n: block sum n in fp32, r_n = 1 / sqrt(mean(v_n^2) + eps), q: row q of the queries):
#     s_nq = (v_n . q) r_n,  p_nq = softmax_n(s_nq),  mix_q = sum_n p_nq v_n,  lse_q = logsumexp_n s_nq
# backward, given g_q = d mix_q and l_q = d lse_q:
#     dp_nq = g_q . v_n;   ds_nq = p_nq (dp_nq - sum_m p_mq dp_mq) + p_nq l_q
#     dv_n  = sum_q [ p_nq g_q + ds_nq r_n q - ds_nq (v_n . q) r_n^3 v_n / D ];   dq = sum over rows, n of ds_nq r_n v_n
# One program per row holds its N block sums (as an [N, D] tile) while it loops over the queries, so each block sum
# is read once each way and each mix written (forward) and read (backward) once; the block sums and the mixes'
# gradients come as tuples of tensors (each its own dtype and alignment, which the compiler sees). Backward writes
# the coefficients ds_nq r_n, and a second kernel sums dq from them and the block sums (read once more) as
# per-program partials: summed in the row kernel, dq's [Q, D] accumulator had taken the registers that hide the
# loads' latency (3.2 ms a call at k3-debug's last epoch on an H200, 5x its bytes). Every row vector is a [1, D]
# tile, in the block tile's layout: as 1-D vectors each one was converted to that layout through shared memory
# (41 conversions and 113 barriers in the backward; fwd + bwd 2.6 -> 2.0 ms). Register tiles of N x D values:
# `blocks_triton_fits` bounds them.

MAX_TILE_ELEMENTS = 1 << 14  # per program: the [N, D] block tile and its gradient, in fp32
BLOCKS_BWD_WARPS: int | None = None  # None: by the row width, as the forward
DQ_ROW_PROGRAMS, DQ_BLOCK_R, DQ_BLOCK_C = 64, 32, 128  # dq's partial sums: row ranges, and each program's tile


def _pad2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def blocks_triton_fits(num_blocks: int, dim: int) -> bool:
    """Whether the phase-1 kernels' register tiles (`MAX_TILE_ELEMENTS`) hold this epoch."""
    block = triton.next_power_of_2(dim)
    return 2 * _pad2(num_blocks) * block <= MAX_TILE_ELEMENTS


@triton.jit
def _load_blocks(blocks, offs, m, n_cols, eps, N_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """A row of every block sum as an [N_PAD, BLOCK_D] fp32 tile (rows past the last block zero), and their r_n as
    [N_PAD, 1]. Every row vector is handled as a [1, BLOCK_D] tile: one layout for all, no conversions between
    them."""
    n_idx = tl.arange(0, N_PAD)[:, None]
    v = tl.zeros([N_PAD, BLOCK_D], dtype=tl.float32)
    for n in tl.static_range(len(blocks)):
        vn = tl.load(blocks[n] + offs, mask=m, other=0.0).to(tl.float32)
        v = tl.where(n_idx == n, vn, v)
    r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1, keep_dims=True) / n_cols + eps)
    return v, r, n_idx < len(blocks)


@triton.jit
def _softmax(dot, r, valid):
    """From the dots [N_PAD, 1] of a query with the block sums: the scores' softmax over the blocks and their
    logsumexp."""
    s = tl.where(valid, dot * r, float("-inf"))
    top = tl.max(s, axis=0, keep_dims=True)
    e = tl.exp(s - top)
    z = tl.sum(e, axis=0, keep_dims=True)
    return e / z, top + tl.log(z)


@triton.jit
def _blocks_fwd_kernel(blocks, q_ptr, mix_ptr, lse_ptr, n_rows, n_cols, eps, Q: tl.constexpr, N_PAD: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_D)[None, :]
    m = c < n_cols
    v, r, valid = _load_blocks(blocks, row * n_cols + c, m, n_cols, eps, N_PAD, BLOCK_D)
    first = tl.arange(0, 1)[:, None]
    for q in range(Q):
        qv = tl.load(q_ptr + q * n_cols + c, mask=m, other=0.0)
        p, lse = _softmax(tl.sum(v * qv, axis=1, keep_dims=True), r, valid)
        tl.store(mix_ptr + (q * n_rows + row) * n_cols + c, tl.sum(p * v, axis=0, keep_dims=True), mask=m)
        tl.store(lse_ptr + q * n_rows + row + first, lse)


@triton.jit
def _blocks_bwd_kernel(blocks, dmixes, dblocks, q_ptr, dlse_ptr, coef_ptr, n_rows, n_cols, eps, N_PAD: tl.constexpr,
                       Q_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """The block sums' gradients of one row, and its coefficients ds_nq r_n of dq (coef [N, rows, Q_PAD])."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_D)[None, :]
    m = c < n_cols
    offs = row * n_cols + c
    v, r, valid = _load_blocks(blocks, offs, m, n_cols, eps, N_PAD, BLOCK_D)
    n_idx = tl.arange(0, N_PAD)[:, None]
    first = tl.arange(0, 1)[:, None]
    dv = tl.zeros([N_PAD, BLOCK_D], dtype=tl.float32)
    # each query's gradients are loaded one query ahead: the compiler issues no load across the barriers of a
    # query's reductions, so loaded where they were used every query waited for memory (k3-debug's step on an
    # H200: 1.15 -> 0.75 ms a call; fwd + bwd alone at N = 3, Q = 8: 1.97 -> 1.38 ms)
    g_next = tl.load(dmixes[0] + offs, mask=m, other=0.0)
    dl_next = tl.load(dlse_ptr + row + first)
    for q in tl.static_range(len(dmixes)):
        g, dl = g_next, dl_next
        if q + 1 < len(dmixes):
            g_next = tl.load(dmixes[q + 1] + offs, mask=m, other=0.0)
            dl_next = tl.load(dlse_ptr + (q + 1) * n_rows + row + first)
        qv = tl.load(q_ptr + q * n_cols + c, mask=m, other=0.0)
        dot, dp = tl.split(tl.sum(tl.join(v * qv, v * g), axis=1, keep_dims=True))  # one reduction for both
        p, _ = _softmax(dot, r, valid)
        ds = p * (dp - tl.sum(p * dp, axis=0, keep_dims=True)) + p * dl
        dsr = ds * r
        dv += p * g + dsr * qv - (dsr * dot * r * r / n_cols) * v
        tl.store(coef_ptr + (n_idx * n_rows + row) * Q_PAD + q, dsr, mask=valid)
    for n in tl.static_range(len(dblocks)):
        dvn = tl.sum(tl.where(n_idx == n, dv, 0.0), axis=0, keep_dims=True)
        tl.store(dblocks[n] + offs, dvn.to(dblocks[n].dtype.element_ty), mask=m)


@triton.jit
def _blocks_dq_kernel(blocks, coef_ptr, dq_part_ptr, n_rows, n_cols, rows_per_prog, Q_PAD: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dq's partial sum over one program's rows and columns: sum over rows and n of coef[n, row, q] v_n[row]."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    q_idx = tl.arange(0, Q_PAD)
    acc = tl.zeros([Q_PAD, BLOCK_C], dtype=tl.float32)
    first = pid_r.to(tl.int64) * rows_per_prog
    for start in range(0, rows_per_prog, BLOCK_R):
        rows = first + start + tl.arange(0, BLOCK_R)
        mr = (rows < n_rows) & (start + tl.arange(0, BLOCK_R) < rows_per_prog)
        for n in tl.static_range(len(blocks)):
            v = tl.load(blocks[n] + rows[:, None] * n_cols + cols[None, :],
                        mask=mr[:, None] & (cols[None, :] < n_cols), other=0.0).to(tl.float32)
            cf = tl.load(coef_ptr + (n * n_rows + rows[None, :]) * Q_PAD + q_idx[:, None], mask=mr[None, :],
                         other=0.0)
            acc = tl.dot(cf, v, acc, input_precision="ieee")
    tl.store(dq_part_ptr + (pid_r.to(tl.int64) * Q_PAD + q_idx[:, None]) * n_cols + cols[None, :], acc,
             mask=cols[None, :] < n_cols)


class _Blocks(torch.autograd.Function):
    """Phase 1 (`blocks_triton`): inputs (queries, eps, *blocks), outputs Q mixes then Q lse rows."""

    @staticmethod
    def forward(ctx, queries, eps, *blocks):
        shape, D = blocks[0].shape, blocks[0].shape[-1]
        rows = [b.reshape(-1, D).contiguous() for b in blocks]
        n_rows, Q = rows[0].shape[0], queries.shape[0]
        mix = torch.empty(Q, n_rows, D, dtype=torch.float32, device=queries.device)
        lse = torch.empty(Q, n_rows, dtype=torch.float32, device=queries.device)
        if n_rows:
            _blocks_fwd_kernel[(n_rows,)](tuple(rows), queries, mix, lse, n_rows, D, eps, Q=Q, N_PAD=_pad2(len(rows)),
                                          **_row_block(D))
        ctx.save_for_backward(queries, *rows)
        ctx.eps, ctx.shape = eps, shape
        return (*mix.view(Q, *shape).unbind(0), *lse.view(Q, *shape[:-1]).unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        queries, *rows = ctx.saved_tensors
        n_rows, D = rows[0].shape
        Q, dev = queries.shape[0], queries.device
        dmixes = tuple(torch.zeros(n_rows, D, dtype=torch.float32, device=dev) if g is None else _aligned_rows(g, D)
                       for g in grads[:Q])
        dlse = torch.stack([torch.zeros(ctx.shape[:-1], device=dev) if g is None else g.float()
                            for g in grads[Q:]]).reshape(Q, n_rows)
        dblocks = tuple(torch.empty_like(r) for r in rows)
        q_pad = max(16, triton.next_power_of_2(Q))  # tl.dot's smallest tile
        # columns q >= Q stay unwritten: they only reach dq's rows q >= Q, which are cut off below
        coef = torch.empty(len(rows), n_rows, q_pad, dtype=torch.float32, device=dev)
        rows_per_prog = triton.cdiv(triton.cdiv(n_rows, DQ_ROW_PROGRAMS), DQ_BLOCK_R) * DQ_BLOCK_R
        dq_part = torch.empty(triton.cdiv(n_rows, rows_per_prog) if n_rows else 0, q_pad, D, dtype=torch.float32,
                              device=dev)
        if n_rows:
            _blocks_bwd_kernel[(n_rows,)](tuple(rows), dmixes, dblocks, queries, dlse, coef, n_rows, D, ctx.eps,
                                          N_PAD=_pad2(len(rows)), Q_PAD=q_pad, **_row_block(D, BLOCKS_BWD_WARPS))
            _blocks_dq_kernel[(dq_part.shape[0], triton.cdiv(D, DQ_BLOCK_C))](
                tuple(rows), coef, dq_part, n_rows, D, rows_per_prog, Q_PAD=q_pad, BLOCK_R=DQ_BLOCK_R,
                BLOCK_C=DQ_BLOCK_C)
        return (dq_part[:, :Q].sum(0), None, *(d.view(ctx.shape) for d in dblocks))


def _aligned_rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """t as contiguous fp32 rows [n, D] whose start is 16-byte aligned (what the kernels are specialised for)."""
    rows = t.reshape(-1, D).to(torch.float32).contiguous()
    return rows if rows.data_ptr() % 16 == 0 else rows.clone()


def blocks_triton(blocks: list[torch.Tensor], queries: torch.Tensor,
                  eps: float) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """`attn_res_blocks`' value and gradients: (the Q mixes [..., D] fp32, the Q lse rows [...] fp32) for block sums
    of any float dtypes (the fp32 embedding and bf16 partial sums under autocast) and fp32 queries [Q, D]; where
    `blocks_triton_fits`. The mixes are views of one [Q, ..., D] buffer."""
    out = _Blocks.apply(queries.contiguous(), eps, *blocks)
    Q = queries.shape[0]
    return out[:Q], out[Q:]
