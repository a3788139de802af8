"""The MXFP4 row tiles (`ops.triton_mxfp4`, method "dequant") on Hopper, written in Gluon so that the dequantized
weights go from registers straight into the warpgroup MMA.

The Triton tile computes out^T = W x^T with the dequantized weights as the MMA's first operand, which Hopper's
wgmma may take from registers; but Triton lays the decoded weights out by how their words were loaded (a block's 4
words in one thread) and converts them to the MMA's operand layout through shared memory, a store and a load of
every weight, which bound the 64-token MoE layer (Nsight Compute: bench/RESULTS.md, 2026-12-07 eleventh session).
Here each thread loads exactly the codes its part of the operand needs, so that conversion is a renaming of
registers (`gl.convert_layout(..., assert_trivial=True)` checks it when the kernel compiles).

The operand layout of a 64 x 16 weight slice (one warp's 16 rows, 16 inputs) gives lane l rows l // 4 and
l // 4 + 8 and, of the 16 inputs, the pairs at 2 (l % 4) and 2 (l % 4) + 8. Over a step of 128 inputs a thread
thus holds 32 inputs of each of its two rows, and which 32 is ours to choose, as long as the rows' inputs x are
put in the same order: thread l % 4 = q takes MXFP4 block q of the step (inputs 32 q .. 32 q + 31: 4 int32 words,
one 16-byte load, one scale byte). Word w's codes p and p + 4 (`e2m1_code_pair`: inputs 32 q + 8 w + p and + 4)
form one bf16 pair of the operand, at operand position kk = 32 w + 8 p + 2 q + t (t = 0, 1 the pair's halves):
the input at step offset 32 q + 8 w + p + 4 t. x's tile is loaded in order and permuted to kk in registers before
it is stored to shared memory as the MMA's second operand.

Grid, tiles of one expert's rows, split-K and output as `ops.triton_mxfp4._mxfp4_grouped_matmul_kernel` (16 to
128 rows a tile; 64 or 128 weight rows, `tile_warps`); bf16 rows, NVIDIA sm_90 (wgmma) only: `usable` says when;
elsewhere the Triton tile runs.
"""

from __future__ import annotations

import torch
import triton

from openk3.ops.triton_experts_common import e2m1_code_pairs, e8m0_bf16_pairs, ptx_decode

# the Gluon versions this kernel was compiled with (3.6 on a GPU, 3.9 offline); Gluon's API moves between releases
MIN_TRITON = (3, 6)

try:
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < MIN_TRITON:
        raise ImportError(f"triton {triton.__version__}")
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
    from triton.runtime.jit import constexpr_function
except ImportError:  # a Triton without Gluon, or older: the Triton tile serves
    gluon = None

BLOCK_K = 128  # inputs a step: one MXFP4 block for each lane of a quad
GLUON_TILES = True  # False: the Triton tile on Hopper too (bench/mxfp4_experts.py's peer rows)


# warps a tile (16 weight rows each; a warpgroup's MMA takes 64) by its rows: 4 up to 64 rows, 8 for 128 (where 4
# spill: 255 registers). kimi-linear-48b's layer on an H100 (2026-12-07, twelfth session): 4 warps faster by 1-3% at
# 2-256 tokens; 4096 tokens 4,753 us with 4 warps and 64-row tiles, 3,735 with 8 and 128-row tiles
def tile_warps(block_m: int) -> int:
    return 8 if block_m > 64 else 4


def block_n(block_m: int) -> int:
    """Weight rows a tile of block_m rows takes: 16 a warp (the MMA's row slices)."""
    return 16 * tile_warps(block_m)


def usable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the Gluon tile runs for rows of this dtype on this device: bf16 rows on an NVIDIA sm_90 GPU (Hopper's
    wgmma) with Gluon."""
    return (GLUON_TILES and gluon is not None and dtype == torch.bfloat16 and ptx_decode(device)
            and torch.cuda.get_device_capability(device) == (9, 0))


if gluon is not None:

    @constexpr_function
    def _words_layout(warps):
        """Words [16 warps rows, 4 blocks, 4 words]: warp v takes rows 16 v + l // 4 and + 8 (lane l), block l % 4,
        its 4 words in registers (one 16-byte load a row)."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16 << i, 0, 0] for i in range(warps.bit_length() - 1)], block_bases=[],
            shape=[16 * warps, 4, 4])

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _step(words_ptr, s_ptr, x_ptr, word_offs, scale_offs, x_offs, w_ok, x_ok, q, kx, k0, k_end):
        """A step's codes (int32 words [BLOCK_N, 4 blocks, 4]), scale bytes ([BLOCK_N, 4 blocks]) and rows' inputs
        ([BLOCK_M, 128], in order) at input k0; nothing at or past k_end."""
        blocks_ok = w_ok & (k0 // 32 + q < k_end // 32)
        words = gl.load(words_ptr + word_offs + k0 // 8, mask=gl.expand_dims(blocks_ok, 2), other=0)
        scales = gl.load(s_ptr + scale_offs + k0 // 32, mask=blocks_ok, other=127)
        x = gl.load(x_ptr + x_offs + k0, mask=x_ok & (k0 + kx < k_end), other=0.0)
        return words, scales, x

    @gluon.jit
    def _operand(words, scales, A_LAYOUT: gl.constexpr):
        """Words [R, 4 blocks q, 4 words w] and their blocks' scale bytes [R, 4] -> the dequantized bf16 weights
        [R, 128] in the MMA's operand layout, position kk = 32 w + 8 p + 2 q + t holding code p + 4 t of word w."""
        pairs = gl.expand_dims(e8m0_bf16_pairs(scales), 2) + words * 0
        lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3 = e2m1_code_pairs(words, pairs, True)
        # join stacks on a new last axis: [R, q, w, t] for each p, then p = p0 + 2 p1: [R, q, w, t, p0, p1]
        low = gl.join(gl.join(lo0, hi0), gl.join(lo1, hi1))
        high = gl.join(gl.join(lo2, hi2), gl.join(lo3, hi3))
        values = gl.permute(gl.join(low, high), (0, 2, 5, 4, 1, 3))  # [R, w, p1, p0, q, t]
        return gl.convert_layout(gl.reshape(values, (words.shape[0], 128)), A_LAYOUT, assert_trivial=True)

    @gluon.jit
    def _operand_order(x):
        """Rows' inputs [BLOCK_M, 128] in order -> in the operand's order: position 32 w + 8 p + 2 q + t takes
        input 32 q + 8 w + p + 4 t."""
        parts = gl.reshape(x, (x.shape[0], 4, 4, 2, 4))  # [m, q, w, t, p]
        return gl.reshape(gl.permute(parts, (0, 2, 4, 1, 3)), (x.shape[0], 128))  # [m, w, p, q, t]

    @gluon.jit
    def _mxfp4_tiles_kernel(x_ptr, counts_ptr, w_ptr, s_ptr, out_ptr, M, N, K, E, K_SPLIT,
                            BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr, WARPS: gl.constexpr):
        """One [BLOCK_M rows, 16 WARPS weight rows] output tile over inputs [k_start, k_start + K_SPLIT) of split
        program_id(2), written to out[split] (out [splits, M, N]); the tile is found from `counts` as in the
        Triton tile."""
        BLOCK_N: gl.constexpr = 16 * WARPS
        COUNTS: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        WORDS: gl.constexpr = _words_layout(WARPS)
        SCALES: gl.constexpr = gl.SliceLayout(2, WORDS)
        ROWS: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        X_SHARED: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 128], gl.bfloat16)

        e_idx = gl.arange(0, BLOCK_E, layout=COUNTS)
        counts = gl.load(counts_ptr + e_idx, mask=e_idx < E, other=0).to(gl.int32)
        tiles = (counts + BLOCK_M - 1) // BLOCK_M
        pid_m = gl.program_id(0)
        e = gl.sum((gl.associative_scan(tiles, 0, _add) <= pid_m).to(gl.int32), axis=0)
        if e < E:
            before = e_idx < e
            tile = pid_m - gl.sum(gl.where(before, tiles, 0), axis=0)
            row0 = gl.sum(gl.where(before, counts, 0), axis=0) + tile * BLOCK_M
            rows_left = gl.sum(gl.where(e_idx == e, counts, 0), axis=0) - tile * BLOCK_M
            k_start = gl.program_id(2) * K_SPLIT
            k_end = gl.minimum(k_start + K_SPLIT, K)

            rn = gl.program_id(1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCALES))
            w_rows = gl.expand_dims(e.to(gl.int64) * N + rn, 1)  # [BLOCK_N, 1]: the expert's output rows
            q = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, SCALES)), 0)
            w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WORDS)))
            word_offs = gl.expand_dims(w_rows * (K // 8) + 4 * q, 2) + gl.expand_dims(gl.expand_dims(w, 0), 1)
            scale_offs = w_rows * (K // 32) + q
            w_ok = gl.expand_dims(rn < N, 1) & (q >= 0)
            rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ROWS))
            kx = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, ROWS)), 0)
            x_offs = gl.expand_dims((row0 + rm).to(gl.int64) * K, 1) + kx
            x_ok = gl.expand_dims(rm < rows_left, 1)

            words_ptr = w_ptr.to(gl.pointer_type(gl.int32))
            x_tile = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, 128], X_SHARED)
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=MMA)
            # each step's loads are issued one step ahead, so that two steps' loads are in flight (two steps ahead
            # was 1-4% slower at 2-256 tokens on an H100: more registers, no gain)
            words, scales, x = _step(words_ptr, s_ptr, x_ptr, word_offs, scale_offs, x_offs, w_ok, x_ok, q, kx,
                                     k_start, k_end)
            for k0 in range(k_start, k_end, 128):
                next_words, next_scales, next_x = _step(words_ptr, s_ptr, x_ptr, word_offs, scale_offs, x_offs,
                                                        w_ok, x_ok, q, kx, k0 + 128, k_end)
                x_tile.store(_operand_order(x))
                fence_async_shared()
                acc = warpgroup_mma(_operand(words, scales, A_LAYOUT), x_tile.permute((1, 0)), acc)
                words, scales, x = next_words, next_scales, next_x

            on = gl.program_id(1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
            om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
            out = out_ptr + gl.expand_dims((gl.program_id(2) * M + row0 + om).to(gl.int64) * N, 0) + \
                gl.expand_dims(on, 1)
            gl.store(out, acc.to(out_ptr.dtype.element_ty),
                     mask=gl.expand_dims(om < rows_left, 0) & gl.expand_dims(on < N, 1))


def launch(x_sorted: torch.Tensor, counts: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
           out: torch.Tensor, k_split: int, block_m: int, grid: tuple[int, int]) -> None:
    """The Gluon tiles into out [splits, M, N] over grid (row tiles, tiles of `block_n(block_m)` weight rows):
    `ops.triton_mxfp4.mxfp4_grouped_matmul_triton` sizes it, the splits and the tile rows, as for the Triton
    tile."""
    M, K = x_sorted.shape
    E, N, _ = packed.shape
    warps = tile_warps(block_m)
    _mxfp4_tiles_kernel[(*grid, out.shape[0])](
        x_sorted, counts, packed, scales, out, M, N, K, E, k_split, BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(E), WARPS=warps, num_warps=warps)
