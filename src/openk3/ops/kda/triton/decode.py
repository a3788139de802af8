"""Decode kernels: KDA token steps and causal-conv steps for many sequences, states updated in place.

KDA step per sequence n and head h (SPEC-K3 §2), on the state S = pool[slots[n], h] (fp32 [K, V]):
    S <- Diag(e^g) S;   S <- S + beta k (v - S^T k)^T;   o = S^T (scale q)
Depthwise causal conv step per channel d with kernel width W, on state c = conv_state[slots[n], d] ([W-1]):
    y = act(sum_{w<W-1} c[w] weight[d,w] + x weight[d,W-1] + bias[d]);   c <- (c[1:], x)
Both take T >= 1 tokens per sequence in one launch, exactly as T one-token calls would: speculative verification
runs the drafts plus one token (SPEC-K3 §11). The state after the last token goes back into the pool; the optional
`states_out` records the state after each earlier token, the snapshots a rejected draft rolls back to (§11,
strategy 1). Plain-PyTorch references sit beside each kernel. A slot < 0 marks padding: its states (pool and
states_out rows) are left alone and its output is zero. The optional `num_tokens` [N] lets the rows of one
static-shape launch hold different numbers of real tokens, each row padded at its end (short prefill chunks run as
one step): row n's tokens t >= num_tokens[n] leave its states alone and get zero outputs, so the pool ends as
num_tokens[n] one-token calls leave it; states_out[n, t] is then unspecified for t >= num_tokens[n] - 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def _kda_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> int:
    """T of the one-token form (q, k, g [N,H,K]; v [N,H,V]; beta [N,H]) or the T-token form ([N,T,...])."""
    if (q.dim() not in (3, 4) or k.shape != q.shape or g.shape != q.shape or v.dim() != q.dim()
            or v.shape[:-1] != q.shape[:-1] or beta.shape != q.shape[:-1] or (q.dim() == 4 and q.shape[1] < 1)):
        raise ValueError(f"kda_decode wants q, k, g [N,H,K] or [N,T,H,K] (T >= 1) with v [N,(T,)H,V] and beta "
                         f"[N,(T,)H]; got q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)}, "
                         f"v {tuple(v.shape)}, beta {tuple(beta.shape)}")
    return q.shape[1] if q.dim() == 4 else 1


def _check_states_out(states_out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if states_out is not None and (tuple(states_out.shape) != shape or states_out.dtype != dtype
                                   or not states_out.is_contiguous()):
        raise ValueError(f"states_out must be a contiguous {dtype} tensor of shape {shape} (the state after each "
                         f"token but the last), got {states_out.dtype} {tuple(states_out.shape)}")


def _check_num_tokens(num_tokens: torch.Tensor | None, N: int) -> None:
    """Shape and dtype only: its values stay on the device (reading them would sync the host)."""
    if num_tokens is not None and (tuple(num_tokens.shape) != (N,) or num_tokens.dtype.is_floating_point
                                   or num_tokens.dtype.is_complex or num_tokens.dtype == torch.bool):
        raise ValueError(f"num_tokens must be an integer tensor [N] = [{N}] (each row's real tokens, 0..T), got "
                         f"{num_tokens.dtype} {tuple(num_tokens.shape)}")


def _int32(num_tokens: torch.Tensor | None) -> torch.Tensor | None:
    return None if num_tokens is None else num_tokens.to(torch.int32)


@triton.jit
def _kda_decode_kernel(q, k, v, g, beta, pool, slots, o, states_out, num_tokens, scale, H, K: tl.constexpr,
                       V: tl.constexpr, T: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SAVE_STATES: tl.constexpr,
                       HAS_NUM_TOKENS: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    slot = tl.load(slots + n).to(tl.int64)
    cv = iv * BV + tl.arange(0, BV)
    mv = cv < V
    if slot >= 0:
        ck = tl.arange(0, BK)
        mk = ck < K
        tile = ck[:, None] * V + cv[None, :]
        smask = mk[:, None] & mv[None, :]
        s_ptr = pool + (slot * H + h) * K * V + tile
        S = tl.load(s_ptr, mask=smask, other=0.0)  # loaded once, carried through the T steps in registers
        if HAS_NUM_TOKENS:
            n_real = tl.load(num_tokens + n)
        for t in range(T):  # a loop at run time: a T-token step (a short prefill) compiles as fast as T = 1
            x = (n * T + t) * H + h
            mkt, mvt = mk, mv
            if HAS_NUM_TOKENS:  # a padding token reads zeros: g = k = v = beta = 0 leave S as it is, q = 0 gives o = 0
                # (tl.where, not `mk & (t < n_real)`: the interpreter turns that vector & scalar into int32)
                mkt, mvt = tl.where(t < n_real, mk, False), tl.where(t < n_real, mv, False)
            kk = tl.load(k + x * K + ck, mask=mkt, other=0.0).to(tl.float32)
            qq = tl.load(q + x * K + ck, mask=mkt, other=0.0).to(tl.float32) * scale
            gg = tl.load(g + x * K + ck, mask=mkt, other=0.0).to(tl.float32)
            vv = tl.load(v + x * V + cv, mask=mvt, other=0.0).to(tl.float32)
            b = tl.load(beta + x).to(tl.float32)
            if HAS_NUM_TOKENS:
                b = tl.where(t < n_real, b, 0.0)
            S = S * tl.exp(gg)[:, None]
            err = vv - tl.sum(S * kk[:, None], axis=0)
            S += (b * kk)[:, None] * err[None, :]
            tl.store(o + x * V + cv, tl.sum(S * qq[:, None], axis=0).to(o.dtype.element_ty), mask=mv)
            if SAVE_STATES:
                if t < T - 1:
                    snap = ((n.to(tl.int64) * (T - 1) + t) * H + h) * K * V
                    tl.store(states_out + snap + tile, S, mask=smask)
        tl.store(s_ptr, S, mask=smask)
    else:
        for t in range(T):
            tl.store(o + ((n * T + t) * H + h) * V + cv, tl.zeros([BV], dtype=tl.float32).to(o.dtype.element_ty),
                     mask=mv)


# The two launches are torch custom ops (declared in-place on their pools and snapshots) so that torch.compile
# keeps them whole in a compiled decode step and fuses the operations around them (`openk3.serve.runner`).
def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state_pool: torch.Tensor, slots: torch.Tensor, scale: float | None = None,
               states_out: torch.Tensor | None = None, num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """KDA steps for N sequences of T tokens. q, k, g [N,H,K] (one token) or [N,T,H,K]; v [N,H,V] or [N,T,H,V];
    beta [N,H] or [N,T,H]; state_pool [P,H,K,V] fp32, rows slots [N] (int32) updated in place to the state after
    the last token; states_out, optional fp32 [N,T-1,H,K,V], receives the state after each earlier token;
    num_tokens, optional int [N] in 0..T (None: all T), row n's real tokens (the rest is padding at its end: zero
    outputs, no state change; states_out[n, t >= num_tokens[n] - 1] unspecified, the final state is in the pool).
    Returns o in v's shape and dtype (token t's output reads the state after token t)."""
    # every argument positional: torch 2.11's in-place bookkeeping of a custom op indexes the mutated arguments by
    # position and fails on an optional one left to its default
    return _kda_decode_op(q, k, v, g, beta, state_pool, slots, scale, states_out, num_tokens)


@torch.library.custom_op("openk3::kda_decode", mutates_args=("state_pool", "states_out"))
def _kda_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state_pool: torch.Tensor, slots: torch.Tensor, scale: float | None,
                   states_out: torch.Tensor | None, num_tokens: torch.Tensor | None) -> torch.Tensor:
    """The op behind `kda_decode` (its contract)."""
    T = _kda_tokens(q, k, v, g, beta)
    N, H, K = q.shape[0], q.shape[-2], q.shape[-1]
    V = v.shape[-1]
    if state_pool.dtype != torch.float32 or not state_pool.is_contiguous():
        raise ValueError("state_pool must be a contiguous fp32 tensor [P,H,K,V]")
    _check_states_out(states_out, (N, T - 1, H, K, V), torch.float32)
    _check_num_tokens(num_tokens, N)
    scale = K**-0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 64)  # 64 x 4 warps: 81-87% of copy bandwidth on an H200
    if N:
        _kda_decode_kernel[(N, H, triton.cdiv(V, BV))](
            q, k, v, g, beta, state_pool, slots.to(torch.int32), o, states_out, _int32(num_tokens), scale, H=H, K=K,
            V=V, T=T, BK=BK, BV=BV, SAVE_STATES=states_out is not None, HAS_NUM_TOKENS=num_tokens is not None,
            num_warps=4)
    return o


@_kda_decode_op.register_fake
def _(q, k, v, g, beta, state_pool, slots, scale, states_out, num_tokens):
    T = _kda_tokens(q, k, v, g, beta)
    _check_states_out(states_out, (q.shape[0], T - 1, *q.shape[-2:], v.shape[-1]), torch.float32)
    _check_num_tokens(num_tokens, q.shape[0])
    return v.new_empty(v.shape)


def _kda_step_reference(q, k, v, g, beta, state_pool, slots, scale: float) -> torch.Tensor:
    """One token: q, k, g [N,H,K]; v [N,H,V]; beta [N,H]."""
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


def _token_slots(slots: torch.Tensor, num_tokens: torch.Tensor | None, t: int) -> torch.Tensor:
    """The slots token t writes: those of the rows where it is real, -1 (padding) elsewhere."""
    return slots if num_tokens is None else torch.where(t < num_tokens, slots, -1)


def kda_decode_reference(q, k, v, g, beta, state_pool, slots, scale: float | None = None,
                         states_out: torch.Tensor | None = None,
                         num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch `kda_decode` (same shapes and in-place contract), one token at a time."""
    T = _kda_tokens(q, k, v, g, beta)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.dim() == 3:
        return _kda_step_reference(q, k, v, g, beta, state_pool, _token_slots(slots, num_tokens, 0), scale)
    live = (slots >= 0).nonzero().flatten()
    outs = []
    for t in range(T):
        outs.append(_kda_step_reference(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state_pool,
                                        _token_slots(slots, num_tokens, t), scale))
        if states_out is not None and t < T - 1:
            states_out[live, t] = state_pool[slots[live].long()]
    return torch.stack(outs, dim=1)


@triton.jit
def _conv_window(x, conv_state, n, slot, cd, md, cw, D, t, T: tl.constexpr, W: tl.constexpr):
    """[BD, BW] taps of sequence n's window after its tokens < t, in fp32 holding conv_state's precision (as the
    window in memory after t one-token steps): tap c holds position p = t - (W-1) + c, token p when p >= 0, else
    the old tap t + c. One gather each way, whatever t (a run-time value: the loops over tokens are not unrolled)."""
    p = t - (W - 1) + cw
    tap = cw < W - 1
    old = tap & (p < 0)
    new = tap & (p >= 0)
    win = tl.load(conv_state + (slot * D + cd[:, None]) * (W - 1) + (p + W - 1)[None, :],
                  mask=md[:, None] & old[None, :], other=0.0).to(tl.float32)
    xs = tl.load(x + (n * T + p)[None, :] * D + cd[:, None], mask=md[:, None] & new[None, :], other=0.0)
    return tl.where(new[None, :], xs.to(conv_state.dtype.element_ty).to(tl.float32), win)


@triton.jit
def _conv_step_kernel(x, conv_state, slots, weight, bias, y, states_out, num_tokens, D, T: tl.constexpr,
                      W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                      SAVE_STATES: tl.constexpr, HAS_NUM_TOKENS: tl.constexpr):
    n = tl.program_id(0)
    cd = tl.program_id(1) * BD + tl.arange(0, BD)
    md = cd < D
    slot = tl.load(slots + n).to(tl.int64)
    if slot >= 0:
        cw = tl.arange(0, BW)
        taps = md[:, None] & (cw[None, :] < W - 1)
        wt = tl.load(weight + cd[:, None] * W + cw[None, :], mask=taps, other=0.0).to(tl.float32)
        w_last = tl.load(weight + cd * W + W - 1, mask=md, other=0.0).to(tl.float32)
        if HAS_NUM_TOKENS:  # the final window is the one after the row's n_real tokens: the loop's window n_real
            n_real = tl.minimum(tl.maximum(tl.load(num_tokens + n), 0), T)  # out of range: as 0 or T (as KDA's)
            real_last = tl.zeros([BD, BW], dtype=tl.float32)
        for t in range(T):  # at run time, as in the KDA step
            window = _conv_window(x, conv_state, n, slot, cd, md, cw, D, t, T, W)
            acc = tl.sum(window * wt, axis=1)
            acc += tl.load(x + (n * T + t) * D + cd, mask=md, other=0.0).to(tl.float32) * w_last
            if HAS_BIAS:
                acc += tl.load(bias + cd, mask=md, other=0.0).to(tl.float32)
            if SILU:
                acc = acc * tl.sigmoid(acc)
            if HAS_NUM_TOKENS:
                acc = tl.where(t < n_real, acc, 0.0)
                real_last = tl.where(t == n_real, window, real_last)
            tl.store(y + (n * T + t) * D + cd, acc.to(y.dtype.element_ty), mask=md)
            if SAVE_STATES:
                if t < T - 1:
                    snap = states_out + ((n.to(tl.int64) * (T - 1) + t) * D + cd[:, None]) * (W - 1) + cw[None, :]
                    after = _conv_window(x, conv_state, n, slot, cd, md, cw, D, t + 1, T, W)
                    tl.store(snap, after.to(states_out.dtype.element_ty), mask=taps)
        last = _conv_window(x, conv_state, n, slot, cd, md, cw, D, T, T, W)
        if HAS_NUM_TOKENS:
            last = tl.where(n_real == T, last, real_last)
        tl.debug_barrier()  # every thread has read the old taps before any is overwritten
        tl.store(conv_state + (slot * D + cd[:, None]) * (W - 1) + cw[None, :], last.to(conv_state.dtype.element_ty),
                 mask=taps)
    else:
        for t in range(T):
            tl.store(y + (n * T + t) * D + cd, tl.zeros([BD], dtype=tl.float32).to(y.dtype.element_ty), mask=md)


def _conv_tokens(x: torch.Tensor) -> int:
    """T of the one-token form (x [N,D]) or the T-token form ([N,T,D])."""
    if x.dim() not in (2, 3) or (x.dim() == 3 and x.shape[1] < 1):
        raise ValueError(f"causal_conv_step wants x [N,D] or [N,T,D] (T >= 1), got {tuple(x.shape)}")
    return x.shape[1] if x.dim() == 3 else 1


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     slots: torch.Tensor | None = None, activation: str | None = "silu",
                     states_out: torch.Tensor | None = None, num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv steps for N sequences of T tokens. x [N,D] (one token) or [N,T,D]; conv_state
    [P,D,W-1] (P = N without slots), updated in place to the window after the last token; weight [D,W]; bias [D]
    or None; activation "silu" or None; states_out, optional [N,T-1,D,W-1] in conv_state's dtype, receives the
    window after each earlier token; num_tokens, optional int [N] in 0..T, row n's real tokens (as kda_decode's).
    Returns y in x's shape."""
    return _causal_conv_step_op(x, conv_state, weight, bias, slots, activation, states_out,
                                num_tokens)  # (positional, as kda_decode)


@torch.library.custom_op("openk3::causal_conv_step", mutates_args=("conv_state", "states_out"))
def _causal_conv_step_op(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         slots: torch.Tensor | None, activation: str | None,
                         states_out: torch.Tensor | None, num_tokens: torch.Tensor | None) -> torch.Tensor:
    """The op behind `causal_conv_step` (its contract)."""
    T = _conv_tokens(x)
    N, D = x.shape[0], x.shape[-1]
    W = weight.shape[-1]
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    _check_states_out(states_out, (N, T - 1, D, W - 1), conv_state.dtype)
    _check_num_tokens(num_tokens, N)
    if slots is None:
        slots = torch.arange(N, dtype=torch.int32, device=x.device)
    x = x.contiguous()
    y = torch.empty_like(x)
    BD = 128
    if N:
        _conv_step_kernel[(N, triton.cdiv(D, BD))](
            x, conv_state, slots.to(torch.int32), weight.contiguous(), bias, y, states_out, _int32(num_tokens), D, T=T,
            W=W, BD=BD, BW=max(2, triton.next_power_of_2(W - 1)), HAS_BIAS=bias is not None,
            SILU=activation == "silu", SAVE_STATES=states_out is not None, HAS_NUM_TOKENS=num_tokens is not None,
            num_warps=4)
    return y


@_causal_conv_step_op.register_fake
def _(x, conv_state, weight, bias, slots, activation, states_out, num_tokens):
    T = _conv_tokens(x)
    _check_states_out(states_out, (x.shape[0], T - 1, x.shape[-1], weight.shape[-1] - 1), conv_state.dtype)
    _check_num_tokens(num_tokens, x.shape[0])
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _conv_step_reference(x, conv_state, weight, bias, idx, activation: str | None) -> torch.Tensor:
    """One token: x [N,D]; idx [N] the state rows (< 0: padding)."""
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


def causal_conv_step_reference(x, conv_state, weight, bias=None, slots=None, activation: str | None = "silu",
                               states_out: torch.Tensor | None = None,
                               num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch `causal_conv_step` (same shapes and in-place contract), one token at a time."""
    idx = torch.arange(x.shape[0], device=x.device) if slots is None else slots.long()
    if x.dim() == 2:
        return _conv_step_reference(x, conv_state, weight, bias, _token_slots(idx, num_tokens, 0), activation)
    live = (idx >= 0).nonzero().flatten()
    T = x.shape[1]
    ys = []
    for t in range(T):
        ys.append(_conv_step_reference(x[:, t], conv_state, weight, bias, _token_slots(idx, num_tokens, t),
                                       activation))
        if states_out is not None and t < T - 1:
            states_out[live, t] = conv_state[idx[live]]
    return torch.stack(ys, dim=1)
