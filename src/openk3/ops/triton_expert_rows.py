"""Grouped matrix-vector products over experts for decode-sized batches: y[r] = x_sorted[r] @ W[e(r)]^T, one row
a program, for plain weights (bf16 / fp16 / fp32 [E, N, K]) and for MXFP4 ones (SPEC §13: packed uint8 [E, N, K / 2]
with scales [E, N, K / 32], `ops.triton_mxfp4`'s layout).

A decode step gives each expert about one row (kimi-linear-48b: 8 of 256 experts a token). The grouped GEMMs pad
each expert's rows to a tile (torch's bf16 grouped GEMM gives every expert, empty or not, a group of 8 rows, so it
reads all E experts' weights: 1.42 ms a layer for kimi-linear-48b on an H100 at any batch up to 256; the MXFP4 tile
kernel spends its instructions dequantizing 32 weights into a 16-row operand for one real row). Here program
(r, n) finds row r's expert from `counts` alone (the number of experts whose cumulative count is <= r: no host
sync, CUDA graphs hold), reads that expert's BLOCK_N output rows along K (contiguous) and multiplies them by the
row in fp32: each weight is read once per row and costs its load (and unpacking) and one fused multiply-add, the
products kept per thread and reduced across the block once, after the walk over K. MXFP4 codes are read as int32
words of 8 and decoded two at a time (`e2m1_code_pair_fp32`: codes i and i + 4 placed by one shift into a bf16x2
register, then widened), each word's 8 products summed before its block scale multiplies them. Set by
instructions, not bytes: kimi-linear-48b's experts at 1-16 rows ran at ~750 GB/s on an H100 with ~15.7
instructions a weight in the loop (codes decoded byte by byte, the sums reduced across threads at every step);
decoded a code at a time in fp32 the loop took 9.0, now 7.2 (sm_90 SASS, triton 3.6, BLOCK_N 32), which on an H100
made a 16-token MoE layer 1.06x faster (bench/RESULTS.md, 2026-12-07 eleventh session: at one token the launch has
too few warps to cover memory latency, 126 registers a thread). Rows of one expert re-read its weights,
so this is for at most about one row per expert (`ops.triton_mxfp4.pick_method`; `ops.moe.experts_forward`).
Split-K as in `ops.triton_mxfp4` (programs over parts of K, fp32 partial sums added after).

Reference: `ops.moe.grouped_matmul_loop` on the (dequantized) weights; the products are the same values, summed in
another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.triton_experts_common import (
    add_splits,
    e2m1_code_pair_fp32,
    e8m0_values,
    k_splits,
    ptx_decode,
    split_output,
    word_columns,
)

BLOCK_N, BLOCK_K, WARPS = 32, 256, 4  # outputs and inputs a program takes a step


@triton.jit
def _word_step(words_ptr, s_ptr, w_row, n_ok, w, k0, k_end, K):
    """The MXFP4 codes (int32 words [BLOCK_N, WORDS]) and scale bytes (one per word, [BLOCK_N, WORDS]) of the step
    at input k0 (nothing past k_end)."""
    ok = n_ok[:, None] & (k0 // 8 + w < k_end // 8)[None, :]
    words = tl.load(words_ptr + w_row * (K // 8) + (k0 // 8 + w)[None, :], mask=ok, other=0)
    scales = tl.load(s_ptr + w_row * (K // 32) + (k0 // 32 + w // 4)[None, :], mask=ok, other=127)
    return words, scales


@triton.jit
def _expert_rows_kernel(x_ptr, counts_ptr, w_ptr, s_ptr, out_ptr, M, N, K, E, K_SPLIT, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, MXFP4: tl.constexpr, ASM: tl.constexpr):
    """Row program_id(0)'s outputs [BLOCK_N] over inputs [k_start, k_start + K_SPLIT) of split program_id(2), written
    to out[split] (out [splits, M, N]). The products are kept per thread ([BLOCK_N, inputs] partial sums) and
    reduced across the block's threads once, after the walk over K."""
    r = tl.program_id(0)
    e_idx = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e_idx, mask=e_idx < E, other=0).to(tl.int32)
    e = tl.sum((tl.cumsum(counts, axis=0) <= r).to(tl.int32), axis=0)  # the expert whose rows hold row r
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    w_row = (e.to(tl.int64) * N + rn)[:, None]  # [BLOCK_N, 1]: the expert's output rows, inputs along a row
    x_row = x_ptr + r.to(tl.int64) * K
    k_start = tl.program_id(2) * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    if MXFP4:  # int32 words of 8 codes (4 bytes: inputs 8w .. 8w + 7), one scale per 4 words
        WORDS: tl.constexpr = BLOCK_K // 8
        words_ptr = w_ptr.to(tl.pointer_type(tl.int32))
        w = tl.arange(0, WORDS)
        acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        # each step's codes and scales are loaded one step ahead: two steps' loads in flight, not one (a step is a
        # memory round trip; a decode step's programs walk K serially)
        words, scales = _word_step(words_ptr, s_ptr, w_row, n_ok, w, k_start, k_end, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            next_words, next_scales = _word_step(words_ptr, s_ptr, w_row, n_ok, w, k0 + BLOCK_K, k_end, K)
            k = k0 + 8 * w[:, None] + tl.arange(0, 8)[None, :]
            x = tl.load(x_row + k, mask=k < k_end, other=0.0).to(tl.float32)
            c0, c1, c2, c3, c4, c5, c6, c7 = word_columns(x)
            lo, hi = e2m1_code_pair_fp32(words, 0, ASM)
            word = lo * c0[None, :]  # one product a statement: fused multiply-adds, not multiplies and adds
            word += hi * c4[None, :]
            lo, hi = e2m1_code_pair_fp32(words, 1, ASM)
            word += lo * c1[None, :]
            word += hi * c5[None, :]
            lo, hi = e2m1_code_pair_fp32(words, 2, ASM)
            word += lo * c2[None, :]
            word += hi * c6[None, :]
            lo, hi = e2m1_code_pair_fp32(words, 3, ASM)
            word += lo * c3[None, :]
            word += hi * c7[None, :]
            acc += word * e8m0_values(scales)
            words, scales = next_words, next_scales
        out = tl.sum(acc, axis=1)
    else:
        kb = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_ok = k0 + kb < k_end
            wt = tl.load(w_ptr + w_row * K + (k0 + kb)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_row + k0 + kb, mask=k_ok, other=0.0).to(tl.float32)
            acc += wt.to(tl.float32) * x[None, :]
        out = tl.sum(acc, axis=1)
    tl.store(out_ptr + (tl.program_id(2) * M + r).to(tl.int64) * N + rn, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def expert_rows(x_sorted: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor,
                scales: torch.Tensor | None = None, splits: int = 0) -> torch.Tensor:
    """x_sorted [M, K] grouped by expert (counts [E], summing to M) times each expert's weight transposed -> [M, N]
    in x_sorted's dtype: weight [E, N, K] plain, or with `scales` MXFP4 (packed [E, N, K / 2], scales [E, N, K / 32]).
    splits: programs per output over parts of K (0: `k_splits` chooses)."""
    mxfp4 = scales is not None  # (its operands as `ops.triton_mxfp4.check_mxfp4_operands` has checked them)
    M, K = x_sorted.shape
    if not mxfp4 and (weight.dim() != 3 or weight.shape[2] != K or counts.shape != weight.shape[:1]):
        raise ValueError(f"expert rows: x_sorted [M, K] {list(x_sorted.shape)} needs weight [E, N, K] and counts [E], "
                         f"got {list(weight.shape)} and {list(counts.shape)}")
    if splits < 0:
        raise ValueError(f"splits must be >= 0 (0: chosen from the shapes), got {splits}")
    E, N = weight.shape[:2]
    if M == 0 or N == 0:
        return torch.empty(M, N, dtype=x_sorted.dtype, device=x_sorted.device)
    grid = (M, triton.cdiv(N, BLOCK_N))
    out, k_split = split_output(x_sorted, N, splits or k_splits(grid[0] * grid[1], K, BLOCK_K), BLOCK_K)
    _expert_rows_kernel[(*grid, out.shape[0])](
        x_sorted.contiguous(), counts.contiguous(), weight.contiguous(), scales.contiguous() if mxfp4 else weight,
        out, M, N, K, E, k_split, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_E=triton.next_power_of_2(E), MXFP4=mxfp4,
        ASM=ptx_decode(x_sorted), num_warps=WARPS)
    return add_splits(out, x_sorted.dtype)


# A torch custom op, so that torch.compile (the compiled decode step) keeps the launch whole
@torch.library.custom_op("openk3::expert_rows_matmul", mutates_args=())
def expert_rows_matmul(x_sorted: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`expert_rows` with plain weights [E, N, K]."""
    return expert_rows(x_sorted, counts, weight)


@expert_rows_matmul.register_fake
def _(x_sorted, counts, weight):
    return x_sorted.new_empty(x_sorted.shape[0], weight.shape[1])
