"""Chunked KDA backward: a reverse state pass per (sequence, head, V block), then a token-parallel kernel.

Forward per chunk (chunk_fwd.py): pv = U - W S, O = Qd S + Aqk pv, S' = Diag(gc) S + kg^T pv. Walking the
chunks backwards with dS' (the gradient of the state after the chunk):

    dpv = Aqk^T dO + kg dS'          dU = dpv
    dQd = dO S^T,  dAqk = dO pv^T,  dkg = pv dS'^T,  dW = -dpv S^T,  dgc = rowsum(S ⊙ dS')
    dS  = Qd^T dO + Diag(gc) dS' - W^T dpv

dQd, dAqk, dkg, dW and dgc sum over V: each V block writes its partial sums and the token-parallel kernel
adds them up while it back-propagates through the chunk's own terms (T = (I + A)^-1, W = T Diag(beta) Kd,
U = T Diag(beta) V, A = StrictTril(Diag(beta) Kd Ki^T), Aqk = Tril(Qd Ki^T), kg = Ki e^G_C, gc = e^G_C):

    dT = dW (beta Kd)^T + dU (beta V)^T,   dA = -T^T dT T^T (strictly lower)
    each product x_i y_j e^(G_i - G_j) gives dG_i += x_i dx_i and dG_j -= y_j dy_j; dg = reverse cumsum of dG

With fused activations the token-parallel kernel recomputes them from the raw inputs as the forward does and
returns gradients with respect to the activated q, k, g and beta; `activations_backward` takes them the rest
of the way to the raw inputs (the L2 norms' backward needs whole rows, which this kernel sees slice by slice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_fwd import (
    WARPS,
    FusedActivation,
    _load_rows,
    _pow2,
    _store_rows,
    activation_args,
    dot_dtype,
    inverse_norm,
    inverse_precision,
    load_beta,
    load_slice,
    precision,
    prepare,
    slice_width,
    unit_lower_inverse,
)
from openk3.ops.kda.triton.layout import CHUNK, ChunkLayout


@triton.jit
def _partial(ptrs, x, mask, ATOMIC: tl.constexpr):
    if ATOMIC:
        tl.atomic_add(ptrs, x, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, x, mask=mask)


@triton.jit
def _state_bwd_kernel(W, U, QG, KG, AQK, GCX, hs, do, dht, dh0, dU, pQG, pAQK, pKG, pW, pGC, cu, chunk_off,
                      T_total, n_chunks_total,
                      H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr,
                      PREC: tl.constexpr, DT: tl.constexpr, ATOMIC: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    bos = tl.load(cu + n).to(tl.int64)
    eos = tl.load(cu + n + 1)
    c0 = tl.load(chunk_off + n).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, BT)
    dt = DT
    ck = tl.arange(0, BK)
    cv = iv * BV + tl.arange(0, BV)
    tt = tl.arange(0, BT)
    smask = (ck[:, None] < K) & (cv[None, :] < V)
    s_offs = ck[:, None] * V + cv[None, :]
    if HAS_DHT:
        dS = tl.load(dht + (n * H + h) * K * V + s_offs, mask=smask, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
    # partial sums of this V block: its own plane of [NV, T, H, *] buffers, or added atomically into one plane
    pk = 0 if ATOMIC else iv * T_total * H * K
    pa = 0 if ATOMIC else iv * T_total * H * BT
    pg = 0 if ATOMIC else iv * n_chunks_total * H * K
    for i in range(n_chunks):
        c = n_chunks - 1 - i
        rows = bos + c * BT + tt
        rmask = rows < eos
        S = tl.load(hs + ((c0 + c) * H + h) * K * V + s_offs, mask=smask, other=0.0).to(dt)
        xk = (rows[:, None] * H + h) * K + ck[None, :]
        mk = rmask[:, None] & (ck[None, :] < K)
        w = tl.load(W + xk, mask=mk, other=0.0).to(dt)
        qg = tl.load(QG + xk, mask=mk, other=0.0).to(dt)
        kg = tl.load(KG + xk, mask=mk, other=0.0).to(dt)
        xv = (rows[:, None] * H + h) * V + cv[None, :]
        mv = rmask[:, None] & (cv[None, :] < V)
        u = tl.load(U + xv, mask=mv, other=0.0).to(tl.float32)
        dout = tl.load(do + xv, mask=mv, other=0.0).to(dt)
        xa = (rows[:, None] * H + h) * BT + tt[None, :]
        aqk = tl.load(AQK + xa, mask=rmask[:, None], other=0.0).to(dt)
        gc = tl.load(GCX + ((c0 + c) * H + h) * K + ck, mask=ck < K, other=0.0).to(tl.float32)
        pv = (u - tl.dot(w, S, input_precision=PREC)).to(dt)
        dSd = dS.to(dt)
        dpv = tl.dot(tl.trans(aqk), dout, input_precision=PREC) + tl.dot(kg, dSd, input_precision=PREC)
        tl.store(dU + xv, dpv, mask=mv)
        St = tl.trans(S)
        _partial(pQG + pk + xk, tl.dot(dout, St, input_precision=PREC), mk, ATOMIC)
        _partial(pKG + pk + xk, tl.dot(pv, tl.trans(dSd), input_precision=PREC), mk, ATOMIC)
        _partial(pW + pk + xk, -tl.dot(dpv.to(dt), St, input_precision=PREC), mk, ATOMIC)
        _partial(pAQK + pa + xa, tl.dot(dout, tl.trans(pv), input_precision=PREC), rmask[:, None], ATOMIC)
        dgc = tl.sum(S.to(tl.float32) * dS, axis=1)
        _partial(pGC + pg + ((c0 + c) * H + h) * K + ck, dgc, ck < K, ATOMIC)
        dS = dS * gc[:, None] + tl.dot(tl.trans(qg), dout, input_precision=PREC) \
            - tl.dot(tl.trans(w), dpv.to(dt), input_precision=PREC)
    if HAS_H0:
        tl.store(dh0 + (n * H + h) * K * V + s_offs, dS, mask=smask)


@triton.jit
def _sum_planes(ptr, offs, mask, plane, NV: tl.constexpr):
    acc = tl.load(ptr + offs, mask=mask, other=0.0)
    for iv in tl.static_range(1, NV):
        acc += tl.load(ptr + iv * plane + offs, mask=mask, other=0.0)
    return acc


@triton.jit
def _intra_bwd_kernel(q, k, v, g, beta, A_log, dt_bias, bounds, dU, pQG, pAQK, pKG, pW, pGC, dq, dk, dv, dg, dbeta,
                      scale, T_total, n_chunks_total,
                      H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                      NV: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr,
                      ACT: tl.constexpr, G_MIN: tl.constexpr):
    """Back-propagates one chunk's terms, BS channels at a time (see the module docstring)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    t0 = tl.load(bounds + 2 * c).to(tl.int64)
    t1 = tl.load(bounds + 2 * c + 1)
    rows = t0 + tl.arange(0, BT)
    rmask = rows < t1
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    b = load_beta(beta, rows, rmask, h, H, ACT)
    plane_k = T_total * H * K
    # pass 1: P = Kd Ki^T and dT = dW (beta Kd)^T + dU (beta V)^T, reduced over the channels (raw k under ACT)
    P = tl.zeros([BT, BT], dtype=tl.float32)
    dT = tl.zeros([BT, BT], dtype=tl.float32)
    sq_q = tl.zeros([BT], dtype=tl.float32)
    sq_k = tl.zeros([BT], dtype=tl.float32)
    for c0 in tl.static_range(0, K, BS):  # loads only: all slices in flight at once
        qq, kk, G, GC = load_slice(q, k, g, A_log, dt_bias, rows, rmask, h, H, K, BT, BS, c0, ACT, G_MIN)
        xk = (rows[:, None] * H + h) * K + c0 + tl.arange(0, BS)[None, :]
        mk = rmask[:, None] & (c0 + tl.arange(0, BS)[None, :] < K)
        dW = _sum_planes(pW, xk, mk, plane_k, NV)
        Kd = kk * tl.exp(G)
        P += tl.dot(Kd, tl.trans(kk * tl.exp(-G)), input_precision=PREC)
        dT += tl.dot(dW, tl.trans(Kd), input_precision=PREC)
        if ACT != 0:
            sq_q += tl.sum(qq * qq, axis=1)
            sq_k += tl.sum(kk * kk, axis=1)
    rq = inverse_norm(sq_q, ACT)
    rk = inverse_norm(sq_k, ACT)
    P = P * rk[:, None] * rk[None, :]
    dT = dT * rk[None, :]
    for c0 in tl.static_range(0, V, BS):
        vv = _load_rows(v, rows, rmask, H, h, V, BS, c0)
        dT += tl.dot(_load_rows(dU, rows, rmask, H, h, V, BS, c0), tl.trans(vv), input_precision=PREC)
    dT = dT * b[None, :]
    Tt = tl.trans(unit_lower_inverse(tl.where(i > j, P * b[:, None], 0.0), i, j, INV_PREC))
    # T = (I + A)^-1  =>  dA = -T^T dT T^T, kept where A lives (strictly lower); A = Diag(beta) P
    dA = tl.where(i > j, -tl.dot(tl.dot(Tt, dT, input_precision=PREC), Tt, input_precision=PREC), 0.0)
    dbeta_acc = tl.sum(dA * P, axis=1)
    dP = dA * b[:, None]
    xa = (rows[:, None] * H + h) * BT + j
    dAqk = tl.where(i >= j, _sum_planes(pAQK, xa, rmask[:, None], T_total * H * BT, NV), 0.0)
    # pass 2: per-channel gradients
    for c0 in range(0, K, BS):
        qq, kk, G, GC = load_slice(q, k, g, A_log, dt_bias, rows, rmask, h, H, K, BT, BS, c0, ACT, G_MIN)
        kk = kk * rk[:, None]
        eG = tl.exp(G)
        Ki = kk * tl.exp(-G)
        Qd = qq * (scale * rq)[:, None] * eG
        cs = c0 + tl.arange(0, BS)
        xk = (rows[:, None] * H + h) * K + cs[None, :]
        mk = rmask[:, None] & (cs[None, :] < K)
        Kd = kk * eG
        dWb = tl.dot(Tt, _sum_planes(pW, xk, mk, plane_k, NV), input_precision=PREC)
        dbeta_acc += tl.sum(dWb * Kd, axis=1)
        dKd = dWb * b[:, None] + tl.dot(dP, Ki, input_precision=PREC)
        dKi = tl.dot(tl.trans(dP), Kd, input_precision=PREC) + tl.dot(tl.trans(dAqk), Qd, input_precision=PREC)
        dQd = _sum_planes(pQG, xk, mk, plane_k, NV) + tl.dot(dAqk, Ki, input_precision=PREC)
        dkg = _sum_planes(pKG, xk, mk, plane_k, NV)
        kg = kk * tl.exp(GC[None, :] - G)
        dG = dQd * Qd + dKd * Kd - dKi * Ki - dkg * kg
        dgc = _sum_planes(pGC, (c * H + h) * K + cs, cs < K, n_chunks_total * H * K, NV)
        dGC = tl.sum(dkg * kg, axis=0) + dgc * tl.exp(GC)
        # G_t = sum_{s<=t} g_s and G_C = G at the chunk's end: dg_t = sum_{s>=t} dG_s + dG_C
        dgg = tl.sum(dG, axis=0)[None, :] - tl.cumsum(dG, axis=0) + dG + dGC[None, :]
        _store_rows(dq, dQd * eG * scale, rows, rmask, H, h, K, BS, c0)
        _store_rows(dk, dKd * eG + dKi * tl.exp(-G) + dkg * tl.exp(GC[None, :] - G), rows, rmask, H, h, K, BS, c0)
        _store_rows(dg, dgg, rows, rmask, H, h, K, BS, c0)
    for c0 in range(0, V, BS):
        dVb = tl.dot(Tt, _load_rows(dU, rows, rmask, H, h, V, BS, c0), input_precision=PREC)
        dbeta_acc += tl.sum(dVb * _load_rows(v, rows, rmask, H, h, V, BS, c0), axis=1)
        _store_rows(dv, dVb * b[:, None], rows, rmask, H, h, V, BS, c0)
    tl.store(dbeta + rows * H + h, dbeta_acc.to(dbeta.dtype.element_ty), mask=rmask)


def reverse_pass(W, U, QG, KG, AQK, GC, hs, do, dht, has_h0, lay: ChunkLayout, BV: int, atomic: bool, dtype):
    """The reverse state pass: dU, the V-summed partials (NV planes, or one when added atomically) and dh0."""
    T, H, K = W.shape
    V = U.shape[-1]
    N = lay.n_seqs
    NV = triton.cdiv(V, BV)
    planes = 1 if atomic else NV
    nc = max(lay.n_chunks, 1)
    new = torch.zeros if atomic else torch.empty
    f32 = dict(dtype=torch.float32, device=W.device)
    dU = torch.empty(T, H, V, **f32)
    pQG, pKG, pW = (new(planes, T, H, K, **f32) for _ in range(3))
    pAQK = new(planes, T, H, CHUNK, **f32)
    pGC = new(planes, nc, H, K, **f32)
    dh0 = torch.empty(N, H, K, V, **f32) if has_h0 else None
    _state_bwd_kernel[(N, H, NV)](
        W, U, QG, KG, AQK, GC, hs, do, dht, dh0, dU, pQG, pAQK, pKG, pW, pGC, lay.cu_seqlens, lay.chunk_offsets,
        T, nc, H=H, K=K, V=V, BT=CHUNK, BK=_pow2(K), BV=BV, HAS_DHT=dht is not None, HAS_H0=has_h0,
        PREC=precision(dtype), DT=dot_dtype(dtype), ATOMIC=atomic, num_warps=WARPS["state_bwd"])
    return dU, (pQG, pAQK, pKG, pW, pGC), dh0


def intra_backward(q, k, v, g, beta, scale, dU, partials, lay: ChunkLayout, act: FusedActivation | None = None):
    """The token-parallel backward through each chunk's own terms; returns dq, dk, dv, dg, dbeta."""
    T, H, K = q.shape
    V = v.shape[-1]
    pQG, pAQK, pKG, pW, pGC = partials
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    dg = torch.empty_like(g, dtype=torch.float32 if act is not None else g.dtype)
    dbeta = torch.empty_like(beta)
    if lay.n_chunks:
        _intra_bwd_kernel[(lay.n_chunks, H)](
            q, k, v, g, beta, bounds=lay.chunk_bounds, dU=dU, pQG=pQG, pAQK=pAQK, pKG=pKG, pW=pW, pGC=pGC,
            dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, scale=scale, T_total=T, n_chunks_total=pGC.shape[1],
            H=H, K=K, V=V, BT=CHUNK, BS=slice_width(K, V), NV=pQG.shape[0], PREC=precision(q.dtype),
            INV_PREC=inverse_precision(q.dtype), num_warps=WARPS["intra_bwd"], **activation_args(act, q))
    return dq, dk, dv, dg, dbeta


def chunk_kda_bwd(q, k, v, g, beta, scale, hs, do, dht, has_h0, lay: ChunkLayout, BV: int,
                  act: FusedActivation | None = None, atomic: bool = False):
    """Flat [T,H,*] backward from the saved per-chunk states hs. Returns dq, dk, dv, dg (fp32 under `act`),
    dbeta, dh0; under `act` the gradients are with respect to the activated q, k, g and beta."""
    terms = prepare(q, k, v, g, beta, scale, lay, act)
    dU, partials, dh0 = reverse_pass(*terms, hs, do, dht, has_h0, lay, BV, atomic, q.dtype)
    return (*intra_backward(q, k, v, g, beta, scale, dU, partials, lay, act), dh0)
