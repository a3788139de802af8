"""Decode kernels: one KDA token step and one causal-conv step for many sequences, states updated in place.

KDA step per sequence n and head h (SPEC-K3 §2), on the state S = pool[slots[n], h] (fp32 [K, V]):
    S <- Diag(e^g) S;   S <- S + beta k (v - S^T k)^T;   o = S^T (scale q)
Depthwise causal conv step per channel d with kernel width W, on state c = conv_state[slots[n], d] ([W-1]):
    y = act(sum_{w<W-1} c[w] weight[d,w] + x weight[d,W-1] + bias[d]);   c <- (c[1:], x)
Plain-PyTorch references sit beside each kernel. A slot < 0 marks padding: its state is left alone and its
output is zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _kda_decode_kernel(q, k, v, g, beta, pool, slots, o, scale,
                       H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    slot = tl.load(slots + n).to(tl.int64)
    if slot >= 0:
        ck = tl.arange(0, BK)
        cv = iv * BV + tl.arange(0, BV)
        mk = ck < K
        mv = cv < V
        x = n * H + h
        kk = tl.load(k + x * K + ck, mask=mk, other=0.0).to(tl.float32)
        qq = tl.load(q + x * K + ck, mask=mk, other=0.0).to(tl.float32) * scale
        gg = tl.load(g + x * K + ck, mask=mk, other=0.0).to(tl.float32)
        vv = tl.load(v + x * V + cv, mask=mv, other=0.0).to(tl.float32)
        b = tl.load(beta + x).to(tl.float32)
        s_ptr = pool + (slot * H + h) * K * V + ck[:, None] * V + cv[None, :]
        smask = mk[:, None] & mv[None, :]
        S = tl.load(s_ptr, mask=smask, other=0.0) * tl.exp(gg)[:, None]
        err = vv - tl.sum(S * kk[:, None], axis=0)
        S += (b * kk)[:, None] * err[None, :]
        tl.store(s_ptr, S, mask=smask)
        tl.store(o + x * V + cv, tl.sum(S * qq[:, None], axis=0).to(o.dtype.element_ty), mask=mv)
    else:
        cv = iv * BV + tl.arange(0, BV)
        tl.store(o + (n * H + h) * V + cv, tl.zeros([BV], dtype=tl.float32).to(o.dtype.element_ty), mask=cv < V)


# The two launches are torch custom ops (declared in-place on their pools) so that torch.compile keeps them whole
# in a compiled decode step and fuses the operations around them (`openk3.serve.runner`).
@torch.library.custom_op("openk3::kda_decode", mutates_args=("state_pool",))
def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state_pool: torch.Tensor, slots: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One KDA step for N sequences. q, k, g [N,H,K]; v [N,H,V]; beta [N,H]; state_pool [P,H,K,V] fp32,
    updated in place at rows slots [N] (int32). Returns o [N,H,V] in v's dtype."""
    N, H, K = q.shape
    V = v.shape[-1]
    if state_pool.dtype != torch.float32 or not state_pool.is_contiguous():
        raise ValueError("state_pool must be a contiguous fp32 tensor [P,H,K,V]")
    scale = K**-0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(N, H, V, dtype=v.dtype, device=v.device)
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 64)  # 64 x 4 warps: 81-87% of copy bandwidth on an H200
    if N:
        _kda_decode_kernel[(N, H, triton.cdiv(V, BV))](
            q, k, v, g, beta, state_pool, slots.to(torch.int32), o, scale, H=H, K=K, V=V, BK=BK, BV=BV,
            num_warps=4)
    return o


@kda_decode.register_fake
def _(q, k, v, g, beta, state_pool, slots, scale=None):
    return v.new_empty(q.shape[0], q.shape[1], v.shape[-1])


def kda_decode_reference(q, k, v, g, beta, state_pool, slots, scale: float | None = None) -> torch.Tensor:
    """Plain-PyTorch `kda_decode` (same in-place contract)."""
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    live = (slots >= 0).nonzero().flatten()
    idx = slots[live].long()
    S = state_pool[idx] * g[live].float().exp().unsqueeze(-1)
    kk = k[live].float()
    err = v[live].float() - torch.einsum("nhk,nhkv->nhv", kk, S)
    S = S + beta[live].float()[..., None, None] * kk.unsqueeze(-1) * err.unsqueeze(-2)
    state_pool[idx] = S
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    o[live] = torch.einsum("nhk,nhkv->nhv", q[live].float() * scale, S)
    return o.to(v.dtype)


@triton.jit
def _conv_step_kernel(x, conv_state, slots, weight, bias, y, D, W: tl.constexpr, BD: tl.constexpr,
                      BW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    n = tl.program_id(0)
    cd = tl.program_id(1) * BD + tl.arange(0, BD)
    md = cd < D
    slot = tl.load(slots + n).to(tl.int64)
    if slot >= 0:
        cw = tl.arange(0, BW)
        xn = tl.load(x + n * D + cd, mask=md, other=0.0).to(tl.float32)
        c_ptr = conv_state + (slot * D + cd[:, None]) * (W - 1) + cw[None, :]
        cmask = md[:, None] & (cw[None, :] < W - 1)
        c = tl.load(c_ptr, mask=cmask, other=0.0).to(tl.float32)  # [BD, BW]: taps 0..W-2
        wt = tl.load(weight + cd[:, None] * W + cw[None, :], mask=cmask, other=0.0).to(tl.float32)
        w_last = tl.load(weight + cd * W + W - 1, mask=md, other=0.0).to(tl.float32)
        acc = tl.sum(c * wt, axis=1) + xn * w_last
        if HAS_BIAS:
            acc += tl.load(bias + cd, mask=md, other=0.0).to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(y + n * D + cd, acc.to(y.dtype.element_ty), mask=md)
        # shift left by one tap and append x: new c[w] = old c[w+1], new c[W-2] = x
        nxt = tl.load(c_ptr + 1, mask=md[:, None] & (cw[None, :] < W - 2), other=0.0).to(tl.float32)
        nxt = tl.where(cw[None, :] == W - 2, xn[:, None], nxt)
        tl.debug_barrier()  # every thread has read the old taps before any is overwritten
        tl.store(c_ptr, nxt.to(conv_state.dtype.element_ty), mask=cmask)
    else:
        tl.store(y + n * D + cd, tl.zeros([BD], dtype=tl.float32).to(y.dtype.element_ty), mask=md)


@torch.library.custom_op("openk3::causal_conv_step", mutates_args=("conv_state",))
def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     slots: torch.Tensor | None = None, activation: str | None = "silu") -> torch.Tensor:
    """One step of a depthwise causal conv for N sequences. x [N,D]; conv_state [P,D,W-1] (P = N without
    slots), updated in place; weight [D,W]; bias [D] or None; activation "silu" or None. Returns y [N,D]."""
    N, D = x.shape
    W = weight.shape[-1]
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if slots is None:
        slots = torch.arange(N, dtype=torch.int32, device=x.device)
    y = torch.empty_like(x)
    BD = 128
    if N:
        _conv_step_kernel[(N, triton.cdiv(D, BD))](
            x.contiguous(), conv_state, slots.to(torch.int32), weight.contiguous(), bias, y, D, W=W, BD=BD,
            BW=max(2, triton.next_power_of_2(W - 1)), HAS_BIAS=bias is not None, SILU=activation == "silu",
            num_warps=4)
    return y


@causal_conv_step.register_fake
def _(x, conv_state, weight, bias=None, slots=None, activation="silu"):
    return torch.empty_like(x)


def causal_conv_step_reference(x, conv_state, weight, bias=None, slots=None, activation: str | None = "silu"):
    """Plain-PyTorch `causal_conv_step` (same in-place contract)."""
    N = x.shape[0]
    idx = torch.arange(N, device=x.device) if slots is None else slots.long()
    live = (idx >= 0).nonzero().flatten()
    window = torch.cat([conv_state[idx[live]].float(), x[live].float().unsqueeze(-1)], dim=-1)  # [n,D,W]
    out = (window * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    if activation == "silu":
        out = F.silu(out)
    conv_state[idx[live]] = window[..., 1:].to(conv_state.dtype)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    y[live] = out
    return y.to(x.dtype)
