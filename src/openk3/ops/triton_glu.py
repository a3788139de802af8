"""SiTU-GLU in one Triton pass each way (SPEC-K3 §5), fp32 math, the inputs' dtype out:

    out = [b1 tanh(g / b1) sigmoid(g)] * [b2 tanh(u / b2)]
    dg  = dout * b2 tanh(u / b2) * [(1 - tanh^2(g / b1)) sigmoid(g) + b1 tanh(g / b1) sigmoid(g) (1 - sigmoid(g))]
    du  = dout * b1 tanh(g / b1) sigmoid(g) * (1 - tanh^2(u / b2))

`situ_glu_triton(gate, up)` takes the two halves as separate tensors (the dense FFN and the shared experts);
`situ_glu_packed_triton(h)` takes the gate/up product of the experts, h [..., 2I] = [gate | up], and returns its
gradient as one [..., 2I] tensor (two views of h would make autograd build a zero-filled h-sized gradient per
half). Backward recomputes the activation from the saved inputs. The reference is `openk3.ops.activations.situ_glu`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program (at most)


@triton.jit
def _tanh(x):
    """tanh from one exp (the interpreter has no libdevice): sign(x) (1 - e^-2|x|) / (1 + e^-2|x|)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _load_halves(g_ptr, u_ptr, g_stride, u_stride, n_cols, BLOCK_C: tl.constexpr):
    """This program's columns of one row of gate and up, in fp32: (g, u, column offsets, mask, row)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < n_cols
    g = tl.load(g_ptr + row * g_stride + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + c, mask=m, other=0.0).to(tl.float32)
    return g, u, c, m, row


@triton.jit
def _situ_fwd_kernel(g_ptr, u_ptr, o_ptr, n_cols, g_stride, u_stride,
                     B1: tl.constexpr, B2: tl.constexpr, BLOCK_C: tl.constexpr):
    g, u, c, m, row = _load_halves(g_ptr, u_ptr, g_stride, u_stride, n_cols, BLOCK_C)
    out = B1 * _tanh(g / B1) * tl.sigmoid(g) * (B2 * _tanh(u / B2))
    tl.store(o_ptr + row * n_cols + c, out.to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _situ_bwd_kernel(g_ptr, u_ptr, do_ptr, dg_ptr, du_ptr, n_cols, g_stride, u_stride, dg_stride, du_stride,
                     B1: tl.constexpr, B2: tl.constexpr, BLOCK_C: tl.constexpr):
    g, u, c, m, row = _load_halves(g_ptr, u_ptr, g_stride, u_stride, n_cols, BLOCK_C)
    do = tl.load(do_ptr + row * n_cols + c, mask=m, other=0.0).to(tl.float32)
    tg, sg, tu = _tanh(g / B1), tl.sigmoid(g), _tanh(u / B2)
    gate_part = B1 * tg * sg
    d_gate_part = (1.0 - tg * tg) * sg + B1 * tg * sg * (1.0 - sg)
    dg = do * (B2 * tu) * d_gate_part
    du = do * gate_part * (1.0 - tu * tu)
    tl.store(dg_ptr + row * dg_stride + c, dg.to(dg_ptr.dtype.element_ty), mask=m)
    tl.store(du_ptr + row * du_stride + c, du.to(du_ptr.dtype.element_ty), mask=m)


def _launch_args(n_cols: int) -> dict:
    block = min(BLOCK, triton.next_power_of_2(max(n_cols, 1)))
    return dict(BLOCK_C=block, num_warps=4 if block >= 512 else 2)


def _grid(rows: int, n_cols: int, block: int) -> tuple[int, int]:
    return (rows, triton.cdiv(n_cols, block))


def _rows(x: torch.Tensor, n_cols: int) -> torch.Tensor:
    """x [..., n] as a 2-D [rows, n] view with a unit column stride (a copy only if it has none)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _forward(g2, u2, n_cols, out_shape, dtype, b1, b2):
    out = torch.empty(out_shape, dtype=dtype, device=g2.device)
    kw = _launch_args(n_cols)
    if g2.shape[0]:
        _situ_fwd_kernel[_grid(g2.shape[0], n_cols, kw["BLOCK_C"])](
            g2, u2, out, n_cols, g2.stride(0), u2.stride(0), B1=b1, B2=b2, **kw)
    return out


def _backward(g2, u2, dout, dg2, du2, n_cols, b1, b2):
    kw = _launch_args(n_cols)
    if g2.shape[0]:
        _situ_bwd_kernel[_grid(g2.shape[0], n_cols, kw["BLOCK_C"])](
            g2, u2, dout.contiguous(), dg2, du2, n_cols, g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0),
            B1=b1, B2=b2, **kw)


class _SituGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, b1, b2):
        n = gate.shape[-1]
        g2, u2 = _rows(gate, n), _rows(up, n)
        ctx.save_for_backward(g2, u2)
        ctx.betas, ctx.shapes = (b1, b2), (gate.shape, up.shape)
        return _forward(g2, u2, n, gate.shape, gate.dtype, b1, b2)

    @staticmethod
    def backward(ctx, dout):
        g2, u2 = ctx.saved_tensors
        dg, du = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (g2, u2))
        _backward(g2, u2, dout, dg, du, g2.shape[-1], *ctx.betas)
        return dg.view(ctx.shapes[0]), du.view(ctx.shapes[1]), None, None


class _SituGLUPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, b1, b2):
        n = h.shape[-1] // 2
        h2 = _rows(h, 2 * n)
        ctx.save_for_backward(h2)
        ctx.betas, ctx.shape = (b1, b2), h.shape
        return _forward(h2, h2[:, n:], n, (*h.shape[:-1], n), h.dtype, b1, b2)

    @staticmethod
    def backward(ctx, dout):
        (h2,) = ctx.saved_tensors
        n = h2.shape[-1] // 2
        dh = torch.empty(h2.shape, dtype=h2.dtype, device=h2.device)
        _backward(h2, h2[:, n:], dout, dh, dh[:, n:], n, *ctx.betas)
        return dh.view(ctx.shape), None, None


def situ_glu_triton(gate: torch.Tensor, up: torch.Tensor, beta_gate: float = 4.0,
                    beta_up: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of gate, up [..., I] (same shape and dtype) -> [..., I] in their dtype; differentiable."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match, got {tuple(gate.shape)} {gate.dtype} and "
                         f"{tuple(up.shape)} {up.dtype}")
    return _SituGLU.apply(gate, up, float(beta_gate), float(beta_up))


def situ_glu_packed_triton(h: torch.Tensor, beta_gate: float = 4.0, beta_up: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of h [..., 2I] = [gate | up] -> [..., I] in h's dtype; differentiable."""
    if h.shape[-1] % 2:
        raise ValueError(f"the packed gate/up product needs an even last dimension, got {h.shape[-1]}")
    return _SituGLUPacked.apply(h, float(beta_gate), float(beta_up))
