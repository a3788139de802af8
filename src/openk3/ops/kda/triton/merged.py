"""KDA forward on 64-token chunks merged from four 16-token sub-chunks (SPEC-K3 §2; bench/NOTES-kda.md).

The state pass walks one dependent step per chunk, so at batch 1 its time is the chunk count times the latency
of a step; 64-token chunks take a quarter of the steps. Their terms cannot be formed like the 16-token ones:
e^-G over 64 gates leaves fp32. They are composed from the sub-chunks' own terms instead (chunk_fwd.py, each
anchored at its sub-chunk's start), with factors that are all decays <= 1. For sub-chunks n, m < n of a chunk
(Gamma_n = prod_{j<n} gc_j, E_nm = kg_m Diag(prod_{m<j<n} gc_j), Tb_m = T_m Diag(beta_m), Kd64 = K e^G64 with
G64 anchored at the chunk's start):

    C_nm = W_n E_nm^T = Tb_n (Kd_n E_nm^T),       R = (I + C)^-1  (block unit lower: R_nm = -sum_j C_nj R_jm)
    W64_n = sum_{m<=n} R_nm Tb_m Kd64_m,          U64_n = sum_{m<=n} R_nm Tb_m V_m
    Qd64_n = Qd_n Diag(Gamma_n),   Aqk64_nm = Qd_n E_nm^T (m < n), Aqk_n (m = n),   kg64_m = E_4m,   gc64 = Gamma_4

and the state pass of chunk_fwd.py runs unchanged with BT = 64. A sub-chunk's pseudo-values pv_n = U_n - W_n S_n
see the state after the earlier sub-chunks, S_n = Diag(Gamma_n) S + sum_m E_nm^T pv_m; solving for all four at
once is the block system (I + C) pv = U - W Diag(Gamma) S, hence R. Forward only, no per-chunk states: the
backward works on 16-token chunks (chunk_bwd.py).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_fwd import (
    WARPS,
    FusedActivation,
    _load_rows,
    _store_rows,
    activation_args,
    chunk_terms,
    inverse_norm,
    inverse_precision,
    load_beta,
    load_slice,
    precision,
    scheduled_chunk,
    slice_width,
    state_pass,
    t_times_beta,
)
from openk3.ops.kda.triton.layout import CHUNK, ChunkLayout

MERGED = 4 * CHUNK
# opt-in until timed on a GPU: forwards without autograd (inference) then take this path in kda_triton(_fused)
ENABLED = os.environ.get("OPENK3_KDA_MERGED") == "1"


@triton.jit
def _sub_slice(q, k, g, A_log, dt_bias, rows, rmask, h, H, K: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, c0,
               ACT: tl.constexpr, G_MIN: tl.constexpr):
    """One sub-chunk's slice: raw q, k, its G and G_C (load_slice), Kd = k e^G, Ki = k e^-G, kg = k e^(G_C - G)."""
    qq, kk, G, GC = load_slice(q, k, g, A_log, dt_bias, rows, rmask, h, H, K, BT, BS, c0, ACT, G_MIN)
    return qq, kk, G, GC, kk * tl.exp(G), kk * tl.exp(-G), kk * tl.exp(GC[None, :] - G)


@triton.jit
def _cross_decays(kg0, kg1, C1, C2):
    """E_20^T, E_30^T, E_31^T: kg of an earlier sub-chunk decayed through the sub-chunks between it and n (the
    E_nm of adjacent sub-chunks is kg_m itself)."""
    return tl.trans(kg0 * tl.exp(C1)[None, :]), tl.trans(kg0 * tl.exp(C1 + C2)[None, :]), \
        tl.trans(kg1 * tl.exp(C2)[None, :])


@triton.jit
def _merged_prepare_kernel(q, k, v, g, beta, A_log, dt_bias, sched, W, U, QG, KG, AQK, GCX, scale,
                           H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                           PREC: tl.constexpr, INV_PREC: tl.constexpr, ACT: tl.constexpr, G_MIN: tl.constexpr):
    """The 64-token terms of one chunk from its four sub-chunks (the module docstring), BS channels at a time."""
    c, h, t0, t1 = scheduled_chunk(sched, H)
    r0 = t0 + tl.arange(0, BT)
    r1 = r0 + BT
    r2 = r1 + BT
    r3 = r2 + BT
    m0, m1, m2, m3 = r0 < t1, r1 < t1, r2 < t1, r3 < t1
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    b0 = load_beta(beta, r0, m0, h, H, ACT)
    b1 = load_beta(beta, r1, m1, h, H, ACT)
    b2 = load_beta(beta, r2, m2, h, H, ACT)
    b3 = load_beta(beta, r3, m3, h, H, ACT)
    zero = tl.zeros([BT, BT], dtype=tl.float32)
    sq = tl.zeros([BT], dtype=tl.float32)
    sq_q0, sq_q1, sq_q2, sq_q3, sq_k0, sq_k1, sq_k2, sq_k3 = sq, sq, sq, sq, sq, sq, sq, sq
    # Three passes over K before the stores, each with few 16 x 16 accumulators live (every warp holds a
    # whole 16 x 16 tile): (a) each sub-chunk's own products, raw (rescaled by the row norms under ACT)
    P0, P1, P2, P3, A0, A1, A2, A3 = zero, zero, zero, zero, zero, zero, zero, zero
    for c0 in range(0, K, BS):
        q0, k0, G0, C0, Kd0, Ki0, kg0 = _sub_slice(q, k, g, A_log, dt_bias, r0, m0, h, H, K, BT, BS, c0, ACT, G_MIN)
        q1, k1, G1, C1, Kd1, Ki1, kg1 = _sub_slice(q, k, g, A_log, dt_bias, r1, m1, h, H, K, BT, BS, c0, ACT, G_MIN)
        q2, k2, G2, C2, Kd2, Ki2, kg2 = _sub_slice(q, k, g, A_log, dt_bias, r2, m2, h, H, K, BT, BS, c0, ACT, G_MIN)
        q3, k3, G3, C3, Kd3, Ki3, kg3 = _sub_slice(q, k, g, A_log, dt_bias, r3, m3, h, H, K, BT, BS, c0, ACT, G_MIN)
        P0 += tl.dot(Kd0, tl.trans(Ki0), input_precision=PREC)
        P1 += tl.dot(Kd1, tl.trans(Ki1), input_precision=PREC)
        P2 += tl.dot(Kd2, tl.trans(Ki2), input_precision=PREC)
        P3 += tl.dot(Kd3, tl.trans(Ki3), input_precision=PREC)
        A0 += tl.dot(q0 * tl.exp(G0), tl.trans(Ki0), input_precision=PREC)
        A1 += tl.dot(q1 * tl.exp(G1), tl.trans(Ki1), input_precision=PREC)
        A2 += tl.dot(q2 * tl.exp(G2), tl.trans(Ki2), input_precision=PREC)
        A3 += tl.dot(q3 * tl.exp(G3), tl.trans(Ki3), input_precision=PREC)
        if ACT != 0:
            sq_q0 += tl.sum(q0 * q0, axis=1)
            sq_q1 += tl.sum(q1 * q1, axis=1)
            sq_q2 += tl.sum(q2 * q2, axis=1)
            sq_q3 += tl.sum(q3 * q3, axis=1)
            sq_k0 += tl.sum(k0 * k0, axis=1)
            sq_k1 += tl.sum(k1 * k1, axis=1)
            sq_k2 += tl.sum(k2 * k2, axis=1)
            sq_k3 += tl.sum(k3 * k3, axis=1)
    rq0, rq1, rq2, rq3 = inverse_norm(sq_q0, ACT), inverse_norm(sq_q1, ACT), inverse_norm(sq_q2, ACT), \
        inverse_norm(sq_q3, ACT)
    rk0, rk1, rk2, rk3 = inverse_norm(sq_k0, ACT), inverse_norm(sq_k1, ACT), inverse_norm(sq_k2, ACT), \
        inverse_norm(sq_k3, ACT)
    sq0, sq1, sq2, sq3 = scale * rq0, scale * rq1, scale * rq2, scale * rq3
    # the Aqk row blocks: the sub-chunk's own Aqk on the diagonal, zero above, E_nm^T products (pass b) below
    _store_rows(AQK, tl.where(i >= j, A0 * sq0[:, None] * rk0[None, :], 0.0), r0, m0, H, h, 4 * BT, BT, 0)
    _store_rows(AQK, tl.where(i >= j, A1 * sq1[:, None] * rk1[None, :], 0.0), r1, m1, H, h, 4 * BT, BT, BT)
    _store_rows(AQK, tl.where(i >= j, A2 * sq2[:, None] * rk2[None, :], 0.0), r2, m2, H, h, 4 * BT, BT, 2 * BT)
    _store_rows(AQK, tl.where(i >= j, A3 * sq3[:, None] * rk3[None, :], 0.0), r3, m3, H, h, 4 * BT, BT, 3 * BT)
    for blk in tl.static_range(1, 4):
        _store_rows(AQK, zero, r0, m0, H, h, 4 * BT, BT, blk * BT)
    _store_rows(AQK, zero, r1, m1, H, h, 4 * BT, BT, 2 * BT)
    _store_rows(AQK, zero, r1, m1, H, h, 4 * BT, BT, 3 * BT)
    _store_rows(AQK, zero, r2, m2, H, h, 4 * BT, BT, 3 * BT)
    T0 = t_times_beta(P0 * rk0[:, None] * rk0[None, :], b0, i, j, INV_PREC)  # T Diag(beta) per sub-chunk
    T1 = t_times_beta(P1 * rk1[:, None] * rk1[None, :], b1, i, j, INV_PREC)
    T2 = t_times_beta(P2 * rk2[:, None] * rk2[None, :], b2, i, j, INV_PREC)
    T3 = t_times_beta(P3 * rk3[:, None] * rk3[None, :], b3, i, j, INV_PREC)
    # (b) Qd_n E_nm^T, the Aqk blocks below the diagonal; (c) Kd_n E_nm^T, for C below
    Y10, Y20, Y21, Y30, Y31, Y32 = zero, zero, zero, zero, zero, zero
    for c0 in range(0, K, BS):
        q0, k0, G0, C0, Kd0, Ki0, kg0 = _sub_slice(q, k, g, A_log, dt_bias, r0, m0, h, H, K, BT, BS, c0, ACT, G_MIN)
        q1, k1, G1, C1, Kd1, Ki1, kg1 = _sub_slice(q, k, g, A_log, dt_bias, r1, m1, h, H, K, BT, BS, c0, ACT, G_MIN)
        q2, k2, G2, C2, Kd2, Ki2, kg2 = _sub_slice(q, k, g, A_log, dt_bias, r2, m2, h, H, K, BT, BS, c0, ACT, G_MIN)
        q3, k3, G3, C3, Kd3, Ki3, kg3 = _sub_slice(q, k, g, A_log, dt_bias, r3, m3, h, H, K, BT, BS, c0, ACT, G_MIN)
        Qd1, Qd2, Qd3 = q1 * tl.exp(G1), q2 * tl.exp(G2), q3 * tl.exp(G3)
        E20, E30, E31 = _cross_decays(kg0, kg1, C1, C2)
        Y10 += tl.dot(Qd1, tl.trans(kg0), input_precision=PREC)
        Y20 += tl.dot(Qd2, E20, input_precision=PREC)
        Y21 += tl.dot(Qd2, tl.trans(kg1), input_precision=PREC)
        Y30 += tl.dot(Qd3, E30, input_precision=PREC)
        Y31 += tl.dot(Qd3, E31, input_precision=PREC)
        Y32 += tl.dot(Qd3, tl.trans(kg2), input_precision=PREC)
    _store_rows(AQK, Y10 * sq1[:, None] * rk0[None, :], r1, m1, H, h, 4 * BT, BT, 0)
    _store_rows(AQK, Y20 * sq2[:, None] * rk0[None, :], r2, m2, H, h, 4 * BT, BT, 0)
    _store_rows(AQK, Y21 * sq2[:, None] * rk1[None, :], r2, m2, H, h, 4 * BT, BT, BT)
    _store_rows(AQK, Y30 * sq3[:, None] * rk0[None, :], r3, m3, H, h, 4 * BT, BT, 0)
    _store_rows(AQK, Y31 * sq3[:, None] * rk1[None, :], r3, m3, H, h, 4 * BT, BT, BT)
    _store_rows(AQK, Y32 * sq3[:, None] * rk2[None, :], r3, m3, H, h, 4 * BT, BT, 2 * BT)
    Z10, Z20, Z21, Z30, Z31, Z32 = zero, zero, zero, zero, zero, zero
    for c0 in range(0, K, BS):
        q0, k0, G0, C0, Kd0, Ki0, kg0 = _sub_slice(q, k, g, A_log, dt_bias, r0, m0, h, H, K, BT, BS, c0, ACT, G_MIN)
        q1, k1, G1, C1, Kd1, Ki1, kg1 = _sub_slice(q, k, g, A_log, dt_bias, r1, m1, h, H, K, BT, BS, c0, ACT, G_MIN)
        q2, k2, G2, C2, Kd2, Ki2, kg2 = _sub_slice(q, k, g, A_log, dt_bias, r2, m2, h, H, K, BT, BS, c0, ACT, G_MIN)
        q3, k3, G3, C3, Kd3, Ki3, kg3 = _sub_slice(q, k, g, A_log, dt_bias, r3, m3, h, H, K, BT, BS, c0, ACT, G_MIN)
        E20, E30, E31 = _cross_decays(kg0, kg1, C1, C2)
        Z10 += tl.dot(Kd1, tl.trans(kg0), input_precision=PREC)
        Z20 += tl.dot(Kd2, E20, input_precision=PREC)
        Z21 += tl.dot(Kd2, tl.trans(kg1), input_precision=PREC)
        Z30 += tl.dot(Kd3, E30, input_precision=PREC)
        Z31 += tl.dot(Kd3, E31, input_precision=PREC)
        Z32 += tl.dot(Kd3, tl.trans(kg2), input_precision=PREC)
    # C = Tb_n Z_nm, R = (I + C)^-1 by block substitution, F_nm = R_nm Tb_m
    C10 = tl.dot(T1, Z10 * rk1[:, None] * rk0[None, :], input_precision=INV_PREC)
    C20 = tl.dot(T2, Z20 * rk2[:, None] * rk0[None, :], input_precision=INV_PREC)
    C21 = tl.dot(T2, Z21 * rk2[:, None] * rk1[None, :], input_precision=INV_PREC)
    C30 = tl.dot(T3, Z30 * rk3[:, None] * rk0[None, :], input_precision=INV_PREC)
    C31 = tl.dot(T3, Z31 * rk3[:, None] * rk1[None, :], input_precision=INV_PREC)
    C32 = tl.dot(T3, Z32 * rk3[:, None] * rk2[None, :], input_precision=INV_PREC)
    R10 = -C10
    R21 = -C21
    R20 = -(C20 + tl.dot(C21, R10, input_precision=INV_PREC))
    R32 = -C32
    R31 = -(C31 + tl.dot(C32, R21, input_precision=INV_PREC))
    R30 = -(C30 + tl.dot(C31, R10, input_precision=INV_PREC) + tl.dot(C32, R20, input_precision=INV_PREC))
    F10 = tl.dot(R10, T0, input_precision=INV_PREC)
    F20 = tl.dot(R20, T0, input_precision=INV_PREC)
    F21 = tl.dot(R21, T1, input_precision=INV_PREC)
    F30 = tl.dot(R30, T0, input_precision=INV_PREC)
    F31 = tl.dot(R31, T1, input_precision=INV_PREC)
    F32 = tl.dot(R32, T2, input_precision=INV_PREC)
    # pass 2: the terms anchored at the chunk's start (G64 = sub-chunk G + the gates of the sub-chunks before);
    # W in its own loop, which needs the F tiles but not q
    for c0 in range(0, K, BS):
        q0, k0, G0, C0, _, _, _ = _sub_slice(q, k, g, A_log, dt_bias, r0, m0, h, H, K, BT, BS, c0, ACT, G_MIN)
        q1, k1, G1, C1, _, _, _ = _sub_slice(q, k, g, A_log, dt_bias, r1, m1, h, H, K, BT, BS, c0, ACT, G_MIN)
        q2, k2, G2, C2, _, _, _ = _sub_slice(q, k, g, A_log, dt_bias, r2, m2, h, H, K, BT, BS, c0, ACT, G_MIN)
        q3, k3, G3, C3, _, _, _ = _sub_slice(q, k, g, A_log, dt_bias, r3, m3, h, H, K, BT, BS, c0, ACT, G_MIN)
        Kd0 = k0 * rk0[:, None] * tl.exp(G0)
        Kd1 = k1 * rk1[:, None] * tl.exp(G1 + C0[None, :])
        Kd2 = k2 * rk2[:, None] * tl.exp(G2 + (C0 + C1)[None, :])
        Kd3 = k3 * rk3[:, None] * tl.exp(G3 + (C0 + C1 + C2)[None, :])
        _store_rows(W, tl.dot(T0, Kd0, input_precision=PREC), r0, m0, H, h, K, BS, c0)
        _store_rows(W, tl.dot(F10, Kd0, input_precision=PREC) + tl.dot(T1, Kd1, input_precision=PREC),
                    r1, m1, H, h, K, BS, c0)
        _store_rows(W, tl.dot(F20, Kd0, input_precision=PREC) + tl.dot(F21, Kd1, input_precision=PREC)
                    + tl.dot(T2, Kd2, input_precision=PREC), r2, m2, H, h, K, BS, c0)
        _store_rows(W, tl.dot(F30, Kd0, input_precision=PREC) + tl.dot(F31, Kd1, input_precision=PREC)
                    + tl.dot(F32, Kd2, input_precision=PREC) + tl.dot(T3, Kd3, input_precision=PREC),
                    r3, m3, H, h, K, BS, c0)
    for c0 in range(0, K, BS):
        q0, k0, G0, C0, _, _, _ = _sub_slice(q, k, g, A_log, dt_bias, r0, m0, h, H, K, BT, BS, c0, ACT, G_MIN)
        q1, k1, G1, C1, _, _, _ = _sub_slice(q, k, g, A_log, dt_bias, r1, m1, h, H, K, BT, BS, c0, ACT, G_MIN)
        q2, k2, G2, C2, _, _, _ = _sub_slice(q, k, g, A_log, dt_bias, r2, m2, h, H, K, BT, BS, c0, ACT, G_MIN)
        q3, k3, G3, C3, _, _, _ = _sub_slice(q, k, g, A_log, dt_bias, r3, m3, h, H, K, BT, BS, c0, ACT, G_MIN)
        G1 += C0[None, :]
        G2 += (C0 + C1)[None, :]
        G3 += (C0 + C1 + C2)[None, :]
        GC = C0 + C1 + C2 + C3
        _store_rows(QG, q0 * sq0[:, None] * tl.exp(G0), r0, m0, H, h, K, BS, c0)
        _store_rows(QG, q1 * sq1[:, None] * tl.exp(G1), r1, m1, H, h, K, BS, c0)
        _store_rows(QG, q2 * sq2[:, None] * tl.exp(G2), r2, m2, H, h, K, BS, c0)
        _store_rows(QG, q3 * sq3[:, None] * tl.exp(G3), r3, m3, H, h, K, BS, c0)
        _store_rows(KG, k0 * rk0[:, None] * tl.exp(GC[None, :] - G0), r0, m0, H, h, K, BS, c0)
        _store_rows(KG, k1 * rk1[:, None] * tl.exp(GC[None, :] - G1), r1, m1, H, h, K, BS, c0)
        _store_rows(KG, k2 * rk2[:, None] * tl.exp(GC[None, :] - G2), r2, m2, H, h, K, BS, c0)
        _store_rows(KG, k3 * rk3[:, None] * tl.exp(GC[None, :] - G3), r3, m3, H, h, K, BS, c0)
        cols = c0 + tl.arange(0, BS)
        tl.store(GCX + (c * H + h) * K + cols, tl.exp(GC), mask=cols < K)
    for c0 in range(0, V, BS):
        v0 = _load_rows(v, r0, m0, H, h, V, BS, c0)
        v1 = _load_rows(v, r1, m1, H, h, V, BS, c0)
        v2 = _load_rows(v, r2, m2, H, h, V, BS, c0)
        v3 = _load_rows(v, r3, m3, H, h, V, BS, c0)
        _store_rows(U, tl.dot(T0, v0, input_precision=PREC), r0, m0, H, h, V, BS, c0)
        _store_rows(U, tl.dot(F10, v0, input_precision=PREC) + tl.dot(T1, v1, input_precision=PREC),
                    r1, m1, H, h, V, BS, c0)
        _store_rows(U, tl.dot(F20, v0, input_precision=PREC) + tl.dot(F21, v1, input_precision=PREC)
                    + tl.dot(T2, v2, input_precision=PREC), r2, m2, H, h, V, BS, c0)
        _store_rows(U, tl.dot(F30, v0, input_precision=PREC) + tl.dot(F31, v1, input_precision=PREC)
                    + tl.dot(F32, v2, input_precision=PREC) + tl.dot(T3, v3, input_precision=PREC),
                    r3, m3, H, h, V, BS, c0)


def merged_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, lay: ChunkLayout,
                   act: FusedActivation | None = None):
    """Flat [T,H,*] forward on 64-token chunks (`lay` built with chunk=MERGED). Returns o (v's dtype) and the
    final state (fp32 or None). With `act`, g and beta are logits and q, k are not yet normalised."""
    H, K, V = q.shape[1], q.shape[2], v.shape[-1]
    terms = chunk_terms(q, v, lay.n_chunks, chunk=MERGED)
    W, U, QG, KG, AQK, GC = terms
    if lay.n_chunks:
        _merged_prepare_kernel[(lay.n_chunks * H,)](
            q, k, v, g, beta, sched=lay.fwd_schedule, W=W, U=U, QG=QG, KG=KG, AQK=AQK, GCX=GC, scale=scale,
            H=H, K=K, V=V, BT=CHUNK, BS=min(16, slice_width(K, V)), PREC=precision(q.dtype),
            INV_PREC=inverse_precision(q.dtype), num_warps=WARPS["merged"], **activation_args(act, q))
    o, ht, _ = state_pass(terms, v, q.dtype, initial_state, output_final_state, lay, False, WARPS["merged_state"])
    return o, ht
