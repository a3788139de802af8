"""Grouped W4A16 GEMM over MXFP4 experts (SPEC §13): y[r] = x_sorted[r] @ W[e(r)]^T for rows grouped by expert,
with the weights kept 4-bit in memory and dequantized in registers inside the kernel.

Weights, one matrix per expert in nn.Linear's [out, in] = [N, K] layout, as the released files store them
(compressed-tensors' `mxfp4-pack-quantized`, openk3.quant.mx):
  packed  uint8 [E, N, K / 2]   two E2M1 codes per byte, input 2j in the low nibble, 2j + 1 in the high one
  scales  uint8 [E, N, K / 32]  one E8M0 exponent per 32 inputs: 2^(s - 127), s = 0xFF is NaN
Rows: x_sorted [M, K] (bf16 / fp16 / fp32) grouped by expert, counts [E] rows per expert (`ops.moe.group_by_expert`,
empty experts allowed). The reference is the dequantize-then-matmul loop, `ops.moe.grouped_matmul_loop` on the
weights `quant.mx.unpack_mxfp4` gives; the values the kernel multiplies are the same (E2M1 times a power of two is
exact in bf16), so the two differ by the order of the fp32 sums only.

Each program computes a [BLOCK_M, BLOCK_N] tile of one expert's rows: program m of the grid's first axis finds its
expert and row tile from `counts` alone (the running sum of each expert's ceil(count / BLOCK_M) tiles), so the grid
is sized from M and E only (no host sync: CUDA graphs hold) and programs past the last tile return at once. A
decode step's few rows per expert take BLOCK_M = 16, and so few tiles that each program's walk over K (one memory
latency a step) sets the time: there the inputs are split over programs (split-K, `k_splits`; program_id(2) takes
one part) whose fp32 partial sums are added after.

`method="dequant"` (the explicit dequantization) computes the tile transposed, out^T = W x^T: the codes are read
along K as stored, the dequantized weights are the MMA's first operand and the tile's few rows its narrow side.
The codes are read as int32 words of 8 (a 32-input block's 4 words and its scale byte in one thread) and decoded two
at a time: codes i and i + 4 of a word are 16 bits apart, so one shift and two masks place both in a bf16x2
register and two bf16x2 multiplies scale them (`triton_experts_common.e2m1_code_pair`, PTX on a GPU); the weights
come out in that pair order and the rows' inputs are permuted to match (`pair_order`, register moves). The tile
loop went from 12.1 to 6.2 instructions a weight at 16-row tiles, 13.3 to 8.3 at 64 (bf16 rows; sm_90 SASS with
triton 3.6), yet the 64-token layer only went 979 -> 929 us on an H100: the tiles are bound by shared-memory
traffic (the dequantized operand staged for the MMA), not by the decode (Nsight Compute: bench/RESULTS.md,
2026-12-07 eleventh session). Earlier, on an H200
with kimi-linear-48b's experts (bench/RESULTS.md, 2026-12-07 eighth session): the same tile with the rows as the
first operand and the codes read K-down against this orientation, 64 tokens 1081 -> 969 us a layer, 256 tokens
1504 -> 1195 us, 4096 tokens 21.4 -> 7.2 ms.

`method="rows"` takes the row kernel instead (`ops.triton_expert_rows`, what "auto" picks for at most one row per
expert on average: a decode step): a row tile of 16 rows for one real row is where the tile kernel's instructions go
(dequantizing 32 weights into an operand for one row's products).

`method="dot_scaled"` hands the packed codes and scales to `tl.dot_scaled` instead (bf16 / fp16 rows), which Triton
lowers to its own upcast on Hopper and to native MX instructions on Blackwell; the rows are its first operand. "auto"
no longer takes it on Hopper, where the tiles are faster (ROW_KERNEL_MAX_ROWS' note).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops import gluon_mxfp4
from openk3.ops.triton_expert_rows import expert_rows
from openk3.ops.triton_experts_common import (
    add_splits,
    e2m1_values,
    e8m0_bf16_pairs,
    e8m0_values,
    k_splits,
    mxfp4_pair_weights,
    pair_order,
    ptx_decode,
    split_output,
)

METHODS = ("auto", "rows", "dequant", "dot_scaled")
# method "auto" by the mean rows per expert, from kimi-linear-48b's experts (bench/mxfp4_experts.py, bench/RESULTS.md
# 2026-12-07): the row kernel up to one (H100: batch 1: 39 + 25 -> 27 + 17 us; 16 tokens 312 + 168 -> 255 + 145 us;
# H200 at 16 tokens 457 us a layer, the explicit dequantization's tiles 463; at 64 tokens, two rows an expert, the
# row kernel takes 1634 us, the tiles 969), the explicit dequantization's tiles above it (`ops.moe` expands the
# experts to bf16 from EXPAND_MIN_ROWS). tl.dot_scaled, Triton's own MXFP4 path, stays a method of its own: since
# the tiles read a block's words in one thread, they beat it at every mean timed (H100, eleventh session: 2 rows an
# expert 929 against 1,537 us a layer, 8 rows 1,115 against 1,847, 128 rows 4,770 against 5,410)
ROW_KERNEL_MAX_ROWS = 1.0
# where the Gluon tiles run (`ops.gluon_mxfp4`: bf16 rows on Hopper) the row kernel only up to 1/16 row an expert:
# on an H100 (2026-12-07, twelfth session) 1 token (1/32 row an expert) 77.9 us a layer against the Gluon tiles'
# 81.4, 16 tokens (1/2) 364 against 290
GLUON_ROW_KERNEL_MAX_ROWS = 1 / 16
BLOCK_N = 64
# rows per tile -> (inputs per step, warps of tl.dot_scaled's tiles): the tiles that compile for sm_90 without
# register spills (triton 3.9, cuobjdump -res-usage); timings on a GPU may pick others
TILES = {16: (128, 8), 32: (128, 8), 64: (64, 8), 128: (64, 8)}
DEQUANT_WARPS = 4  # the explicit dequantization's tiles: one warpgroup, whose MMA takes BLOCK_N = 64 weight rows


@triton.jit
def _scaled_tile(x_rows, w_ptr, s_ptr, w_rows, m_ok, n_ok, k_start, k_end, K, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SCALED_FORMAT: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] products of rows x_rows (pointers [BLOCK_M]) and weight rows w_rows ([BLOCK_N]) over
    inputs [k_start, k_end) by tl.dot_scaled: codes read as [HALF, BLOCK_N] tiles (K down), the rows the first
    operand."""
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 32
    j = tl.arange(0, HALF)  # packed byte of the step
    g = tl.arange(0, GROUPS)  # scale of the step
    acc = tl.zeros([x_rows.shape[0], BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        j_ok = k0 // 2 + j < K // 2
        g_ok = k0 // 32 + g < K // 32
        packed = tl.load(w_ptr + w_rows[None, :] * (K // 2) + (k0 // 2 + j)[:, None],
                         mask=j_ok[:, None] & n_ok[None, :], other=0)
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows[:, None] + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        scale = tl.load(s_ptr + w_rows[:, None] * (K // 32) + (k0 // 32 + g)[None, :],
                        mask=n_ok[:, None] & g_ok[None, :], other=127)
        acc = tl.dot_scaled(x, None, SCALED_FORMAT, packed, scale, "e2m1", acc)
    return acc


@triton.jit
def _dequant_tile(x_rows, w_ptr, s_ptr, w_rows, m_ok, n_ok, k_start, k_end, K, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr):
    """The products of `_scaled_tile` transposed, [BLOCK_N, BLOCK_M] = W x^T, with the explicit dequantization:
    codes read as int32 words of 8 along K, as stored, each block's 4 words and its scale byte (repeated) loaded as
    [rows, blocks, 4] (one thread's: the decode needs no shuffle), decoded in pairs (`mxfp4_pair_weights`); the
    dequantized weights are the first operand, the rows' inputs loaded in order and put in the weights'
    (`pair_order`)."""
    BLOCKS: tl.constexpr = BLOCK_K // 32
    words_ptr = w_ptr.to(tl.pointer_type(tl.int32))
    b = tl.arange(0, BLOCKS)[None, :, None]
    q = tl.arange(0, 4)[None, None, :]
    rows = w_rows[:, None, None]
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([w_rows.shape[0], BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ok = n_ok[:, None, None] & (k0 // 32 + b < K // 32)
        words = tl.load(words_ptr + rows * (K // 8) + k0 // 8 + 4 * b + q, mask=ok, other=0)
        scales = tl.load(s_ptr + rows * (K // 32) + k0 // 32 + b + 0 * q, mask=ok, other=127)
        x = tl.load(x_rows[:, None] + k0 + k[None, :], mask=m_ok[:, None] & (k0 + k < K)[None, :], other=0.0)
        pairs = e8m0_bf16_pairs(tl.reshape(scales, (w_rows.shape[0], BLOCK_K // 8)))
        weights = mxfp4_pair_weights(tl.reshape(words, (w_rows.shape[0], BLOCK_K // 8)), pairs, ASM)
        acc = tl.dot(weights.to(DOT), tl.trans(pair_order(x.to(DOT))), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _mxfp4_grouped_matmul_kernel(x_ptr, counts_ptr, w_ptr, s_ptr, out_ptr, M, N, K, E, K_SPLIT,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 BLOCK_E: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                                 SCALED_FORMAT: tl.constexpr, ASM: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] output tile over inputs [k_start, k_start + K_SPLIT) of split program_id(2), written
    to out[split] (out [splits, M, N]); SCALED_FORMAT ("bf16" / "fp16") takes tl.dot_scaled, "" the explicit
    dequantization (ASM: its codes decoded by PTX, on a CUDA GPU)."""
    e_idx = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e_idx, mask=e_idx < E, other=0).to(tl.int32)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    pid_m = tl.program_id(0)
    e = tl.sum((tl.cumsum(tiles, axis=0) <= pid_m).to(tl.int32), axis=0)  # the expert whose tiles hold pid_m
    if e < E:
        before = e_idx < e
        tile = pid_m - tl.sum(tl.where(before, tiles, 0), axis=0)
        row0 = tl.sum(tl.where(before, counts, 0), axis=0) + tile * BLOCK_M
        rows_left = tl.sum(tl.where(e_idx == e, counts, 0), axis=0) - tile * BLOCK_M
        rm = tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < rows_left, rn < N
        x_rows = x_ptr + (row0 + rm).to(tl.int64) * K  # [BLOCK_M]
        w_rows = e.to(tl.int64) * N + rn  # [BLOCK_N]: the expert's output rows
        k_start = tl.program_id(2) * K_SPLIT
        k_end = tl.minimum(k_start + K_SPLIT, K)
        if SCALED_FORMAT == "":
            acc = tl.trans(_dequant_tile(x_rows, w_ptr, s_ptr, w_rows, m_ok, n_ok, k_start, k_end, K, BLOCK_M,
                                         BLOCK_K, DOT, PRECISION, ASM))
        else:
            acc = _scaled_tile(x_rows, w_ptr, s_ptr, w_rows, m_ok, n_ok, k_start, k_end, K, BLOCK_N, BLOCK_K,
                               SCALED_FORMAT)
        out = out_ptr + (tl.program_id(2) * M + row0 + rm).to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def dot_dtype(x: torch.Tensor) -> tl.dtype:
    """The product's operand type: x's 16-bit type on a GPU; fp32 for fp32 rows and for CPU tensors, which the kernel
    sees only under the Triton interpreter (whose 16-bit dot products are broken). Exact either way: the dequantized
    weights are 16-bit values."""
    if x.device.type == "cpu" or x.dtype == torch.float32:
        return tl.float32
    return tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16


def block_m(rows: int, experts: int) -> int:
    """Rows per tile from the mean rows per expert (shapes only): 16 for decode, up to 128 for long prefills."""
    mean = rows / max(experts, 1)
    return next((m for m in TILES if mean <= m), max(TILES))


def pick_method(method: str, rows: int, experts: int, gluon: bool = False) -> str:
    """The kernel that runs: `method`, or for "auto" the one for the mean rows per expert (see ROW_KERNEL_MAX_ROWS;
    gluon: where the Gluon tiles run, GLUON_ROW_KERNEL_MAX_ROWS)."""
    if method not in METHODS:
        raise ValueError(f"MXFP4 grouped matmul method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    row_kernel_max = GLUON_ROW_KERNEL_MAX_ROWS if gluon else ROW_KERNEL_MAX_ROWS
    return "rows" if rows / max(experts, 1) <= row_kernel_max else "dequant"


def check_mxfp4_operands(x_sorted: torch.Tensor, counts: torch.Tensor, packed: torch.Tensor,
                         scales: torch.Tensor) -> None:
    """ValueError naming the operand whose shape or dtype does not fit the others."""
    if packed.dim() != 3 or packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 experts: packed must be uint8 [E, N, K/2] and scales uint8 [E, N, K/32], got "
                         f"{packed.dtype} {list(packed.shape)} and {scales.dtype} {list(scales.shape)}")
    E, N, half = packed.shape
    K = x_sorted.shape[-1]
    if x_sorted.dim() != 2 or 2 * half != K or K % 32 or tuple(scales.shape) != (E, N, K // 32):
        raise ValueError(f"MXFP4 experts: rows {list(x_sorted.shape)} need packed [E, N, K/2] and scales "
                         f"[E, N, K/32] with K a multiple of 32, got {list(packed.shape)} and {list(scales.shape)}")
    if counts.shape != (E,):
        raise ValueError(f"MXFP4 experts: counts must hold one row count per expert ({E}), got {list(counts.shape)}")


# A torch custom op, so that torch.compile (the compiled decode step) keeps the launch whole
@torch.library.custom_op("openk3::mxfp4_grouped_matmul", mutates_args=())
def mxfp4_grouped_matmul_triton(x_sorted: torch.Tensor, counts: torch.Tensor, packed: torch.Tensor,
                                scales: torch.Tensor, method: str = "auto", splits: int = 0) -> torch.Tensor:
    """x_sorted [M, K] grouped by expert (counts [E], summing to M) times each expert's MXFP4 weight (packed
    [E, N, K/2], scales [E, N, K/32]) transposed -> [M, N] in x_sorted's dtype. method: "rows" (the row
    kernel), "dequant" (row tiles, explicit dequantization; any float rows), "dot_scaled" (row tiles, 16-bit rows)
    or "auto" (`pick_method`). splits: programs per output tile, each over a part of K, their fp32
    partial sums added after (0: `k_splits` chooses)."""
    check_mxfp4_operands(x_sorted, counts, packed, scales)
    M, K = x_sorted.shape
    E, N, _ = packed.shape
    gluon = gluon_mxfp4.usable(x_sorted.dtype, x_sorted.device)
    method = pick_method(method, M, E, gluon)
    scaled = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(x_sorted.dtype) if method == "dot_scaled" else ""
    if scaled is None:
        raise ValueError(f"method 'dot_scaled' takes bf16 or fp16 rows, got {x_sorted.dtype}")
    if splits < 0:
        raise ValueError(f"splits must be >= 0 (0: chosen from the shapes), got {splits}")
    if M == 0 or N == 0:
        return torch.empty(M, N, dtype=x_sorted.dtype, device=x_sorted.device)
    if method == "rows":
        return expert_rows(x_sorted, counts, packed, scales, splits)
    gluon = gluon and method == "dequant"
    bm = block_m(M, E)
    block_k, warps = TILES[bm]
    block_k, tile_n = (gluon_mxfp4.BLOCK_K, gluon_mxfp4.block_n(bm)) if gluon else (block_k, BLOCK_N)
    # tiles: at most ceil(M / bm) full ones plus one partial tile per expert that has rows (at most min(E, M))
    grid = (triton.cdiv(M, bm) + min(E, M), triton.cdiv(N, tile_n))
    out, k_split = split_output(x_sorted, N, splits or k_splits(grid[0] * grid[1], K, block_k), block_k)
    x_sorted, counts, packed, scales = x_sorted.contiguous(), counts.contiguous(), packed.contiguous(), \
        scales.contiguous()
    if gluon:
        gluon_mxfp4.launch(x_sorted, counts, packed, scales, out, k_split, bm, grid)
        return add_splits(out, x_sorted.dtype)
    dot = dot_dtype(x_sorted)
    _mxfp4_grouped_matmul_kernel[(*grid, out.shape[0])](
        x_sorted, counts, packed, scales, out, M, N, K, E,
        k_split, BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=block_k, BLOCK_E=triton.next_power_of_2(E), DOT=dot,
        PRECISION="ieee" if dot == tl.float32 else "tf32", SCALED_FORMAT=scaled, ASM=ptx_decode(x_sorted),
        num_warps=warps if scaled else DEQUANT_WARPS)
    return add_splits(out, x_sorted.dtype)


@mxfp4_grouped_matmul_triton.register_fake
def _(x_sorted, counts, packed, scales, method="auto", splits=0):
    return x_sorted.new_empty(x_sorted.shape[0], packed.shape[1])


@triton.jit
def _expand_kernel(w_ptr, s_ptr, out_ptr, ROWS, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [BLOCK_R] x inputs [BLOCK_K] of the dequantized weights: each byte's two codes times their block's
    scale, the low nibble at the even input, written interleaved."""
    HALF: tl.constexpr = BLOCK_K // 2
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.program_id(1) * HALF + tl.arange(0, HALF)
    ok = (r < ROWS)[:, None] & (j < K // 2)[None, :]
    rows = r.to(tl.int64)[:, None]
    packed = tl.load(w_ptr + rows * (K // 2) + j[None, :], mask=ok, other=0)
    scale = e8m0_values(tl.load(s_ptr + rows * (K // 32) + (j // 16)[None, :], mask=ok, other=127))
    values = tl.interleave(e2m1_values(packed & 0xF) * scale, e2m1_values(packed >> 4) * scale)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows * K + k[None, :], values.to(out_ptr.dtype.element_ty),
             mask=(r < ROWS)[:, None] & (k < K)[None, :])


@torch.library.custom_op("openk3::mxfp4_expand", mutates_args=())
def expand_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 weights (packed uint8 [..., N, K/2], scales uint8 [..., N, K/32]) -> [..., N, K] in `dtype`, in one
    pass (`quant.mx.unpack_mxfp4`'s values: exact in bf16 and fp32). For batches where the bf16 grouped GEMM on the
    expanded experts beats the W4A16 kernels (`ops.moe.experts_forward_mxfp4`, method "expand")."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8 or packed.shape[:-1] != scales.shape[:-1] or (
            2 * packed.shape[-1] != 32 * scales.shape[-1]):
        raise ValueError(f"MXFP4 weights: packed uint8 [..., N, K/2] and scales uint8 [..., N, K/32], got "
                         f"{packed.dtype} {list(packed.shape)} and {scales.dtype} {list(scales.shape)}")
    K = 2 * packed.shape[-1]
    out = torch.empty(*packed.shape[:-1], K, dtype=dtype, device=packed.device)
    rows = out.numel() // K if K else 0
    if rows:
        block_r, block_k = 16, 128
        _expand_kernel[(triton.cdiv(rows, block_r), triton.cdiv(K, block_k))](
            packed.contiguous(), scales.contiguous(), out, rows, K, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return out


@expand_mxfp4.register_fake
def _(packed, scales, dtype):
    return packed.new_empty(*packed.shape[:-1], 2 * packed.shape[-1], dtype=dtype)
