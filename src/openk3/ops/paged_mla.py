"""Absorbed MLA decode over a paged latent cache (SPEC-K3 §3): a Triton kernel and its plain-PyTorch reference.

Layout (R = kv_lora_rank, r = the 64-wide "rope" slice in K3, stored and used unrotated: NoPE):
  q          [N,H,R+r]      per head [q_nope W_UK (W_UK folded into the query) | q_slice]; or [N,T,H,R+r]: T
                            consecutive queries of each sequence (a verification, a short prefill)
  pool       [pages,P,R+r]  one MLA layer's latent pages: per token [RMSNorm(latent) | k_slice], shared by heads
  tables     [S,M] int32    block tables: row s lists the physical pages of the sequence in slot s, in order
  rows       [N] int        the table row (the sequence's slot) each query reads
  lengths    [N] int        positions each query attends to, >= 1: 0 .. lengths-1 of its pages; query t of T attends
                            lengths + t (causal among the T)
  num_tokens [N] int | None with T queries: row n's first num_tokens[n] are real, the rest padding (output 0,
                            nothing read for them)
  out        [N,H,R] / [N,T,H,R] fp32   p . latent (the caller applies W_UV: the output absorption)
Scores are scale * (q . [latent | k_slice]), softmax over the sequence's positions.

fp32 pools take exact fp32 products (input_precision "ieee"; tf32 would cost 1e-3), 16-bit pools the tensor cores.
The kernel splits the positions ("flash decoding"): program (row block, split, n) walks one contiguous share of
sequence n with an online softmax for a block of its (query, head) rows, which share every latent tile it loads:
T queries of a sequence read its past once, not T times. It writes its partial outputs and log-sum-exps; one more
launch merges them (`combine_splits_triton`; reference `combine_splits`).
The split count is chosen inside the op from the number of sequences and row blocks (enough programs to fill the
device), so a compiled caller never specialises on it; each split walks at least `min_split` positions, so a short
sequence uses one or a few splits and the rest exit at once (lse = -inf: they weigh nothing). A long context at a
small batch thus spreads over the whole device. The launch is the same whatever the lengths (CUDA-graph friendly); no
host synchronisation.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional (the gpu extra); the reference needs none
    triton = None

BLOCK_H = 16  # heads per program at one query a sequence (tl.dot needs >= 16 rows)
ROW_BLOCK_ELEMENTS = 16384  # a program's [rows, R] accumulator at most, with several queries a sequence
BLOCK_N = 32  # positions per tile
MIN_SPLIT = 256  # positions a split walks at least (a multiple of BLOCK_N)
# a query's splits at most: one 262,144-token context at batch 1 took 215 us a layer at 64 splits (4,096 positions
# walked by each program, latency-bound) and 130 us at 256 (H200, 2026-12-07, bench/decode_context.py)
MAX_SPLITS = 512
MAX_SEQUENCES = 65535  # sequences a launch (the grid's third axis)
PROGRAMS_PER_PROCESSOR = 4
COMBINE_R = 128  # latent columns a program of the split merge takes
COMBINE_TILE = 8192  # elements of a split-merge program's [splits, heads, columns] tile at most
COMBINE_ALL_SPLITS_FROM = 16  # splits from which a merge program loads them all at once


@functools.cache
def processors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def split_count(queries: int, head_blocks: int, device: torch.device) -> int:
    """Splits per query: about PROGRAMS_PER_PROCESSOR programs per processor over all queries and head blocks."""
    programs = PROGRAMS_PER_PROCESSOR * processors(device)
    return max(1, min(MAX_SPLITS, -(-programs // max(1, queries * head_blocks))))

def paged_positions(tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat row indices into pool.view(-1, R+r) of `positions` ([N] or [N,L]) of each query's sequence."""
    pos = positions.long()
    table = tables[rows.long()]  # [N,M]
    index = (pos // page_size) if pos.dim() == 2 else (pos // page_size).unsqueeze(1)
    pages = table.gather(1, index).long().view(pos.shape)
    return pages * page_size + pos % page_size


def paged_mla_decode_reference(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
                               lengths: torch.Tensor, latent_dim: int, scale: float,
                               num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch: gather each sequence's latents through its block table, masked softmax. [N,H,R] fp32, or
    [N,T,H,R] for q [N,T,H,D] (query t attends lengths + t positions; padding rows past num_tokens are 0)."""
    single = q.dim() == 3
    q = q.unsqueeze(1) if single else q
    N, T = q.shape[:2]
    count = lengths.view(N, 1) + torch.arange(T, device=q.device)  # [N,T] positions each query attends
    real = torch.arange(T, device=q.device).expand(N, T) < (num_tokens.view(N, 1) if num_tokens is not None else T)
    L = int(count.max()) if N else 0
    pos = torch.arange(L, device=q.device).expand(N, L)
    inside = pos < count[:, -1:]  # a sequence's own positions (others index its table's first page instead)
    kv = pool.reshape(-1, pool.shape[-1])[paged_positions(tables, rows, pos * inside, pool.shape[1])].float()
    valid = pos.unsqueeze(1) < count.unsqueeze(-1)  # [N,T,L]
    scores = torch.einsum("nthd,nld->nthl", q.float(), kv) * scale
    p = scores.masked_fill(~valid.unsqueeze(2), float("-inf")).softmax(-1)
    out = torch.einsum("nthl,nlr->nthr", p, kv[..., :latent_dim]) * real.view(N, T, 1, 1)
    return out[:, 0] if single else out


# A torch custom op declared in place on the pool: traced as an index_copy_, Inductor copied the whole page pool
# (every layer, every page) once per compiled decode step to write B rows (0.39 ms per step on an H200).
@torch.library.custom_op("openk3::write_latents", mutates_args=("pool",))
def write_latents(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """pool.view(-1, R+r)[rows] = values, in place: values [N, R+r] at the flat rows [N] (`paged_positions`)."""
    pool.view(-1, pool.shape[-1]).index_copy_(0, rows, values.to(pool.dtype))


@write_latents.register_fake
def _(pool, rows, values):
    return None


def combine_splits(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merge split partials: out [N,S,H,R] (each normalised over its share), lse [N,S,H] -> [N,H,R] (the reference
    of `combine_splits_triton`). An empty split (lse -inf) weighs nothing, whatever its partial holds."""
    m = lse.max(dim=1, keepdim=True).values  # every query has >= 1 position, so some split is finite
    out = out.masked_fill((lse == float("-inf")).unsqueeze(-1), 0.0)  # an empty split's partial is never written
    w = torch.exp(lse - m)  # [N,S,H]
    return (out * w.unsqueeze(-1)).sum(1) / w.sum(1).unsqueeze(-1)


def paged_mla_decode(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
                     lengths: torch.Tensor, latent_dim: int, scale: float, num_splits: int = 0,
                     min_split: int = MIN_SPLIT, num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel (same contract as `paged_mla_decode_reference`). Returns [N,H,R] (q [N,H,D]) or [N,T,H,R]
    (q [N,T,H,D]) fp32. num_splits 0: by the number of sequences and row blocks and the device (`split_count`);
    min_split: positions a split walks at least."""
    D = q.shape[-1]
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [N, H, {D}] or [N, T, H, {D}], got {tuple(q.shape)}")
    if pool.shape[-1] != D or not pool.is_contiguous():
        raise ValueError(f"pool must be a contiguous [pages, P, {D}] tensor, got {tuple(pool.shape)}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0: chosen by the op), got {num_splits}")
    if min_split < 1 or min_split % BLOCK_N:
        raise ValueError(f"min_split must be a positive multiple of {BLOCK_N}, got {min_split}")
    if q.shape[0] > MAX_SEQUENCES:
        raise ValueError(f"at most {MAX_SEQUENCES} sequences a launch (a grid axis), got {q.shape[0]}")
    single = q.dim() == 3
    out = paged_mla_attend(q.unsqueeze(1) if single else q, pool, tables, rows, lengths, latent_dim, scale,
                           num_splits, min_split, num_tokens)
    return out[:, 0] if single else out


def row_block(queries: int, heads: int, latent_dim: int) -> int:
    """(query, head) rows a program takes: one query's heads in blocks of BLOCK_H (decode: more programs), or with
    several queries a sequence, as many of its rows as fit the registers beside a [rows, R] fp32 accumulator (64 at
    R = 256, 32 at K3's 512): each latent tile loaded serves them all."""
    if queries == 1:
        return BLOCK_H
    rows = triton.next_power_of_2(queries * heads)
    return max(BLOCK_H, min(rows, ROW_BLOCK_ELEMENTS // triton.next_power_of_2(latent_dim)))


# A torch custom op, so that torch.compile keeps the launch whole in a compiled decode step (`openk3.serve.runner`)
# and never sees the split count, which depends on the batch
@torch.library.custom_op("openk3::paged_mla_attend", mutates_args=())
def paged_mla_attend(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
                     lengths: torch.Tensor, latent_dim: int, scale: float, num_splits: int, min_split: int,
                     num_tokens: torch.Tensor | None) -> torch.Tensor:
    N, T, H, D = q.shape
    R, r = latent_dim, D - latent_dim
    block = row_block(T, H, R)
    row_blocks = triton.cdiv(T * H, block)  # the rows of a block share every latent tile
    splits = num_splits or split_count(N, row_blocks, q.device)
    out = torch.empty(N, splits, T * H, R, dtype=torch.float32, device=q.device)
    lse = torch.empty(N, splits, T * H, dtype=torch.float32, device=q.device)
    if N:
        real = num_tokens if num_tokens is not None else lengths  # (unread without HAS_REAL)
        # a sequence's row blocks (and then its splits) launch next to each other: blocks reading the same latent
        # tiles at the same time share them in L2
        _paged_mla_decode_kernel[(row_blocks, splits, N)](
            q.contiguous(), pool, tables, rows.to(torch.int32), lengths.to(torch.int32), real.to(torch.int32), out,
            lse, scale, H, T, tables.stride(0), splits, P=pool.shape[1], R=R, RS=r,
            BLOCK_R=triton.next_power_of_2(R), BLOCK_RS=max(16, triton.next_power_of_2(max(r, 1))),
            BLOCK_M=block, BLOCK_N=BLOCK_N, MIN_SPLIT=min_split, HAS_REAL=num_tokens is not None,
            PREC="ieee" if pool.dtype == torch.float32 else "tf32", num_warps=4 if block <= BLOCK_H else 8)
    merged = combine_splits_triton(out, lse) if splits > 1 else out[:, 0]
    return merged.view(N, T, H, R)


def combine_splits_triton(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """`combine_splits` in one launch (fp32 out and lse, contiguous): in a decode step its six eager reductions and
    element-wise kernels per MLA layer cost more than the merge's bytes. A program takes one query's splits for a
    block of heads and latent columns, BLOCK_S splits at a time. Measured on an H100 (2026-12-07, kimi-linear-48b,
    bench/RESULTS.md eleventh session), each form where it is taken: a split at a time over [16 heads, all columns]
    under 10.6 us a layer at batch 64 (5 splits) but 33 us at batch 1 (64 splits walked in turn); all splits at once
    over [splits, heads, COMBINE_R columns] (COMBINE_TILE elements at most) under 4.3 us at batch 1 but 25 us at
    batch 64. So from COMBINE_ALL_SPLITS_FROM splits a program loads them all at once, below it walks them."""
    N, S, H, R = out.shape
    merged = torch.empty(N, H, R, dtype=torch.float32, device=out.device)
    if N and H:
        if S >= COMBINE_ALL_SPLITS_FROM:
            block_r = min(COMBINE_R, triton.next_power_of_2(R))
            block_s = min(triton.next_power_of_2(S), max(1, COMBINE_TILE // block_r))
            block_h = max(1, min(triton.next_power_of_2(H), COMBINE_TILE // (block_s * block_r)))
        else:
            block_s, block_h, block_r = 1, BLOCK_H, triton.next_power_of_2(R)
        _combine_splits_kernel[(N, triton.cdiv(H, block_h), triton.cdiv(R, block_r))](
            out, lse, merged, S, H, R, ALL_S=triton.next_power_of_2(S), BLOCK_S=block_s, BLOCK_H=block_h,
            BLOCK_R=block_r, num_warps=4)
    return merged


@paged_mla_attend.register_fake
def _(q, pool, tables, rows, lengths, latent_dim, scale, num_splits, min_split, num_tokens):
    N, T, H, _ = q.shape
    return q.new_empty(N, T, H, latent_dim, dtype=torch.float32)


if triton is not None:

    @triton.jit
    def _combine_splits_kernel(out, lse, merged, S, H, R, ALL_S: tl.constexpr, BLOCK_S: tl.constexpr,
                               BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
        """Query program_id(0), heads [BLOCK_H] of block program_id(1), latent columns [BLOCK_R] of block
        program_id(2): the sum over splits s of exp(lse_s - m) out_s, over the sum of the weights (m the largest
        lse; empty splits, lse = -inf and zero partials, weigh 0), the partials read BLOCK_S splits a step."""
        n = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cr = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        hm, cm = heads < H, cr < R
        every = tl.arange(0, ALL_S)
        all_lse = tl.load(lse + (n * S + every).to(tl.int64)[:, None] * H + heads[None, :],
                          mask=(every < S)[:, None] & hm[None, :], other=float("-inf"))
        # a real head has a finite lse (some split holds positions), so its weights sum to >= 1; the bounds only
        # keep the heads past H (never stored) free of -inf - -inf and 0 / 0
        m = tl.maximum(tl.max(all_lse, axis=0), -3.0e38)
        denom = tl.maximum(tl.sum(tl.exp(all_lse - m[None, :]), axis=0), 1.0)
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        for s0 in range(0, S, BLOCK_S):
            splits = s0 + tl.arange(0, BLOCK_S)
            ok = (splits < S)[:, None] & hm[None, :]  # [BLOCK_S, BLOCK_H]
            rows = (n * S + splits).to(tl.int64)[:, None] * H + heads[None, :]
            part_lse = tl.load(lse + rows, mask=ok, other=float("-inf"))
            w = tl.exp(part_lse - m[None, :])
            # an empty split's partial is never written (nor read: no memory traffic for it)
            full = ok & (part_lse > float("-inf"))
            parts = tl.load(out + rows[:, :, None] * R + cr[None, None, :],
                            mask=full[:, :, None] & cm[None, None, :], other=0.0)  # [BLOCK_S, BLOCK_H, BLOCK_R]
            acc += tl.sum(w[:, :, None] * parts, axis=0)
        tl.store(merged + (n * H + heads).to(tl.int64)[:, None] * R + cr[None, :], acc / denom[:, None],
                 mask=hm[:, None] & cm[None, :])

    @triton.jit
    def _paged_mla_decode_kernel(q, pool, tables, rows, lengths, real, out, lse, scale, H, T, table_stride,
                                num_splits, P: tl.constexpr, R: tl.constexpr, RS: tl.constexpr,
                                BLOCK_R: tl.constexpr, BLOCK_RS: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, HAS_REAL: tl.constexpr,
                                PREC: tl.constexpr):
        """Sequence program_id(2), its share program_id(1) of the positions, its (query, head) rows [BLOCK_M] of
        block program_id(0) (row i: query i // H, head i % H): partial outputs and log-sum-exps of those rows."""
        n = tl.program_id(2)
        split = tl.program_id(1)
        qr = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        D: tl.constexpr = R + RS
        first = tl.load(lengths + n)  # positions the sequence's first query attends
        tokens = tl.load(real + n) if HAS_REAL else T
        t = qr // H
        rm = (qr < T * H) & (t < tokens)  # real rows (padding queries read nothing and output 0)
        count = tl.where(rm, first + t, 0)  # positions each row attends (causal among the T queries)
        table = tables + tl.load(rows + n).to(tl.int64) * table_stride
        # every block of the sequence splits its longest row's positions alike (the merge pairs a row's splits)
        share = tl.maximum(tl.cdiv(tl.cdiv(first + tokens - 1, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)
        start = split * share
        end = tl.minimum(tl.max(count, axis=0), start + share)  # this block's longest row

        cr = tl.arange(0, BLOCK_R)
        cs = tl.arange(0, BLOCK_RS)
        q_rows = q + (n * T * H + qr).to(tl.int64)[:, None] * D
        q_lat = tl.load(q_rows + cr[None, :], mask=rm[:, None] & (cr[None, :] < R), other=0.0)
        q_pe = tl.load(q_rows + R + cs[None, :], mask=rm[:, None] & (cs[None, :] < RS), other=0.0)
        q_lat = q_lat.to(pool.dtype.element_ty)
        q_pe = q_pe.to(pool.dtype.element_ty)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pm = pos < end
            page = tl.load(table + pos // P, mask=pm, other=0).to(tl.int64)
            base = (page * P + pos % P) * D
            kv = tl.load(pool + base[:, None] + cr[None, :], mask=pm[:, None] & (cr[None, :] < R), other=0.0)
            kpe = tl.load(pool + base[:, None] + R + cs[None, :], mask=pm[:, None] & (cs[None, :] < RS), other=0.0)
            s = tl.dot(q_lat, tl.trans(kv), input_precision=PREC) + tl.dot(q_pe, tl.trans(kpe), input_precision=PREC)
            s = tl.where(pos[None, :] < count[:, None], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # a row with no position yet (a later query's first tile, or none in this share) keeps m = -inf: its
            # exponentials are taken from 0 instead, so they are exp(-inf) = 0, not NaN
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_ref)
            p = tl.exp(s - m_ref[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PREC)
            m = m_new

        live = denom > 0
        o = acc / tl.where(live, denom, 1.0)[:, None]
        part = (n * num_splits + split) * T * H + qr
        hm = qr < T * H
        # an empty split (past a short sequence's end) stores its lse only: the merge does not read its partial;
        # split 0 always stores (a padding row's 0 is the output where one split leaves nothing to merge; the
        # comparison is broadcast to the rows first: a scalar one in the mask fails under the interpreter)
        tl.store(out + part.to(tl.int64)[:, None] * R + cr[None, :], o,
                 mask=(hm & (live | ((tl.zeros([BLOCK_M], tl.int32) + split) == 0)))[:, None] & (cr[None, :] < R))
        tl.store(lse + part, tl.where(live, m + tl.log(tl.where(live, denom, 1.0)), float("-inf")), mask=hm)
