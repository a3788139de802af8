"""Chunked KDA forward: a token-parallel prepare kernel and a per-(sequence, head) state pass (SPEC-K3 §2).

Per chunk of BT = 16 tokens, G = within-chunk cumsum of g (per channel, anchored at the chunk start), and
Kd = K e^G, Ki = K e^-G, Qd = scale Q e^G (Gamma ⊙ K, K / Gamma, Gamma ⊙ Q in the SPEC's notation):

    prepare (one program per chunk and head, independent of the state):
        A   = StrictTril(Diag(beta) Kd Ki^T),  T = (I + A)^-1       (a Neumann product, unit_lower_inverse)
        W   = T Diag(beta) Kd,  U = T Diag(beta) V,  Aqk = Tril(Qd Ki^T),  kg = K e^(G_C - G),  gc = e^G_C
    state pass (one program per sequence, head and block of V columns; columns of S evolve independently):
        pv = U - W S,   O = Qd S + Aqk pv,   S <- Diag(gc) S + kg^T pv
A pass for the final states alone (`chunk_kda_final_state`, KCP's transition) drops the q side: no Aqk, Qd in
the prepare kernel, no O in the state pass.

The pair products Kd Ki^T and Qd Ki^T carry e^(G_i - G_j), i > j, split into two factors, in one of two gate
modes (constexpr HIER, chosen by `gate_mode` from the floor the caller declares for g):
  bounded (a floor >= BOUNDED_GATE_MIN, K3's g >= -5): one anchor at the chunk start, Kd = K e^G and
    Ki = K e^-G; e^-G spans at most 15 gates (e^82.5), within fp32 range. One product per pair matrix.
  any gate (no floor, Kimi Linear's softplus gate): block-local anchors on four levels. At level s (8, 4, 2, 1)
    the pairs with i in an odd block of s tokens and j in the block before it get K_i e^(sum of g over i's
    block up to i) and K_j e^(sum of g over j's block after j): both exponents <= 0 whatever the gates, and
    together exactly G_i - G_j. Four products per pair matrix. Per-token g is clamped at UNBOUNDED_FLOOR,
    below which e^g is 0 in fp32 anyway, so block sums stay finite.
Aqk's diagonal q_i . k_i has no decay and is summed directly. Every other exponent (e^G, e^(G_C - G)) is <= 0.
Anchors are never later than the rows they serve, so outputs are causal to the bit.

With a `FusedActivation` the kernels read the raw projections and gate logits instead and apply the
activations on the fly (activations.py has the formulas): g from f, beta = sigmoid(b), and the L2 norms of the
q and k rows, which span every channel slice. Slice by slice only raw q, k are at hand, so the products over
K are accumulated raw and rescaled once the row norms are known: Diag(rk) P Diag(rk), Diag(rq) Aqk Diag(rk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.activations import gate_activation
from openk3.ops.kda.triton.layout import CHUNK, ChunkLayout

# warps per kernel, measured on an H200
WARPS = {"prepare": 2, "state": 4, "state_bwd": 4, "intra_bwd": 4}
# registers per thread for the prepare kernel (127 uncapped): 10 programs per SM instead of 8, the same bits, 4%
# faster on pre-activated and 14% on raw inputs on an H200; 80 and 64 were slower (bench/NOTES-kda.md run 18)
PREPARE_MAX_REGISTERS = 96
# the intra backward without software pipelining (its channel loop's loads were staged ahead) and at 128 registers
# a thread (254 uncapped, 2 programs per SM): 1.78 -> 1.38 ms at B8 T4096 H8 with fused activations on an H200
# (bench/NOTES-kda.md run 26); 168 registers 1.40, 200 1.88; two stages 1.51-1.79; 8 warps 2.2-3.2
INTRA_BWD_LAUNCH = {"num_stages": 1, "maxnreg": 128}
# the bounded mode's one anchor keeps e^-G of 15 gates inside fp32 (e^88.7) for per-token g >= this
BOUNDED_GATE_MIN = -5.5
# e^-110 underflows to 0 in fp32: clamping g there is invisible to fp32 arithmetic and keeps block sums finite
UNBOUNDED_FLOOR = -110.0


@triton.jit
def _load_rows(ptr, rows, row_mask, H, h, D: tl.constexpr, BD: tl.constexpr, c0=0):
    """x[rows, h, c0:c0+BD] of a [T,H,D] tensor as fp32 [BT, BD], zero outside."""
    cols = c0 + tl.arange(0, BD)
    offs = (rows[:, None] * H + h) * D + cols[None, :]
    return tl.load(ptr + offs, mask=row_mask[:, None] & (cols[None, :] < D), other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, x, rows, row_mask, H, h, D: tl.constexpr, BD: tl.constexpr, c0=0):
    cols = c0 + tl.arange(0, BD)
    offs = (rows[:, None] * H + h) * D + cols[None, :]
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=row_mask[:, None] & (cols[None, :] < D))


@triton.jit
def unit_lower_inverse(A, i, j, PREC: tl.constexpr):
    """(I + A)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8) for a strictly lower 16 x 16 A (A^16 = 0)."""
    eye = tl.where(i == j, 1.0, 0.0)
    Tm = eye - A
    Ap = A
    for _ in tl.static_range(3):
        Ap = tl.dot(Ap, Ap, input_precision=PREC)
        Tm = tl.dot(Tm, eye + Ap, input_precision=PREC)
    return Tm


@triton.jit
def wy_inverse(P, b, i, j, PREC: tl.constexpr):
    """T = (I + A)^-1 of a 16-token chunk, A = StrictTril(Diag(beta) P), from P = Kd Ki^T (rescaled already)."""
    return unit_lower_inverse(tl.where(i > j, P * b[:, None], 0.0), i, j, PREC)


@triton.jit
def load_slice(q, k, g, A_log, dt_bias, rows, rmask, h, H, K: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
               c0, ACT: tl.constexpr, G_MIN: tl.constexpr, G_FLOOR: tl.constexpr, WITH_Q: tl.constexpr = True):
    """Channels c0:c0+BS of one chunk: q and k as stored (raw under ACT; without WITH_Q q is not read and k
    stands in for it), the gate g clamped at G_FLOOR (padded rows have g = 0), G = its cumsum, G_C (G at the
    chunk's end) and where the clamp acted (those gates get no gradient). Under ACT the gate is computed from its
    logits."""
    i = tl.arange(0, BT)[:, None]
    gg = _load_rows(g, rows, rmask, H, h, K, BS, c0)
    if ACT != 0:
        cols = c0 + tl.arange(0, BS)
        a = tl.exp(tl.load(A_log + h).to(tl.float32))
        bias = tl.load(dt_bias + h * K + cols, mask=cols < K, other=0.0).to(tl.float32)
        gate = gate_activation(gg, a, bias[None, :], G_MIN, ACT == 2)[0]
        gg = tl.where(rmask[:, None] & (cols[None, :] < K), gate, 0.0)
    clamped = gg < G_FLOOR
    gg = tl.where(clamped, G_FLOOR, gg)
    G = tl.cumsum(gg, axis=0)
    GC = tl.sum(tl.where(i == BT - 1, G, 0.0), axis=0)
    if WITH_Q:
        qq = _load_rows(q, rows, rmask, H, h, K, BS, c0)
    kk = _load_rows(k, rows, rmask, H, h, K, BS, c0)
    if not WITH_Q:
        qq = kk
    return qq, kk, gg, G, GC, clamped


@triton.jit
def pair_factors(gg, G, level: tl.constexpr, i, j, BT: tl.constexpr, BS: tl.constexpr, HIER: tl.constexpr):
    """(fi, fj, pairs): the pairs (i, j), i > j, taken at `level` get the decay e^(G_i - G_j) as fi[i] * fj[j],
    both factors <= 1 in HIER mode (the module docstring); levels 0..3 in HIER mode, level 0 only otherwise."""
    if HIER:
        s: tl.constexpr = BT >> (level + 1)  # block size: 8, 4, 2, 1 for BT = 16
        g3 = tl.reshape(gg, [BT // s, s, BS])
        upto = tl.cumsum(g3, axis=1)  # sum over the block up to and including the row
        after = tl.sum(g3, axis=1)[:, None, :] - upto  # sum over the rest of the block
        pairs = (i // s == j // s + 1) & ((i // s) % 2 == 1)
        return tl.exp(tl.reshape(upto, [BT, BS])), tl.exp(tl.reshape(after, [BT, BS])), pairs
    else:
        return tl.exp(G), tl.exp(-G), i > j


@triton.jit
def load_beta(beta, rows, rmask, h, H, ACT: tl.constexpr):
    """beta of the chunk's rows (sigmoid of the logits under ACT), 0 on padded rows."""
    b = tl.load(beta + rows * H + h, mask=rmask, other=0.0).to(tl.float32)
    if ACT != 0:
        b = tl.where(rmask, tl.sigmoid(b), 0.0)
    return b


@triton.jit
def inverse_norm(sum_sq, ACT: tl.constexpr):
    """1 / ||x|| of each row (as activations.py), or 1 without fused activations."""
    if ACT != 0:
        return 1.0 / tl.sqrt(sum_sq + 1e-6)
    return sum_sq * 0.0 + 1.0


@triton.jit
def pair_offsets(c, h, H, i, j, BT: tl.constexpr):
    """Where chunk c, head h's [BT, BT] P sits in `pair_terms`' PT (its T follows at + BT * BT)."""
    return (c * H + h).to(tl.int64) * 2 * BT * BT + i * BT + j


@triton.jit
def norm_offsets(rows, h, H):
    """Where the rows' inverse norm of q sits in `pair_terms`' RN (k's follows at + 1)."""
    return (rows * H + h) * 2


@triton.jit
def scheduled_chunk(sched, H):
    """This program's chunk and head: program i*H + h takes row i of the schedule (layout.py)."""
    pid = tl.program_id(0)
    s = pid // H
    c = tl.load(sched + 3 * s)
    t0 = tl.load(sched + 3 * s + 1).to(tl.int64)
    t1 = tl.load(sched + 3 * s + 2)
    return c, pid % H, t0, t1


@triton.jit
def pair_products(q, k, g, A_log, dt_bias, rows, rmask, h, H, scale, K: tl.constexpr, BT: tl.constexpr,
                  BS: tl.constexpr, PREC: tl.constexpr, ACT: tl.constexpr, G_MIN: tl.constexpr, G_FLOOR: tl.constexpr,
                  HIER: tl.constexpr, WITH_Q: tl.constexpr):
    """A chunk's first pass: the products over K, a slice at a time (a rolled loop: fewer registers, more programs
    per SM and 14% faster on an H200 than unrolling it to put every slice's loads in flight at once). Returns
    (P = Kd Ki^T, Aqk = Tril(Qd Ki^T) with its diagonal, both rescaled by the rows' norms, Aqk scaled; the rows'
    inverse norms rq, rk: 1 without ACT). Without WITH_Q, Aqk is zeros and q is not read."""
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    P = tl.zeros([BT, BT], dtype=tl.float32)
    Aqk = tl.zeros([BT, BT], dtype=tl.float32)
    qk = tl.zeros([BT], dtype=tl.float32)
    sq_q = tl.zeros([BT], dtype=tl.float32)
    sq_k = tl.zeros([BT], dtype=tl.float32)
    for c0 in range(0, K, BS):
        qq, kk, gg, G, GC, _ = load_slice(q, k, g, A_log, dt_bias, rows, rmask, h, H, K, BT, BS, c0, ACT, G_MIN,
                                          G_FLOOR, WITH_Q)
        for lv in tl.static_range(4 if HIER else 1):
            fi, fj, pairs = pair_factors(gg, G, lv, i, j, BT, BS, HIER)
            Ki = kk * fj
            P += tl.where(pairs, tl.dot(kk * fi, tl.trans(Ki), input_precision=PREC), 0.0)
            if WITH_Q:
                Aqk += tl.where(pairs, tl.dot(qq * fi, tl.trans(Ki), input_precision=PREC), 0.0)
        if WITH_Q:
            qk += tl.sum(qq * kk, axis=1)
        if ACT != 0:
            if WITH_Q:
                sq_q += tl.sum(qq * qq, axis=1)
            sq_k += tl.sum(kk * kk, axis=1)
    rq = inverse_norm(sq_q, ACT)
    rk = inverse_norm(sq_k, ACT)
    P = P * rk[:, None] * rk[None, :]
    Aqk = (Aqk + tl.where(i == j, qk[:, None], 0.0)) * (scale * rq)[:, None] * rk[None, :]
    return P, Aqk, rq, rk


@triton.jit
def _prepare_kernel(q, k, v, g, beta, A_log, dt_bias, sched, W, U, QG, KG, AQK, GCX, PT, RN, scale,
                    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                    BS: tl.constexpr, PREC: tl.constexpr,
                    ACT: tl.constexpr, G_MIN: tl.constexpr, G_FLOOR: tl.constexpr, HIER: tl.constexpr,
                    STORE_U: tl.constexpr, WITH_Q: tl.constexpr, STORE_PAIRS: tl.constexpr,
                    STORE_TERMS: tl.constexpr = True):
    """The state-independent terms of one chunk, BS channels at a time: everything is per channel except
    the two products over K (accumulated) and T, so slices keep the register tiles small. Without WITH_Q the
    q-side terms (Aqk, Qd: only the outputs need them) are neither computed nor stored, and q is not read. With
    STORE_PAIRS, P and T go to PT and the rows' inverse norms to RN (`pair_terms`: the backward's). Without
    STORE_TERMS the first pass alone runs (Aqk and the pairs: `prepare_pairs`)."""
    c, h, t0, t1 = scheduled_chunk(sched, H)
    rows = t0 + tl.arange(0, BT)
    rmask = rows < t1
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    b = load_beta(beta, rows, rmask, h, H, ACT)
    P, Aqk, rq, rk = pair_products(q, k, g, A_log, dt_bias, rows, rmask, h, H, scale, K, BT, BS, PREC, ACT, G_MIN,
                                   G_FLOOR, HIER, WITH_Q)
    if WITH_Q:
        _store_rows(AQK, Aqk, rows, rmask, H, h, BT, BT)
    Tm = wy_inverse(P, b, i, j, PREC)
    if STORE_PAIRS:
        pair = pair_offsets(c, h, H, i, j, BT)
        tl.store(PT + pair, P)
        tl.store(PT + pair + BT * BT, Tm)
        norm = norm_offsets(rows, h, H)
        tl.store(RN + norm, rq, mask=rmask)
        tl.store(RN + norm + 1, rk, mask=rmask)
    if STORE_TERMS:
        Tb = Tm * b[None, :]  # T Diag(beta)
        # pass 2 reloads each slice (cache hits) and writes its terms
        for c0 in range(0, K, BS):
            qq, kk, _, G, GC, _ = load_slice(q, k, g, A_log, dt_bias, rows, rmask, h, H, K, BT, BS, c0, ACT, G_MIN,
                                             G_FLOOR, WITH_Q)
            kk = kk * rk[:, None]
            eG = tl.exp(G)
            if WITH_Q:
                _store_rows(QG, qq * (scale * rq)[:, None] * eG, rows, rmask, H, h, K, BS, c0)
            _store_rows(KG, kk * tl.exp(GC[None, :] - G), rows, rmask, H, h, K, BS, c0)
            _store_rows(W, tl.dot(Tb, kk * eG, input_precision=PREC), rows, rmask, H, h, K, BS, c0)
            cols = c0 + tl.arange(0, BS)
            tl.store(GCX + (c * H + h) * K + cols, tl.exp(GC), mask=cols < K)
        if STORE_U:
            for c0 in range(0, V, BS):
                vv = _load_rows(v, rows, rmask, H, h, V, BS, c0)
                _store_rows(U, tl.dot(Tb, vv, input_precision=PREC), rows, rmask, H, h, V, BS, c0)


@triton.jit
def chain_start(state, cu, chunk_off, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                HAS_STATE: tl.constexpr):
    """Where the state chain of program (sequence n, head h, V block iv) lies, shared by the state passes: n, h,
    its first token, its end, its first chunk's index, the state's channel and column ranges, their mask and
    offsets, and the fp32 [BK, BV] block of `state` [N, H, K, V] it starts from (zeros without HAS_STATE)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    bos = tl.load(cu + n).to(tl.int64)
    eos = tl.load(cu + n + 1)
    c0 = tl.load(chunk_off + n).to(tl.int64)
    ck = tl.arange(0, BK)
    cv = iv * BV + tl.arange(0, BV)
    smask = (ck[:, None] < K) & (cv[None, :] < V)
    s_offs = ck[:, None] * V + cv[None, :]
    if HAS_STATE:
        S = tl.load(state + (n * H + h) * K * V + s_offs, mask=smask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    return n, h, bos, eos, c0, ck, cv, smask, s_offs, S


@triton.jit
def store_checkpoint(ckpt_slot, ckpt, c, n, h, N, H, K: tl.constexpr, V: tl.constexpr, S, s_offs, smask):
    """The fp32 state S before chunk c (after c * BT tokens) into its slot of ckpt, where chunk c has one
    (`chunk.checkpoint_slots`: -1 for none; ckpt_slot None: no checkpoints)."""
    if ckpt_slot is not None:
        slot = tl.load(ckpt_slot + c)
        if slot >= 0:
            tl.store(ckpt + ((slot * N + n) * H + h).to(tl.int64) * K * V + s_offs, S, mask=smask)


@triton.jit(do_not_specialize=["N"])  # one compile for every batch size (a serving engine meets them all)
def _state_fwd_kernel(W, U, QG, KG, AQK, GCX, h0, ht, pvs, ckpt_slot, ckpt, o, cu, chunk_off,
                      N, H, K: tl.constexpr, V: tl.constexpr, VU: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                      SAVE_PV: tl.constexpr, OUTPUT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """The chain of one (sequence, head, block of BV state columns). U has VU <= V columns, the state V: the
    columns past VU take zero values. Without OUTPUT only the state recurrence runs (QG, AQK and o unread). With
    SAVE_PV each chunk's pseudo-values U - W S go to pvs (from which the backward replays the states:
    chunk_bwd.replay_states)."""
    n, h, bos, eos, c0, ck, cv, smask, s_offs, S = chain_start(h0, cu, chunk_off, H, K, V, BK, BV, HAS_H0)
    n_chunks = tl.cdiv(eos - bos, BT)
    dt = DT
    tt = tl.arange(0, BT)
    for c in range(n_chunks):
        rows = bos + c * BT + tt
        rmask = rows < eos
        store_checkpoint(ckpt_slot, ckpt, c, n, h, N, H, K, V, S, s_offs, smask)
        xk = (rows[:, None] * H + h) * K + ck[None, :]
        mk = rmask[:, None] & (ck[None, :] < K)
        w = tl.load(W + xk, mask=mk, other=0.0).to(dt)
        if OUTPUT:
            qg = tl.load(QG + xk, mask=mk, other=0.0).to(dt)
        kg = tl.load(KG + xk, mask=mk, other=0.0).to(dt)
        xu = (rows[:, None] * H + h) * VU + cv[None, :]
        u = tl.load(U + xu, mask=rmask[:, None] & (cv[None, :] < VU), other=0.0).to(tl.float32)
        if OUTPUT:
            aqk = tl.load(AQK + (rows[:, None] * H + h) * BT + tt[None, :], mask=rmask[:, None], other=0.0).to(dt)
        gc = tl.load(GCX + ((c0 + c) * H + h) * K + ck, mask=ck < K, other=0.0).to(tl.float32)
        Sd = S.to(dt)
        pv = (u - tl.dot(w, Sd, input_precision=PREC)).to(dt)
        if SAVE_PV:
            tl.store(pvs + xu, pv.to(pvs.dtype.element_ty), mask=rmask[:, None] & (cv[None, :] < VU))
        if OUTPUT:
            out = tl.dot(qg, Sd, input_precision=PREC) + tl.dot(aqk, pv, input_precision=PREC)
            xv = (rows[:, None] * H + h) * V + cv[None, :]
            tl.store(o + xv, out.to(o.dtype.element_ty), mask=rmask[:, None] & (cv[None, :] < V))
        S = S * gc[:, None] + tl.dot(tl.trans(kg), pv, input_precision=PREC)
    if STORE_FINAL:
        tl.store(ht + (n * H + h) * K * V + s_offs, S, mask=smask)


def _pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def dot_dtype(dtype: torch.dtype, device: torch.device):
    """Dtype of the stored chunk terms and state-pass operands: the inputs' 16-bit type; fp32 for fp32 inputs
    and for CPU tensors, which the kernels see only under the Triton interpreter (whose 16-bit dot products are
    broken and whose casts truncate)."""
    if device.type == "cpu" or dtype == torch.float32:
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def slice_width(K: int, V: int) -> int:
    """Channels per slice in the token-parallel kernels: 32 keeps their register tiles small."""
    return min(32, _pow2(min(K, V)))


def precision(dtype: torch.dtype) -> str:
    """The fp32 intra-chunk products, the triangular inverse's included: fp32 for fp32 inputs, one tf32 pass for
    16-bit inputs (three tf32 passes gave the same errors in the GPU sweep, more slowly: bench/NOTES-kda.md run
    13)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def state_block(n_seqs: int, H: int, V: int) -> int:
    """Columns of V per state-pass program: narrow blocks when there are few (sequence, head) chains."""
    return min(_pow2(V), 32 if n_seqs * H * 2 < 264 else 64)


@dataclass(frozen=True)
class GateSpec:
    """How the chunk kernels read g: already activated, or as logits with the activation fused in (activations.py:
    K3's gate or Kimi Linear's, with q, k unnormalised and beta a logit); and the gate mode (the module
    docstring): the floor g is clamped at and whether block-local anchors are needed. Built by `gate_spec`."""

    floor: float
    hier: bool
    A_log: torch.Tensor | None = None  # [H]; set: fused activations
    dt_bias: torch.Tensor | None = None  # [H*K] contiguous
    kimi: bool = False
    g_min: float = 0.0  # K3 gate's bound (fused activations)

    @property
    def fused(self) -> bool:
        return self.A_log is not None

    def kernel_args(self, dummy: torch.Tensor) -> dict:
        act = (2 if self.kimi else 1) if self.fused else 0
        return dict(A_log=self.A_log if self.fused else dummy, dt_bias=self.dt_bias if self.fused else dummy,
                    ACT=act, G_MIN=self.g_min, G_FLOOR=self.floor, HIER=self.hier)


def gate_spec(floor: float | None, A_log=None, dt_bias=None, kimi: bool = False, g_min: float = 0.0) -> GateSpec:
    """The gate mode for a declared lower bound of g (None: none), with fused activations when A_log is given:
    K3's fused gate is bounded by g_min itself, Kimi Linear's by nothing. Bounds >= BOUNDED_GATE_MIN take the
    bounded mode (one anchor; g clamped at the bound); anything else the any-gate mode (clamped at
    max(bound, UNBOUNDED_FLOOR))."""
    if A_log is not None:
        floor = None if kimi else g_min
    hier = floor is None or floor < BOUNDED_GATE_MIN
    clamp = UNBOUNDED_FLOOR if floor is None else max(float(floor), UNBOUNDED_FLOOR) if hier else float(floor)
    return GateSpec(clamp, hier, A_log, dt_bias, kimi, float(g_min))


def term_dtype(q: torch.Tensor) -> torch.dtype:
    """The torch dtype of the stored chunk terms (`dot_dtype`)."""
    return {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}[
        dot_dtype(q.dtype, q.device)]


def chunk_terms(q, v, n_chunks: int, with_u=True, with_q=True):
    """Empty W, U, QG, KG, AQK, GC for the prepare kernel (U None without `with_u`, QG and AQK None without
    `with_q`); q sets their shape and precision (k stands in for it without `with_q`)."""
    T, H, K = q.shape
    dt = term_dtype(q)
    W, KG = (torch.empty(T, H, K, dtype=dt, device=q.device) for _ in range(2))
    QG = torch.empty(T, H, K, dtype=dt, device=q.device) if with_q else None
    U = torch.empty(T, H, v.shape[-1], dtype=dt, device=q.device) if with_u else None
    AQK = torch.empty(T, H, CHUNK, dtype=dt, device=q.device) if with_q else None
    GC = torch.empty(max(n_chunks, 1), H, K, dtype=torch.float32, device=q.device)
    return W, U, QG, KG, AQK, GC


def pair_terms(q, n_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty buffers for what the prepare kernel hands the backward beside the chunk terms (`prepare`'s
    `pairs`): PT [n_chunks, H, 2, BT, BT] fp32, each chunk's P = Kd Ki^T (rescaled, strictly lower) and T =
    (I + A)^-1, and RN [T, H, 2] fp32, the inverse norms of q's and k's rows (1 without fused activations). The
    intra backward reads them instead of forming P over K and inverting again: 136 bytes a token and head."""
    T, H, _ = q.shape
    return (torch.empty(max(n_chunks, 1), H, 2, CHUNK, CHUNK, dtype=torch.float32, device=q.device),
            torch.empty(T, H, 2, dtype=torch.float32, device=q.device))


def prepare(q, k, v, g, beta, scale: float, lay: ChunkLayout, gate: GateSpec, with_u=True, with_q=True,
            pairs: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The prepare kernel on flat [T,H,*] inputs; returns (W, U, QG, KG, AQK, GC), U None without `with_u`, QG
    and AQK None without `with_q` (q then unread: pass k). `pairs` (`pair_terms`' buffers) are filled too when
    given."""
    terms = chunk_terms(q, v, lay.n_chunks, with_u, with_q)
    T, H, K = q.shape
    V = v.shape[-1]
    W, U, QG, KG, AQK, GC = terms
    PT, RN = pairs if pairs is not None else (GC, GC)
    if lay.n_chunks:
        _prepare_kernel[(lay.n_chunks * H,)](
            q, k, v, g, beta, sched=lay.schedule, W=W, U=W if U is None else U, QG=W if QG is None else QG,
            KG=KG, AQK=W if AQK is None else AQK, GCX=GC, PT=PT, RN=RN, scale=scale, H=H, K=K, V=V, BT=CHUNK,
            BS=slice_width(K, V), PREC=precision(q.dtype), STORE_U=U is not None, WITH_Q=QG is not None,
            STORE_PAIRS=pairs is not None, num_warps=WARPS["prepare"], maxnreg=PREPARE_MAX_REGISTERS,
            **gate.kernel_args(q))
    return terms


def prepare_pairs(q, k, g, beta, scale: float, lay: ChunkLayout, gate: GateSpec):
    """The prepare kernel's first pass alone, on flat [T,H,*] inputs: Aqk [T,H,BT] (the terms' dtype) and
    `pair_terms`' PT (P and T = (I + A)^-1 a chunk and head) and RN (the rows' inverse norms), the small terms
    from which the one-pass chain forms the rest in registers (`one_pass.kda_one_pass_fwd(pair_kernel=True)`)."""
    T, H, K = q.shape
    AQK = torch.empty(T, H, CHUNK, dtype=term_dtype(q), device=q.device)
    PT, RN = pair_terms(q, lay.n_chunks)
    if lay.n_chunks:
        _prepare_kernel[(lay.n_chunks * H,)](
            q, k, q, g, beta, sched=lay.schedule, W=AQK, U=AQK, QG=AQK, KG=AQK, AQK=AQK, GCX=PT, PT=PT, RN=RN,
            scale=scale, H=H, K=K, V=K, BT=CHUNK, BS=slice_width(K, K), PREC=precision(q.dtype), STORE_U=False,
            WITH_Q=True, STORE_PAIRS=True, STORE_TERMS=False, num_warps=WARPS["prepare"],
            maxnreg=PREPARE_MAX_REGISTERS, **gate.kernel_args(q))
    return AQK, PT, RN


def state_pass(terms, v, dtype, initial_state, output_final_state, lay: ChunkLayout, save_pv,
               checkpoints: tuple[torch.Tensor, int] | None = None, with_output=True):
    """The forward state pass over a prepare kernel's `terms` (`dtype`: q's, which set the terms' precision).
    Returns o (v's dtype), the final state (fp32 or None), with `save_pv` the pseudo-values U - W S [T, H, VU]
    in the terms' dtype, what the backward replays the states from (else None), and, with `checkpoints` = (slot
    per chunk of a sequence, int32, -1 for none; number of slots), the fp32 states before the chunks that have a
    slot, [slots, N, H, K, V] (or None). Without `with_output` (terms without QG and AQK will do) o is None and
    only the state recurrence runs; the state may then be wider than v (initial_state [N, H, K, V'], V' > V):
    its columns past V take zero values."""
    W, U, QG, KG, AQK, GC = terms
    T, H, K = W.shape
    VU = v.shape[-1]
    V = VU if initial_state is None else initial_state.shape[-1]
    if V != VU and with_output:
        raise ValueError(f"a state wider than v ({V} > {VU} columns) takes no output: pass with_output=False")
    N = lay.n_seqs
    o = torch.empty(T, H, V, dtype=v.dtype, device=v.device) if with_output else None
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=v.device) if output_final_state else None
    pvs = torch.empty(T, H, VU, dtype=W.dtype, device=v.device) if save_pv else None
    slots, ckpt = None, None
    if checkpoints is not None:
        slots, n_slots = checkpoints
        ckpt = torch.empty(n_slots, N, H, K, V, dtype=torch.float32, device=v.device)
    BV = state_block(N, H, V)
    _state_fwd_kernel[(N, H, triton.cdiv(V, BV))](
        W, U, W if QG is None else QG, KG, W if AQK is None else AQK, GC, initial_state, ht, pvs, slots, ckpt,
        W if o is None else o, lay.cu_seqlens, lay.chunk_offsets, N=N, H=H, K=K, V=V, VU=VU, BT=CHUNK, BK=_pow2(K),
        BV=BV, HAS_H0=initial_state is not None, STORE_FINAL=output_final_state, SAVE_PV=save_pv,
        OUTPUT=with_output, PREC=precision(dtype), DT=dot_dtype(dtype, v.device), num_warps=WARPS["state"])
    return o, ht, pvs, ckpt


def chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, lay: ChunkLayout, save_states,
                  gate: GateSpec, checkpoints: tuple[torch.Tensor, int] | None = None):
    """Flat [T,H,*] forward: the prepare kernel, then the state pass. Returns o (v's dtype), final state (fp32 or
    None), with `save_states` what the backward reads (h0, pvs, W, QG, KG, AQK, GC, PT, RN: the initial state
    or None, the pseudo-values, the chunk terms but U and the pair terms, `pair_terms`; the per-chunk states are
    replayed from h0, pvs, KG and GC in the backward, chunk_bwd.replay_states; else None) and the checkpoint
    states (`state_pass`). With fused activations in `gate`, g and beta are the gate and beta logits and q, k
    are not yet normalised. `initial_state` may also be a function of the chunk terms that returns it (or None),
    called between the two kernels (a state exchange: exchange.py)."""
    pairs = pair_terms(q, lay.n_chunks) if save_states else None
    terms = prepare(q, k, v, g, beta, scale, lay, gate, pairs=pairs)
    if callable(initial_state):
        initial_state = initial_state(terms)
    o, ht, pvs, ckpt = state_pass(terms, v, q.dtype, initial_state, output_final_state, lay, save_states,
                                  checkpoints)
    saved = None
    if save_states:  # the backward's reverse pass reads the chunk terms but U, its intra pass the pairs
        W, _, QG, KG, AQK, GC = terms
        saved = (initial_state, pvs, W, QG, KG, AQK, GC, *pairs)
    return o, ht, saved, ckpt


def chunk_kda_final_state(k, v, g, beta, initial_state, lay: ChunkLayout, gate: GateSpec):
    """Flat [T,H,*] final states alone, fp32 [N,H,K,V'] (V' = initial_state's width, >= V; the columns past V
    take zero values): the prepare kernel without the q-side terms, then the state pass without outputs."""
    terms = prepare(k, k, v, g, beta, 1.0, lay, gate, with_q=False)  # q and the scale feed only QG and AQK
    return state_pass(terms, v, k.dtype, initial_state, True, lay, False, with_output=False)[1]
