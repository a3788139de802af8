"""RMSNorm, optionally after a residual add or before a sigmoid gate, in one Triton pass each way (fp32 math, the
inputs' dtype out):

    s = x (+ residual)                         rounded to its dtype, as the PyTorch add would
    y = s * rstd * w (* sigmoid(z)),   rstd = 1 / sqrt(mean(s^2) + eps)
    with the gate: dz = dy * s_hat * w * sig * (1 - sig), sig = sigmoid(z), and dy * sig stands for dy below
    ds = rstd * (g - s_hat * mean(g * s_hat)) (+ the gradient of s),   g = dy * w,   s_hat = s * rstd
    dw = sum over rows of dy * s_hat

Forward: one program per row, rstd kept for backward. Backward: each program walks a run of rows and writes
its partial dw; the partials are summed in fp32. The references are `openk3.ops.norms.rms_norm`,
`add_rms_norm` and `gated_rms_norm` (the KDA output's norm and gate, SPEC-K3 §2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BWD_PROGRAMS = 1024  # backward programs (each sums dw over its rows)


@triton.jit
def _rms_fwd_kernel(x_ptr, r_ptr, z_ptr, w_ptr, y_ptr, s_ptr, rstd_ptr, n_cols, eps,
                    HAS_RES: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    m = c < n_cols
    offs = row * n_cols + c
    s = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        s = s + tl.load(r_ptr + offs, mask=m, other=0.0).to(tl.float32)
        s_out = s.to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + offs, s_out, mask=m)
        s = s_out.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    y = s * rstd * w
    if HAS_GATE:
        y = y * tl.sigmoid(tl.load(z_ptr + offs, mask=m, other=0.0).to(tl.float32))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_bwd_kernel(s_ptr, w_ptr, rstd_ptr, dy_ptr, dsum_ptr, z_ptr, ds_ptr, dz_ptr, dw_part_ptr, n_rows, n_cols,
                    rows_per_prog, HAS_DSUM: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_D)
    m = c < n_cols
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, rows_per_prog):
        row = pid.to(tl.int64) * rows_per_prog + i
        offs = row * n_cols + c
        rows = row + c * 0  # the row index broadcast over the columns (a scalar mask trips the interpreter)
        mr = m & (rows < n_rows)
        rstd = tl.load(rstd_ptr + rows, mask=mr, other=0.0)
        s_hat = tl.load(s_ptr + offs, mask=mr, other=0.0).to(tl.float32) * rstd
        dy = tl.load(dy_ptr + offs, mask=mr, other=0.0).to(tl.float32)
        if HAS_GATE:
            sig = tl.sigmoid(tl.load(z_ptr + offs, mask=mr, other=0.0).to(tl.float32))
            tl.store(dz_ptr + offs, (dy * s_hat * w * sig * (1.0 - sig)).to(dz_ptr.dtype.element_ty), mask=mr)
            dy = dy * sig
        g = dy * w
        ds = rstd * (g - s_hat * (tl.sum(g * s_hat, axis=0) / n_cols))
        if HAS_DSUM:
            ds += tl.load(dsum_ptr + offs, mask=mr, other=0.0).to(tl.float32)
        tl.store(ds_ptr + offs, ds.to(ds_ptr.dtype.element_ty), mask=mr)
        dw += dy * s_hat
    tl.store(dw_part_ptr + pid.to(tl.int64) * n_cols + c, dw, mask=m)


def _block(n_cols: int) -> dict:
    block = triton.next_power_of_2(n_cols)
    return dict(BLOCK_D=block, num_warps=8 if block >= 4096 else 4 if block >= 1024 else 2)


def _norm_forward(x2, r2, weight, eps, s_dtype):
    n_rows, n_cols = x2.shape
    y = torch.empty(x2.shape, dtype=s_dtype, device=x2.device)
    s = torch.empty(x2.shape, dtype=s_dtype, device=x2.device) if r2 is not None else x2
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2.device)
    if n_rows:
        _rms_fwd_kernel[(n_rows,)](x2, r2 if r2 is not None else x2, x2, weight, y, s, rstd, n_cols, eps,
                                   HAS_RES=r2 is not None, HAS_GATE=False, **_block(n_cols))
    return y, s, rstd


def _gated_norm_forward(x2, z2, weight, eps):
    """(RMSNorm(x2) * sigmoid(z2) in x2's dtype, rstd)."""
    n_rows, n_cols = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2.device)
    if n_rows:
        _rms_fwd_kernel[(n_rows,)](x2, x2, z2, weight, y, x2, rstd, n_cols, eps, HAS_RES=False, HAS_GATE=True,
                                   **_block(n_cols))
    return y, rstd


def _norm_backward(s, weight, rstd, dy, dsum, ds_dtype, z=None):
    """ds [rows, n] (the gradient reaching s, plus dsum when given), dw [n] and, with the gate's input z [rows, n],
    dz (else None)."""
    n_rows, n_cols = s.shape
    rows_per_prog = max(1, triton.cdiv(n_rows, MAX_BWD_PROGRAMS))
    programs = triton.cdiv(n_rows, rows_per_prog) if n_rows else 0
    ds = torch.empty(s.shape, dtype=ds_dtype, device=s.device)
    dz = torch.empty_like(z) if z is not None else None
    dw_part = torch.empty(programs, n_cols, dtype=torch.float32, device=s.device)
    if n_rows:
        _rms_bwd_kernel[(programs,)](s, weight, rstd, dy.reshape(n_rows, n_cols).contiguous(),
                                     dsum if dsum is not None else s, z if z is not None else s, ds,
                                     dz if z is not None else ds, dw_part, n_rows, n_cols, rows_per_prog,
                                     HAS_DSUM=dsum is not None, HAS_GATE=z is not None, **_block(n_cols))
    return ds, dw_part.sum(0).to(weight.dtype), dz


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = _rows(x)
        y, _, rstd = _norm_forward(x2, None, weight, eps, x.dtype)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw, _ = _norm_backward(x2, weight, rstd, dy, None, x2.dtype)
        return dx.view(ctx.shape), dw, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        s_dtype = torch.result_type(x, residual)
        y, s, rstd = _norm_forward(_rows(x), _rows(residual), weight, eps, s_dtype)
        ctx.save_for_backward(s, weight, rstd)
        ctx.shape, ctx.dtypes = x.shape, (x.dtype, residual.dtype)
        return y.view(x.shape), s.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dsum):
        s, weight, rstd = ctx.saved_tensors
        dsum = None if dsum is None else _rows(dsum)
        ds, dw, _ = _norm_backward(s, weight, rstd, dy, dsum, s.dtype)
        ds = ds.view(ctx.shape)
        return ds.to(ctx.dtypes[0]), ds.to(ctx.dtypes[1]), dw, None


class _GatedRMSNorm(torch.autograd.Function):
    """Keeps x, the gate's input z (both in their own dtype, bf16 under autocast) and rstd: no fp32 copy of x and
    no fp32 intermediates, as the reference's autograd graph keeps."""

    @staticmethod
    def forward(ctx, x, z, weight, eps):
        x2, z2 = _rows(x), _rows(z)
        y, rstd = _gated_norm_forward(x2, z2, weight, eps)
        ctx.save_for_backward(x2, z2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, z2, weight, rstd = ctx.saved_tensors
        dx, dw, dz = _norm_backward(x2, weight, rstd, dy, None, x2.dtype, z=z2)
        return dx.view(ctx.shape), dz.view(ctx.shape), dw, None


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}] for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}")


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm of x [..., D] with weight [D] -> x's dtype; differentiable in x and weight."""
    _check(x, weight)
    return _RMSNorm.apply(x, weight, float(eps))


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual), both in the promoted dtype of x and residual; differentiable."""
    _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    return _AddRMSNorm.apply(x, residual, weight, float(eps))


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm(x) * sigmoid(z) for x, z [..., D] of one shape, weight [D] -> x's dtype; differentiable in x, z and
    weight. The reference is `openk3.ops.norms.gated_rms_norm`."""
    _check(x, weight)
    if z.shape != x.shape:
        raise ValueError(f"gate input z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    return _GatedRMSNorm.apply(x, z, weight, float(eps))
