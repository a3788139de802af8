"""A one-pass chunked KDA forward without autograd: each (sequence, head, V block) program forms its chunks' terms
itself and carries the state, so no chunk term goes through memory (SPEC-K3 §2; chunk_fwd.py has the algebra).

The two-kernel forward (chunk_fwd.py) writes W, U, Qd, kg, Aqk and gc for every chunk and head, then reads them
back in the state pass: about 4 K + V + 16 values a token and head each way beside the inputs. Where there are
many (sequence, head) chains (batched prefill, 64-96 heads) the passes are bound by that traffic and by the prepare
kernel's latency per chunk; where there are few the prepare kernel's parallelism over chunks is what keeps the GPU
busy. This form computes, per chunk, in registers:

    A = StrictTril(Diag(beta) Kd Ki^T),  T = (I + A)^-1,  pv = T Diag(beta) (V - Kd S)     (= U - W S)
    O = Qd S + Aqk pv,  S <- Diag(gc) S + kg^T pv

the state-pass recurrence with U - W S formed from the chunk's inputs (one product with S over K, then the
[BT, BT] one with T Diag(beta)). Every V block of a chain repeats the chunk's intra terms (they depend on q, k, g,
beta only). With `pair_kernel=True` the prepare kernel's first pass runs before, token-parallel
(`chunk_fwd.prepare_pairs`: T, Aqk and the row norms, 0.6 KB a chunk and head through memory), and the chains
form only the decayed q, k and the state step. Same gate modes, fused activations, initial and final states,
checkpoints and varlen layout as the two-kernel forward; it saves nothing for a backward. Not yet the path
`kda_triton` takes: which shapes each mode wins is for `bench/kda.py --stages` to measure on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.kda.triton.chunk_fwd import (
    GateSpec,
    _pow2,
    chain_start,
    dot_dtype,
    load_beta,
    load_slice,
    norm_offsets,
    pair_offsets,
    pair_products,
    precision,
    prepare_pairs,
    slice_width,
    state_block,
    store_checkpoint,
    wy_inverse,
)
from openk3.ops.kda.triton.layout import CHUNK, ChunkLayout

# warps per program: at 8, with one pipeline stage, both gate modes compile for sm_90 without spills at 32 and 64
# columns of V (225-252 registers a thread, fused activations, triton 3.9); at 4 the any-gate mode spills
ONE_PASS_WARPS = 8


@triton.jit(do_not_specialize=["N"])
def _one_pass_kernel(q, k, v, g, beta, A_log, dt_bias, h0, ht, ckpt_slot, ckpt, o, cu, chunk_off, AQK, PT, RN,
                     scale, N, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     BS: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                     PREC: tl.constexpr, DT: tl.constexpr, ACT: tl.constexpr, G_MIN: tl.constexpr,
                     G_FLOOR: tl.constexpr, HIER: tl.constexpr, PAIRS_GIVEN: tl.constexpr):
    """The chain of one (sequence, head, block of BV columns of V and S): per chunk the prepare kernel's two passes
    over the channels (the pair products BS channels at a time, then the decayed q and k over all BK >= K), then
    the state pass's step. With PAIRS_GIVEN the first pass is `prepare_pairs`' (T, Aqk and the row norms read
    from AQK, PT, RN)."""
    n, h, bos, eos, first, ck, cv, smask, s_offs, S = chain_start(h0, cu, chunk_off, H, K, V, BK, BV, HAS_H0)
    n_chunks = tl.cdiv(eos - bos, BT)
    dt = DT
    tt = tl.arange(0, BT)
    i = tt[:, None]
    j = tt[None, :]
    for c in range(n_chunks):
        rows = bos + c * BT + tt
        rmask = rows < eos
        store_checkpoint(ckpt_slot, ckpt, c, n, h, N, H, K, V, S, s_offs, smask)
        b = load_beta(beta, rows, rmask, h, H, ACT)
        if PAIRS_GIVEN:
            Tb = tl.load(PT + pair_offsets(first + c, h, H, i, j, BT) + BT * BT) * b[None, :]  # T Diag(beta)
            Aqk = tl.load(AQK + (rows[:, None] * H + h) * BT + j, mask=rmask[:, None], other=0.0).to(dt)
            norm = norm_offsets(rows, h, H)
            rq = tl.load(RN + norm, mask=rmask, other=1.0)
            rk = tl.load(RN + norm + 1, mask=rmask, other=1.0)
        else:  # the prepare kernel's first pass (small fp32 slices of the channels)
            P, Aqk, rq, rk = pair_products(q, k, g, A_log, dt_bias, rows, rmask, h, H, scale, K, BT, BS, PREC, ACT,
                                           G_MIN, G_FLOOR, HIER, True)
            Aqk = Aqk.to(dt)
            Tb = wy_inverse(P, b, i, j, PREC) * b[None, :]  # T Diag(beta)
        # pass 2: the chunk's decayed q and k over all channels (cache hits), in the operands' dtype
        qq, kk, _, G, GC, _ = load_slice(q, k, g, A_log, dt_bias, rows, rmask, h, H, K, BT, BK, 0, ACT, G_MIN,
                                         G_FLOOR)
        eG = tl.exp(G)
        kk = kk * rk[:, None]
        qd = (qq * (scale * rq)[:, None] * eG).to(dt)
        kd = (kk * eG).to(dt)
        kg = (kk * tl.exp(GC[None, :] - G)).to(dt)
        xv = (rows[:, None] * H + h) * V + cv[None, :]
        vmask = rmask[:, None] & (cv[None, :] < V)
        vv = tl.load(v + xv, mask=vmask, other=0.0).to(tl.float32)
        Sd = S.to(dt)
        pv = tl.dot(Tb, vv - tl.dot(kd, Sd, input_precision=PREC), input_precision=PREC).to(dt)
        out = tl.dot(qd, Sd, input_precision=PREC) + tl.dot(Aqk, pv, input_precision=PREC)
        tl.store(o + xv, out.to(o.dtype.element_ty), mask=vmask)
        S = S * tl.exp(GC)[:, None] + tl.dot(tl.trans(kg), pv, input_precision=PREC)
    if STORE_FINAL:
        tl.store(ht + (n * H + h) * K * V + s_offs, S, mask=smask)


def kda_one_pass_fwd(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, lay: ChunkLayout,
                     gate: GateSpec, checkpoints: tuple[torch.Tensor, int] | None = None, pair_kernel: bool = False,
                     block_v: int | None = None, num_warps: int | None = None):
    """Flat [T,H,*] forward in one kernel, as `chunk_fwd.chunk_kda_fwd` without saving for backward: returns o
    (v's dtype), the final state (fp32 [N,H,K,V] or None) and, with `checkpoints` = (slot per chunk, number of
    slots), the fp32 states before the chunks that have a slot ([slots, N, H, K, V], else None). With
    `pair_kernel` the chunks' first pass runs before, token-parallel (`chunk_fwd.prepare_pairs`: T, Aqk and the
    row norms through memory, 0.6 KB a chunk and head), and the chains read it instead of forming it. `block_v`
    (default: the state pass's, `chunk_fwd.state_block`) and `num_warps` (default ONE_PASS_WARPS) set the
    launch (for a benchmark's sweep)."""
    T, H, K = q.shape
    V = v.shape[-1]
    N = lay.n_seqs
    o = torch.empty(T, H, V, dtype=v.dtype, device=v.device)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=v.device) if output_final_state else None
    slots, ckpt = None, None
    if checkpoints is not None:
        slots, n_slots = checkpoints
        ckpt = torch.empty(n_slots, N, H, K, V, dtype=torch.float32, device=v.device)
    BV = block_v or state_block(N, H, V)
    AQK, PT, RN = prepare_pairs(q, k, g, beta, scale, lay, gate) if pair_kernel else (o, o, o)
    _one_pass_kernel[(N, H, triton.cdiv(V, BV))](
        q, k, v, g, beta, h0=initial_state, ht=ht, ckpt_slot=slots, ckpt=ckpt, o=o, cu=lay.cu_seqlens,
        chunk_off=lay.chunk_offsets, AQK=AQK, PT=PT, RN=RN, scale=scale, N=N, H=H, K=K, V=V, BT=CHUNK, BK=_pow2(K),
        BS=slice_width(K, V), BV=BV, HAS_H0=initial_state is not None, STORE_FINAL=output_final_state,
        PREC=precision(q.dtype), DT=dot_dtype(q.dtype, v.device), PAIRS_GIVEN=pair_kernel,
        num_warps=num_warps or ONE_PASS_WARPS, num_stages=1, **gate.kernel_args(q))
    return o, ht, ckpt
