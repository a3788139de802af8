"""KDA input activations in one pass each way (SPEC-K3 §2), feeding `kda_triton`:

    q, k  <- x / sqrt(sum x^2 + 1e-6)                           (per head)
    g     <- g_min sigmoid(exp(A_log) (f + dt_bias))             K3's lower-bounded gate ("k3")
          or -exp(A_log) softplus(f + dt_bias)                   Kimi Linear's gate ("kimi")
    beta  <- sigmoid(b)

One program per block of (token, head) rows; g comes out in fp32 (its cumsum is taken in fp32). Backward:
dx = r (dy - y <dy, y>) for the norms; df = dg dg/dx; d dt_bias and d A_log are sums over tokens of df and
dg dg/dA_log. `kda_activations_reference` is the same in plain PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROWS = 16  # (token, head) rows per program
GATES = ("k3", "kimi")


@triton.jit
def gate_activation(f, a, bias, G_MIN: tl.constexpr, KIMI: tl.constexpr):
    """g, dg/df and dg/dA_log for x = f + bias, a = exp(A_log)."""
    x = f + bias
    if KIMI:
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # softplus
        return -a * sp, -a * tl.sigmoid(x), -a * sp
    # sigmoid(z) with a fast division (the chunk kernels call this often), from e = exp(-|z|) <= 1 so that no exp
    # overflows (1 / (1 + exp(-z)) takes exp(-z) = inf for z < -88.7: the same s, but an fp32 overflow)
    z = a * x
    e = tl.exp(-tl.abs(z))
    s = tl.fdiv(1.0, 1.0 + e)
    s = tl.where(z >= 0, s, e * s)
    slope = G_MIN * s * (1.0 - s)
    return G_MIN * s, slope * a, slope * a * x


@triton.jit
def _l2norm_fwd(src, dst, offs, m):
    x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    tl.store(dst + offs, y.to(dst.dtype.element_ty), mask=m)


@triton.jit
def _l2norm_bwd(src, dy_ptr, dst, offs, m):
    x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)
    y = x * r[:, None]
    dx = r[:, None] * (dy - y * tl.sum(dy * y, axis=1)[:, None])
    tl.store(dst + offs, dx.to(dst.dtype.element_ty), mask=m)


@triton.jit
def _row_block(n_rows, H, K: tl.constexpr, BK: tl.constexpr, R: tl.constexpr):
    """This program's R (token, head) rows: indices, row mask, head, channels, [R, BK] mask and offsets."""
    r = tl.program_id(0) * R + tl.arange(0, R)
    rm = r < n_rows
    c = tl.arange(0, BK)
    m = rm[:, None] & (c[None, :] < K)
    return r, rm, r % H, c, m, r[:, None].to(tl.int64) * K + c[None, :]


@triton.jit(do_not_specialize=["n_rows"])  # one compile for every token count
def _act_fwd_kernel(q, k, f, b, A_log, dt_bias, qo, ko, go, bo, n_rows, H,
                    K: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, G_MIN: tl.constexpr, KIMI: tl.constexpr):
    r, rm, h, c, m, offs = _row_block(n_rows, H, K, BK, R)
    _l2norm_fwd(q, qo, offs, m)
    _l2norm_fwd(k, ko, offs, m)
    a = tl.exp(tl.load(A_log + h, mask=rm, other=0.0).to(tl.float32))[:, None]
    bias = tl.load(dt_bias + h[:, None] * K + c[None, :], mask=m, other=0.0).to(tl.float32)
    g, _, _ = gate_activation(tl.load(f + offs, mask=m, other=0.0).to(tl.float32), a, bias, G_MIN, KIMI)
    tl.store(go + offs, g, mask=m)
    bb = tl.load(b + r, mask=rm, other=0.0).to(tl.float32)
    tl.store(bo + r, tl.sigmoid(bb).to(bo.dtype.element_ty), mask=rm)


@triton.jit
def _act_bwd_kernel(q, k, f, b, A_log, dt_bias, dqo, dko, dgo, dbo, dq, dk, df, db, dA_rows, n_rows, H,
                    K: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, G_MIN: tl.constexpr, KIMI: tl.constexpr):
    r, rm, h, c, m, offs = _row_block(n_rows, H, K, BK, R)
    _l2norm_bwd(q, dqo, dq, offs, m)
    _l2norm_bwd(k, dko, dk, offs, m)
    a = tl.exp(tl.load(A_log + h, mask=rm, other=0.0).to(tl.float32))[:, None]
    bias = tl.load(dt_bias + h[:, None] * K + c[None, :], mask=m, other=0.0).to(tl.float32)
    _, d_f, d_alog = gate_activation(tl.load(f + offs, mask=m, other=0.0).to(tl.float32), a, bias, G_MIN, KIMI)
    dg = tl.load(dgo + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(df + offs, dg * d_f, mask=m)  # fp32: also reduced into d dt_bias
    tl.store(dA_rows + r, tl.sum(tl.where(m, dg * d_alog, 0.0), axis=1), mask=rm)
    bb = tl.sigmoid(tl.load(b + r, mask=rm, other=0.0).to(tl.float32))
    dbeta = tl.load(dbo + r, mask=rm, other=0.0).to(tl.float32)
    tl.store(db + r, (dbeta * bb * (1.0 - bb)).to(db.dtype.element_ty), mask=rm)


class _KDAActivations(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, f, b, A_log, dt_bias, g_min, kimi):
        B, T, H, K = q.shape
        xs = [x.contiguous() for x in (q, k, f, b)]
        qo, ko = torch.empty_like(xs[0]), torch.empty_like(xs[1])
        go = torch.empty(B, T, H, K, dtype=torch.float32, device=q.device)
        bo = torch.empty_like(xs[3])
        n = B * T * H
        grid = (triton.cdiv(n, ROWS),)
        _act_fwd_kernel[grid](*xs, A_log.contiguous(), dt_bias.contiguous(), qo, ko, go, bo, n, H, K=K,
                              BK=triton.next_power_of_2(K), R=ROWS, G_MIN=g_min, KIMI=kimi, num_warps=4)
        ctx.save_for_backward(*xs, A_log, dt_bias)
        ctx.g_min, ctx.kimi = g_min, kimi
        return qo, ko, go, bo

    @staticmethod
    def backward(ctx, dqo, dko, dgo, dbo):
        q, k, f, b, A_log, dt_bias = ctx.saved_tensors
        grads = [torch.zeros_like(x) if d is None else d for x, d in ((q, dqo), (k, dko), (f, dgo), (b, dbo))]
        return (*activations_backward(q, k, f, b, A_log, dt_bias, *grads, g_min=ctx.g_min, kimi=ctx.kimi),
                None, None)


def activations_backward(q, k, f, b, A_log, dt_bias, dqo, dko, dgo, dbo, *, g_min: float, kimi: bool):
    """Gradients of the raw inputs (q, k, f, b, A_log, dt_bias) from those of the activated (q, k, g, beta);
    q, k, f [..., H, K] and b [..., H], contiguous."""
    H, K = q.shape[-2:]
    n = q.numel() // K
    dq, dk, db = torch.empty_like(q), torch.empty_like(k), torch.empty_like(b)
    df = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dA_rows = torch.empty(n, dtype=torch.float32, device=q.device)
    _act_bwd_kernel[(triton.cdiv(n, ROWS),)](
        q, k, f, b, A_log.contiguous(), dt_bias.contiguous(), *(d.contiguous() for d in (dqo, dko, dgo, dbo)),
        dq, dk, df, db, dA_rows, n, H, K=K, BK=triton.next_power_of_2(K), R=ROWS, G_MIN=g_min, KIMI=kimi,
        num_warps=4)
    d_dt_bias = df.reshape(-1, H, K).sum(0).reshape(dt_bias.shape).to(dt_bias.dtype)
    d_A_log = dA_rows.reshape(-1, H).sum(0).to(A_log.dtype)
    return dq, dk, df.to(f.dtype), db, d_A_log, d_dt_bias


def kda_activations(q, k, f, b, A_log, dt_bias, *, gate: str = "k3", g_min: float = -5.0):
    """q, k, f [B,T,H,K]; b [B,T,H]; A_log [H]; dt_bias [H,K] (or [H*K]). Returns (q, k, g fp32, beta) ready
    for `kda_triton`; differentiable in every input. gate: "k3" (lower bound g_min) or "kimi" (softplus; it has no
    lower bound, see `kda_triton` for the range of gates its chunks handle)."""
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    return _KDAActivations.apply(q, k, f, b, A_log, dt_bias, float(g_min), gate == "kimi")


def kda_activations_reference(q, k, f, b, A_log, dt_bias, *, gate: str = "k3", g_min: float = -5.0):
    """Plain-PyTorch `kda_activations`."""
    H, K = q.shape[-2:]
    norm = lambda x: (x.float() * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)
    x = f.float() + dt_bias.float().reshape(H, K)
    a = A_log.float().exp().reshape(H, 1)
    g = g_min * torch.sigmoid(a * x) if gate == "k3" else -a * F.softplus(x)
    return norm(q), norm(k), g, torch.sigmoid(b.float()).to(b.dtype)
