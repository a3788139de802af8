"""Grouped matrix-vector products over experts for decode-sized batches: y[r] = x_sorted[r] @ W[e(r)]^T, one row
a program, for plain weights (bf16 / fp16 / fp32 [E, N, K]) and for MXFP4 ones (SPEC §13: packed uint8 [E, N, K / 2]
with scales [E, N, K / 32], `ops.triton_mxfp4`'s layout).

A decode step gives each expert about one row (kimi-linear-48b: 8 of 256 experts a token). The grouped GEMMs pad
each expert's rows to a tile (torch's bf16 grouped GEMM gives every expert, empty or not, a group of 8 rows, so it
reads all E experts' weights: 1.42 ms a layer for kimi-linear-48b on an H100 at any batch up to 256; the MXFP4 tile
kernel spends its instructions dequantizing 32 weights into a 16-row operand for one real row). Here program
(r, n) finds row r's expert from `counts` alone (the number of experts whose cumulative count is <= r: no host
sync, CUDA graphs hold), reads that expert's BLOCK_N output rows along K (contiguous) and multiplies them by the
row in fp32: each weight is read once per row and costs its load (and unpacking) and one fused multiply-add; an
MXFP4 row's 32-input groups are summed before their scale multiplies them. Rows of one expert re-read its weights,
so this is for at most about one row per expert (`ops.triton_mxfp4.pick_method`; `ops.moe.experts_forward`).
Split-K as in `ops.triton_mxfp4` (programs over parts of K, fp32 partial sums added after).

Reference: `ops.moe.grouped_matmul_loop` on the (dequantized) weights; the products are the same values, summed in
another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.triton_experts_common import add_splits, e2m1_values, e8m0_values, k_splits, split_output

BLOCK_N, BLOCK_K, WARPS = 32, 256, 4  # outputs and inputs a program takes a step


@triton.jit
def _expert_rows_kernel(x_ptr, counts_ptr, w_ptr, s_ptr, out_ptr, M, N, K, E, K_SPLIT, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, MXFP4: tl.constexpr):
    """Row program_id(0)'s outputs [BLOCK_N] over inputs [k_start, k_start + K_SPLIT) of split program_id(2), written
    to out[split] (out [splits, M, N])."""
    r = tl.program_id(0)
    e_idx = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e_idx, mask=e_idx < E, other=0).to(tl.int32)
    e = tl.sum((tl.cumsum(counts, axis=0) <= r).to(tl.int32), axis=0)  # the expert whose rows hold row r
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    w_row = (e.to(tl.int64) * N + rn)[:, None]  # [BLOCK_N, 1]: the expert's output rows, inputs along a row
    x_row = x_ptr + r.to(tl.int64) * K
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_start = tl.program_id(2) * K_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):
        if MXFP4:
            HALF: tl.constexpr = BLOCK_K // 2
            GROUPS: tl.constexpr = BLOCK_K // 32
            j = tl.arange(0, HALF)  # packed byte of the step: inputs 2j (low nibble) and 2j + 1 (high)
            g = tl.arange(0, GROUPS)
            j_ok = k0 // 2 + j < K // 2
            g_ok = k0 // 32 + g < K // 32
            packed = tl.load(w_ptr + w_row * (K // 2) + (k0 // 2 + j)[None, :], mask=n_ok[:, None] & j_ok[None, :],
                             other=0)
            scale = tl.load(s_ptr + w_row * (K // 32) + (k0 // 32 + g)[None, :], mask=n_ok[:, None] & g_ok[None, :],
                            other=127)
            x_even = tl.load(x_row + k0 + 2 * j, mask=j_ok, other=0.0).to(tl.float32)
            x_odd = tl.load(x_row + k0 + 2 * j + 1, mask=j_ok, other=0.0).to(tl.float32)
            products = e2m1_values(packed & 0xF) * x_even[None, :] + e2m1_values(packed >> 4) * x_odd[None, :]
            groups = tl.sum(tl.reshape(products, (BLOCK_N, GROUPS, HALF // GROUPS)), axis=2)
            acc += tl.sum(groups * e8m0_values(scale), axis=1)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            w = tl.load(w_ptr + w_row * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + (tl.program_id(2) * M + r).to(tl.int64) * N + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


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
        num_warps=WARPS)
    return add_splits(out, x_sorted.dtype)


# A torch custom op, so that torch.compile (the compiled decode step) keeps the launch whole
@torch.library.custom_op("openk3::expert_rows_matmul", mutates_args=())
def expert_rows_matmul(x_sorted: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`expert_rows` with plain weights [E, N, K]."""
    return expert_rows(x_sorted, counts, weight)


@expert_rows_matmul.register_fake
def _(x_sorted, counts, weight):
    return x_sorted.new_empty(x_sorted.shape[0], weight.shape[1])
