"""Chunked KDA backward: a reverse state pass per (sequence, head, V block), then a token-parallel kernel.

Forward per chunk (chunk_fwd.py): pv = U - W S, O = Qd S + Aqk pv, S' = Diag(gc) S + kg^T pv. Walking the
chunks backwards, the reverse pass carries only what the chain needs and stores dS' (the gradient of the state
after each chunk) beside S (the state before it), which the forward does not keep: a replay pass recomputes
S' = Diag(gc) S + kg^T pv from the saved pv, kg and gc (the forward's own operands and order: the same bits),
so the states (K V / 16 values a token and head, most of what the forward would otherwise keep) live only
while their layer's backward runs:

    dpv = Aqk^T dO + kg dS'          dU = dpv
    dS  = Qd^T dO + Diag(gc) dS' - W^T dpv

The chunk terms (W, Qd, kg, Aqk, gc) are the forward's prepare kernel's, saved: 3 K + 16 values a token and
head, where recomputing them would take a second prepare kernel (docs/kernels.md).

Everything else is token-parallel, one program per chunk and head with all of V, so nothing is summed across
programs (T = (I + A)^-1, W = T Diag(beta) Kd, U = T Diag(beta) V, A = StrictTril(Diag(beta) Kd Ki^T),
Aqk = Tril(Qd Ki^T), kg = Ki e^G_C, gc = e^G_C). The forward's state pass saved pv = U - W S
(= T Diag(beta) (V - Kd S)), and its prepare kernel P = Kd Ki^T, T and the rows' inverse norms (136 bytes a
token and head; forming P over K and inverting again had been the first of this kernel's two passes over the
channels), so the only products with the states are those of the gradients:

    dQd = dO S^T + dAqk Ki,  dAqk = Tril(dO pv^T),  dkg = pv dS'^T,  dW = -dpv S^T,  dgc = rowsum(S ⊙ dS')
    dT = dW (beta Kd)^T + dU (beta V)^T = dpv (V - Kd S)^T Diag(beta) = dpv ((I + A) pv)^T;  T^T dW = -(T^T dpv) S^T
    dA = -T^T dT T^T (strictly lower)
    each product x_i y_j e^(G_i - G_j) gives dG_i += x_i dx_i and dG_j -= y_j dy_j; dg = reverse cumsum of dG
    (plus kg's and gc's terms, which depend on G_C: see the kernel)

The pair products (P, Aqk) are formed per gate mode as in the forward (chunk_fwd.py: one anchor, or
block-local anchors on four levels), and Aqk's diagonal, which has no decay, apart: its dG terms cancel
exactly, so it takes no part in dG (through the e^+-G-scaled products the cancellation is only as good as
their rounding, which at the gate floor, with e^+-75 scalings in tf32, swamps the true dg).

With fused activations the token-parallel kernel recomputes them from the raw inputs as the forward does and
returns gradients with respect to the activated q, k, g and beta; `activations_backward` takes them the rest
of the way to the raw inputs (the L2 norms' backward needs whole rows, which this kernel sees slice by slice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_fwd import (
    INTRA_BWD_LAUNCH,
    WARPS,
    GateSpec,
    _load_rows,
    _pow2,
    _store_rows,
    chain_start,
    dot_dtype,
    load_beta,
    load_slice,
    norm_offsets,
    pair_factors,
    pair_offsets,
    precision,
    scheduled_chunk,
    slice_width,
    state_block,
)
from openk3.ops.kda.triton.layout import CHUNK, ChunkLayout


@triton.jit
def _load_chunk_terms(W, QG, KG, AQK, GCX, X, c, cg, bos, eos, h, H, ck, cv, tt, K: tl.constexpr, VX: tl.constexpr,
                     BT: tl.constexpr, DT: tl.constexpr):
    """Chunk c's operands of the reverse pass, zero outside the sequence (so the pass can prefetch the next one):
    W, Qd, kg [BT, BK] and Aqk [BT, BT] in DT, gc [BK] fp32 and X [BT, BV] (dO, VX columns; zero past them) as
    stored."""
    start = bos + c * BT
    rows = start + tt
    rmask = (rows >= bos) & (rows < eos)
    xk = (rows[:, None] * H + h) * K + ck[None, :]
    mk = rmask[:, None] & (ck[None, :] < K)
    w = tl.load(W + xk, mask=mk, other=0.0).to(DT)
    qg = tl.load(QG + xk, mask=mk, other=0.0).to(DT)
    kg = tl.load(KG + xk, mask=mk, other=0.0).to(DT)
    aqk = tl.load(AQK + (rows[:, None] * H + h) * BT + tt[None, :], mask=rmask[:, None], other=0.0).to(DT)
    cg = tl.where((start >= bos) & (start < eos), cg, 0)  # a chunk outside: any valid address, never used
    gc = tl.load(GCX + (cg * H + h) * K + ck, mask=ck < K, other=0.0).to(tl.float32)
    x = tl.load(X + (rows[:, None] * H + h) * VX + cv[None, :], mask=rmask[:, None] & (cv[None, :] < VX), other=0.0)
    return w, qg, kg, aqk, gc, x


@triton.jit
def _state_bwd_kernel(W, QG, KG, AQK, GCX, do, dht, dh0, dU, dhs, cu, chunk_off,
                      H, K: tl.constexpr, V: tl.constexpr, VX: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr,
                      STORE: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """One (sequence, head, V block) chain of the reverse pass over a state of V columns; dO has VX <= V (the
    columns past it take zero dO). With STORE, dU and the state gradient after every chunk are written."""
    n, h, bos, eos, c0, ck, cv, smask, s_offs, dS = chain_start(dht, cu, chunk_off, H, K, V, BK, BV, HAS_DHT)
    n_chunks = tl.cdiv(eos - bos, BT)
    tt = tl.arange(0, BT)
    # software pipelining by hand (Triton does not pipeline this loop): chunk c - 1's loads are in flight while
    # chunk c's products run; 15% faster at B1 T8192 H32 on an H200, 4% slower at B8 T4096 (NOTES-kda.md run 13)
    w_n, qg_n, kg_n, aqk_n, gc_n, do_n = _load_chunk_terms(W, QG, KG, AQK, GCX, do, n_chunks - 1, c0 + n_chunks - 1,
                                                          bos, eos, h, H, ck, cv, tt, K, VX, BT, DT)
    for i in range(n_chunks):
        c = n_chunks - 1 - i
        w, qg, kg, aqk, gc, dout = w_n, qg_n, kg_n, aqk_n, gc_n, do_n.to(DT)
        w_n, qg_n, kg_n, aqk_n, gc_n, do_n = _load_chunk_terms(W, QG, KG, AQK, GCX, do, c - 1, c0 + c - 1, bos, eos,
                                                              h, H, ck, cv, tt, K, VX, BT, DT)
        dSd = dS.to(DT)
        if STORE:
            tl.store(dhs + ((c0 + c) * H + h) * K * V + s_offs, dSd.to(dhs.dtype.element_ty), mask=smask)
        dpv = tl.dot(tl.trans(aqk), dout, input_precision=PREC) + tl.dot(kg, dSd, input_precision=PREC)
        if STORE:
            rows = bos + c * BT + tt
            tl.store(dU + (rows[:, None] * H + h) * V + cv[None, :], dpv,
                     mask=(rows < eos)[:, None] & (cv[None, :] < V))
        dS = dS * gc[:, None] + tl.dot(tl.trans(qg), dout, input_precision=PREC) \
            - tl.dot(tl.trans(w), dpv.to(DT), input_precision=PREC)
    if HAS_H0:
        tl.store(dh0 + (n * H + h) * K * V + s_offs, dS, mask=smask)


@triton.jit
def _load_state_rows(hs, c, h, H, K: tl.constexpr, V: tl.constexpr, BS: tl.constexpr, BV: tl.constexpr, c0):
    """Rows c0:c0+BS of chunk c's [K, V] state (or state gradient), in its stored dtype."""
    r = c0 + tl.arange(0, BS)
    cv = tl.arange(0, BV)
    offs = ((c * H + h) * K + r[:, None]).to(tl.int64) * V + cv[None, :]
    return tl.load(hs + offs, mask=(r[:, None] < K) & (cv[None, :] < V), other=0.0)


@triton.jit
def _intra_bwd_kernel(q, k, v, g, beta, A_log, dt_bias, sched, hs, pvs, dhs, PT, RN, do, dU, dq, dk, dv, dg, dbeta,
                      scale, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                      BV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                      ACT: tl.constexpr, G_MIN: tl.constexpr, G_FLOOR: tl.constexpr, HIER: tl.constexpr):
    """Back-propagates one chunk's terms, BS channels of K at a time and all of V (the module docstring)."""
    c, h, t0, t1 = scheduled_chunk(sched, H)
    rows = t0 + tl.arange(0, BT)
    rmask = rows < t1
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    dt = DT
    b = load_beta(beta, rows, rmask, h, H, ACT)
    # the forward's P = Kd Ki^T (rescaled), T = (I + A)^-1 and inverse row norms (chunk_fwd.pair_terms)
    pair = pair_offsets(c, h, H, i, j, BT)
    P = tl.load(PT + pair)
    Tm = tl.load(PT + pair + BT * BT)
    norm = norm_offsets(rows, h, H)
    rq = tl.load(RN + norm, mask=rmask, other=0.0)
    rk = tl.load(RN + norm + 1, mask=rmask, other=0.0)
    dpv = _load_rows(dU, rows, rmask, H, h, V, BV)
    dout = _load_rows(do, rows, rmask, H, h, V, BV)
    vv = _load_rows(v, rows, rmask, H, h, V, BV)
    pv = _load_rows(pvs, rows, rmask, H, h, V, BV)  # U - W S, as the forward's state pass formed it
    # dT = dW (beta Kd)^T + dU (beta V)^T with dW = -dpv S^T and dU = dpv: dpv (V - Kd S)^T Diag(beta), where
    # Diag(beta) (V - Kd S) = (I + A) pv since pv = T Diag(beta) (V - Kd S)
    IA = tl.where(i > j, P * b[:, None], tl.where(i == j, 1.0, 0.0))
    dT = tl.dot(dpv, tl.trans(tl.dot(IA, pv, input_precision=PREC)), input_precision=PREC)
    Tt = tl.trans(Tm)
    # T = (I + A)^-1  =>  dA = -T^T dT T^T, kept where A lives (strictly lower); A = Diag(beta) P
    dA = tl.where(i > j, -tl.dot(tl.dot(Tt, dT, input_precision=PREC), Tt, input_precision=PREC), 0.0)
    dbeta_acc = tl.sum(dA * P, axis=1)
    dP = dA * b[:, None]
    # Aqk's diagonal pairs q_i . k_i carry no decay (e^(G_i - G_i) = 1) and so add nothing to dG; formed through
    # the e^G- and e^-G-scaled operands their two halves would cancel only up to the products' rounding, which
    # at the gate floor (e^+-75 scalings, tf32) swamps the true dg (rel. error 0.15 on an H200): the diagonal
    # takes an exact path of its own and the products see the strictly lower part only
    dAqk = tl.where(i > j, tl.dot(dout, tl.trans(pv), input_precision=PREC), 0.0)
    dAqk_diag = tl.sum(dout * pv, axis=1)
    # the V side first, so only 16-bit copies of the [BT, V] tiles stay live through the channel pass
    dVb = tl.dot(Tt, dpv, input_precision=PREC)
    dbeta_acc += tl.sum(dVb * vv, axis=1)
    _store_rows(dv, dVb * b[:, None], rows, rmask, H, h, V, BV)
    pvd, dVbd, doutd = pv.to(dt), dVb.to(dt), dout.to(dt)
    # per-channel gradients. The one-sided terms (the state's Qd S and kg, W's Kd) are anchored at the chunk
    # start; the pair terms take pair_factors' anchors. Each pair x_ij adds x_ij to dG_i, -x_ij to dG_j.
    for c0 in range(0, K, BS):
        qq, kk, gg, G, GC, clamped = load_slice(q, k, g, A_log, dt_bias, rows, rmask, h, H, K, BT, BS, c0, ACT,
                                                G_MIN, G_FLOOR)
        S = _load_state_rows(hs, c, h, H, K, V, BS, BV, c0).to(dt)
        dS = _load_state_rows(dhs, c, h, H, K, V, BS, BV, c0).to(dt)
        kk = kk * rk[:, None]
        qs = qq * (scale * rq)[:, None]  # the activated, scaled q
        eG = tl.exp(G)
        Kd = kk * eG
        Qd = qs * eG
        St = tl.trans(S)
        dWb = -tl.dot(dVbd, St, input_precision=PREC)  # T^T dW = -(T^T dpv) S^T
        dbeta_acc += tl.sum(dWb * Kd, axis=1)
        dKd = dWb * b[:, None]
        dQd = tl.dot(doutd, St, input_precision=PREC)
        dkg = tl.dot(pvd, tl.trans(dS), input_precision=PREC)
        ekg = tl.exp(GC[None, :] - G)
        kg = kk * ekg
        dG = dQd * Qd + dKd * Kd
        dqs = dQd * eG + dAqk_diag[:, None] * kk  # gradients of the activated k and the scaled q
        dkk = dKd * eG + dkg * ekg + dAqk_diag[:, None] * qs
        for lv in tl.static_range(4 if HIER else 1):
            fi, fj, pairs = pair_factors(gg, G, lv, i, j, BT, BS, HIER)
            Kl, Ql, Kj = kk * fi, qs * fi, kk * fj
            dPl = tl.where(pairs, dP, 0.0)
            dAl = tl.where(pairs, dAqk, 0.0)
            dKl = tl.dot(dPl, Kj, input_precision=PREC)
            dQl = tl.dot(dAl, Kj, input_precision=PREC)
            dKj = tl.dot(tl.trans(dPl), Kl, input_precision=PREC) + tl.dot(tl.trans(dAl), Ql, input_precision=PREC)
            dG += dKl * Kl + dQl * Ql - dKj * Kj
            dqs += dQl * fi
            dkk += dKl * fi + dKj * fj
        dgc = tl.sum(S.to(tl.float32) * dS.to(tl.float32), axis=1)
        # G_t = sum_{s<=t} g_s, so the terms in e^G_s reach g_t for t <= s, kg_s = k_s e^(G_C - G_s) for s < t and
        # gc = e^G_C every g. Each sum is formed directly, never as a difference of larger sums: under strong
        # decay (g = -10: true dg ~1e-6 beside O(1) terms) such differences lost dg to rounding
        dgg = (tl.cumsum(dG, axis=0, reverse=True)
               + tl.dot(tl.where(i > j, 1.0, 0.0), dkg * kg, input_precision="ieee")
               + (dgc * tl.exp(GC))[None, :])
        _store_rows(dq, dqs * scale, rows, rmask, H, h, K, BS, c0)
        _store_rows(dk, dkk, rows, rmask, H, h, K, BS, c0)
        _store_rows(dg, tl.where(clamped, 0.0, dgg), rows, rmask, H, h, K, BS, c0)
    tl.store(dbeta + rows * H + h, dbeta_acc.to(dbeta.dtype.element_ty), mask=rmask)


@triton.jit(do_not_specialize=["N"])
def _state_replay_kernel(KG, GCX, pvs, h0, hs, cu, chunk_off, N, H, K: tl.constexpr, V: tl.constexpr,
                         BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
                         PREC: tl.constexpr, DT: tl.constexpr):
    """The forward state pass's recurrence alone for one (sequence, head, block of BV columns), from its saved
    pseudo-values: the state before each chunk to hs."""
    n, h, bos, eos, c0, ck, cv, smask, s_offs, S = chain_start(h0, cu, chunk_off, H, K, V, BK, BV, HAS_H0)
    tt = tl.arange(0, BT)
    for c in range(tl.cdiv(eos - bos, BT)):
        rows = bos + c * BT + tt
        rmask = rows < eos
        tl.store(hs + ((c0 + c) * H + h) * K * V + s_offs, S.to(hs.dtype.element_ty), mask=smask)
        kg = tl.load(KG + (rows[:, None] * H + h) * K + ck[None, :], mask=rmask[:, None] & (ck[None, :] < K),
                     other=0.0).to(DT)
        pv = tl.load(pvs + (rows[:, None] * H + h) * V + cv[None, :], mask=rmask[:, None] & (cv[None, :] < V),
                     other=0.0).to(DT)
        gc = tl.load(GCX + ((c0 + c) * H + h) * K + ck, mask=ck < K, other=0.0).to(tl.float32)
        S = S * gc[:, None] + tl.dot(tl.trans(kg), pv, input_precision=PREC)


def replay_states(h0, pvs, KG, GC, lay: ChunkLayout, dtype) -> torch.Tensor:
    """The state before every chunk, [n_chunks, H, K, V] in the terms' dtype, replayed from what the forward saved
    (chunk_fwd.chunk_kda_fwd: the initial state or None, the pseudo-values, kg and gc) with the forward's block of
    V columns (`dtype`: q's)."""
    T, H, K = KG.shape
    V = pvs.shape[-1]
    N = lay.n_seqs
    hs = torch.empty(max(lay.n_chunks, 1), H, K, V, dtype=KG.dtype, device=KG.device)
    BV = state_block(N, H, V)
    _state_replay_kernel[(N, H, triton.cdiv(V, BV))](
        KG, GC, pvs, h0, hs, lay.cu_seqlens, lay.chunk_offsets, N=N, H=H, K=K, V=V, BT=CHUNK, BK=_pow2(K), BV=BV,
        HAS_H0=h0 is not None, PREC=precision(dtype), DT=dot_dtype(dtype, KG.device), num_warps=WARPS["state"])
    return hs


def reverse_pass(terms, do, dht, has_h0, lay: ChunkLayout, BV: int, dtype, store: bool = True):
    """The reverse state pass over the prepare kernel's `terms` (U unread): dU (fp32), the state gradient after
    every chunk (dhs, like the saved states) and dh0 (or None without `has_h0`). Without `store` only dh0 is
    written (dU and dhs come back None) and the state may be wider than dO (dht [N, H, K, V'], V' > V): its
    columns past V take zero dO (KCP's initial-state gradient and transposed transition at once)."""
    W, _, QG, KG, AQK, GC = terms
    T, H, K = W.shape
    VX = do.shape[-1]
    V = VX if dht is None else dht.shape[-1]
    if V != VX and store:
        raise ValueError(f"a state wider than dO ({V} > {VX} columns) stores nothing: pass store=False")
    N = lay.n_seqs
    f32 = dict(dtype=torch.float32, device=W.device)
    dU = torch.empty(T, H, V, **f32) if store else None
    dhs = torch.empty(max(lay.n_chunks, 1), H, K, V, dtype=W.dtype, device=W.device) if store else None
    dh0 = torch.empty(N, H, K, V, **f32) if has_h0 else None
    _state_bwd_kernel[(N, H, triton.cdiv(V, BV))](
        W, QG, KG, AQK, GC, do, dht, dh0, dU, dhs, lay.cu_seqlens, lay.chunk_offsets,
        H=H, K=K, V=V, VX=VX, BT=CHUNK, BK=_pow2(K), BV=BV, HAS_DHT=dht is not None, HAS_H0=has_h0, STORE=store,
        PREC=precision(dtype), DT=dot_dtype(dtype, do.device), num_warps=WARPS["state_bwd"])
    return dU, dhs, dh0


def intra_backward(q, k, v, g, beta, scale, hs, pvs, dhs, pairs, do, dU, lay: ChunkLayout, gate: GateSpec):
    """The token-parallel backward through each chunk's own terms (`pairs`: the forward's, chunk_fwd.pair_terms);
    returns dq, dk, dv, dg, dbeta."""
    T, H, K = q.shape
    V = v.shape[-1]
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    dg = torch.empty_like(g, dtype=torch.float32 if gate.fused else g.dtype)
    dbeta = torch.empty_like(beta)
    if lay.n_chunks:
        _intra_bwd_kernel[(lay.n_chunks * H,)](
            q, k, v, g, beta, sched=lay.schedule, hs=hs, pvs=pvs, dhs=dhs, PT=pairs[0], RN=pairs[1], do=do, dU=dU,
            dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, scale=scale, H=H, K=K, V=V, BT=CHUNK, BS=slice_width(K, V),
            BV=_pow2(V), PREC=precision(q.dtype), DT=dot_dtype(q.dtype, q.device),
            num_warps=WARPS["intra_bwd"], **INTRA_BWD_LAUNCH, **gate.kernel_args(q))
    return dq, dk, dv, dg, dbeta


def chunk_kda_bwd(q, k, v, g, beta, scale, saved, do, dht, has_h0, lay: ChunkLayout, gate: GateSpec):
    """Flat [T,H,*] backward from what the forward saved (chunk_kda_fwd): the initial state (or None), the
    pseudo-values, the chunk terms W, Qd, kg, Aqk, gc and the pair terms P, T and the inverse norms. Returns dq,
    dk, dv, dg (fp32 with fused activations), dbeta, dh0; with fused activations the gradients are with respect
    to the activated q, k, g and beta."""
    h0, pvs, W, QG, KG, AQK, GC, *pairs = saved
    H, V = q.shape[1], v.shape[-1]
    BV = state_block(lay.n_seqs, H, V)  # as the forward's pass (same chains, same trade-off)
    dU, dhs, dh0 = reverse_pass((W, None, QG, KG, AQK, GC), do, dht, has_h0, lay, BV, q.dtype)
    hs = replay_states(h0, pvs, KG, GC, lay, q.dtype)
    return (*intra_backward(q, k, v, g, beta, scale, hs, pvs, dhs, pairs, do, dU, lay, gate), dh0)
