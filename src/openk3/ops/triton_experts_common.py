"""What the Triton kernels over experts share (`ops.triton_mxfp4`'s row tiles, `ops.triton_expert_rows`'s rows):
decoding MXFP4's E2M1 codes and E8M0 scales (SPEC §13), and split-K: programs that share one output's inputs, each
over a part of K, their fp32 partial sums added after."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT_TARGET = 1024  # programs a launch aims for (~8 per SM of an H100 / H200) when it splits K
# steps (of BLOCK_K inputs) each split keeps: kimi-linear-48b's experts at batch 1 on an H100 (bench/RESULTS.md,
# 2026-12-06): gate_up (18 steps) 47 -> 39 us in two splits of 9, down (8 steps) 25 -> 28 us in two of 4
MIN_SPLIT_STEPS = 8


@triton.jit
def e8m0_values(s):
    """E8M0 bytes -> fp32 2^(s - 127): the bit pattern s << 23, except 0 (2^-127, an fp32 subnormal) and 0xFF (NaN)."""
    s = s.to(tl.int32)
    value = (s << 23).to(tl.float32, bitcast=True)
    value = tl.where(s == 0, 5.877471754111438e-39, value)
    return tl.where(s == 255, float("nan"), value)


@triton.jit
def e2m1_values(code):
    """4-bit E2M1 codes (sign in bit 3) -> fp32 values: bits 0-2 to fp16 bits 9-11, the sign to bit 15, times 2^14
    (in fp16, two values an instruction on a GPU; exact)."""
    c = code.to(tl.uint16)
    half = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True)
    return (half * 16384.0).to(tl.float32)


@triton.jit
def e2m1_word_values(words, i: tl.constexpr):
    """Code i (bits 4i..4i+3, sign in the top one) of each int32 word of 8 packed E2M1 codes -> its fp32 value: the
    word shifted so that the code's sign lands on bit 31, its 3 magnitude bits then moved to bits 22-24 (the
    exponent's low 2 bits and the mantissa's top one: fp32's 2^(e - 127) (1 + m / 2), and 2^-126 m / 2 for e = 0,
    is E2M1's 2^(e - 1) (1 + m / 2), resp. m / 2, times 2^-126; 0.5 the subnormal 2^-127), then times 2^126 (exact:
    no flush to zero). About 5 instructions a code on sm_90, against ~12 for `e2m1_values` on bytes."""
    t = words << (28 - 4 * i)
    bits = (t & -2147483648) | ((t >> 6) & 0x01C00000)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def word_columns(x):
    """x [W, 8] -> its 8 columns [W] (register moves when a thread holds a row's 8)."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], 4, 2)))  # columns 0 2 4 6 | 1 3 5 7
    a0, a1 = tl.split(tl.reshape(a, (x.shape[0], 2, 2)))  # 0 4 | 2 6
    b0, b1 = tl.split(tl.reshape(b, (x.shape[0], 2, 2)))  # 1 5 | 3 7
    c0, c4 = tl.split(a0)
    c2, c6 = tl.split(a1)
    c1, c5 = tl.split(b0)
    c3, c7 = tl.split(b1)
    return c0, c1, c2, c3, c4, c5, c6, c7


def _code_pair_asm(i: int, unscaled_fp32: bool = False) -> str:
    """PTX for `e2m1_code_pair`'s codes i and i + 4 of word $2 (bits 4i and 4i + 16 on: one shift moves both): their
    magnitude bits to bf16 bits 6-8 of each half, their signs to bits 15, the pair times 2^126 (`e2m1_word_values`'
    bit placement in bf16; code 0.5 is the bf16 subnormal 2^-127, kept), then times the scale pair $3 into bf16
    outputs $0, $1, or (unscaled_fp32, `e2m1_code_pair_fp32`) widened into fp32 outputs $0, $1."""
    magnitude = f"shl.b32 m, $2, {6 - 4 * i};" if i < 2 else f"shr.u32 m, $2, {4 * i - 6};"
    sign = f"shl.b32 s, $2, {12 - 4 * i};" if i < 3 else "mov.b32 s, $2;"
    out = "shl.b32 $0, m, 16; and.b32 $1, m, 0xFFFF0000;" if unscaled_fp32 else \
        "mul.rn.bf16x2 m, m, $3; mov.b32 {$0, $1}, m;"
    return ("{ .reg .b32 m, s, c; mov.b32 c, 0x7E807E80; " + magnitude + " " + sign + " and.b32 m, m, 0x01C001C0; "
            "and.b32 s, s, 0x80008000; or.b32 m, m, s; mul.rn.bf16x2 m, m, c; " + out + " }")


# the PTX of each code pair i (Triton takes inline assembly as a constexpr string)
CODE_PAIRS = tl.constexpr(tuple(_code_pair_asm(i) for i in range(4)))
CODE_PAIRS_FP32 = tl.constexpr(tuple(_code_pair_asm(i, unscaled_fp32=True) for i in range(4)))


@triton.jit
def e8m0_bf16_pairs(s):
    """E8M0 bytes -> int32s holding the scale 2^(s - 127) as bf16 in both halves: the bits s << 7, except 0 (0x40,
    the subnormal 2^-127) and 0xFF (0x7FC0, NaN: bit 6 added to infinity's 0x7F80 when s + 1 reaches 256)."""
    s = s.to(tl.int32)
    half = tl.maximum(s << 7, 0x40) | (((s + 1) >> 2) & 0x40)
    return half | (half << 16)


@triton.jit
def e2m1_code_pair_fp32(words, i: tl.constexpr, ASM: tl.constexpr):
    """Codes i and i + 4 (i < 4) of each int32 word of 8 E2M1 codes as fp32 values (no scale): PTX in bf16x2 on a
    CUDA GPU (ASM; 7 instructions a pair on sm_90), `e2m1_word_values` in the interpreter."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(CODE_PAIRS_FP32[i], "=r,=r,r", [words], dtype=(tl.float32, tl.float32),
                                           is_pure=True, pack=1)
    else:
        lo = e2m1_word_values(words, i)
        hi = e2m1_word_values(words, i + 4)
    return lo, hi


@triton.jit
def e2m1_code_pair(words, scale_pairs, i: tl.constexpr, ASM: tl.constexpr):
    """Codes i and i + 4 (i < 4) of each int32 word of 8 E2M1 codes, times their scale (`e8m0_bf16_pairs`), as two
    tensors of the words' shape holding the exact values. ASM (a CUDA GPU): both at once in bf16x2 arithmetic, 6
    instructions a pair on sm_90 (`_code_pair_asm`); else (the Triton interpreter, whose fp32 -> bf16 cast flushes
    subnormals) in fp32 from `e2m1_word_values`."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(CODE_PAIRS[i], "=h,=h,r,r", [words, scale_pairs],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        scale = (scale_pairs << 16).to(tl.float32, bitcast=True)  # the low half's bf16, widened
        lo, hi = e2m1_code_pair_fp32(words, i, False)
        lo, hi = lo * scale, hi * scale
    return lo, hi


@triton.jit
def e2m1_code_pairs(words, scale_pairs, ASM: tl.constexpr):
    """All four `e2m1_code_pair`s of each word: (code 0, code 4, code 1, code 5, code 2, code 6, code 3, code 7)."""
    lo0, hi0 = e2m1_code_pair(words, scale_pairs, 0, ASM)
    lo1, hi1 = e2m1_code_pair(words, scale_pairs, 1, ASM)
    lo2, hi2 = e2m1_code_pair(words, scale_pairs, 2, ASM)
    lo3, hi3 = e2m1_code_pair(words, scale_pairs, 3, ASM)
    return lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3


@triton.jit
def mxfp4_pair_weights(words, scale_pairs, ASM: tl.constexpr):
    """int32 words [R, W] of 8 E2M1 codes each and their scales (`e8m0_bf16_pairs`, [R, W]) -> the weights
    [R, 8 W] (bf16 with ASM, else fp32), in pair order: input 8 w + 2 i + j holds code i + 4 j of word w (each pair
    of `e2m1_code_pair` stays one register; `pair_order` puts the other operand's inputs in this order)."""
    lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3 = e2m1_code_pairs(words, scale_pairs, ASM)
    # tl.join stacks on a new last axis: [R, W, i // 2, i % 2] for each j, then j last, so each pair is adjacent
    lo = tl.join(tl.join(lo0, lo2), tl.join(lo1, lo3))
    hi = tl.join(tl.join(hi0, hi2), tl.join(hi1, hi3))
    return tl.reshape(tl.join(lo, hi), (words.shape[0], 8 * words.shape[1]))


@triton.jit
def pair_order(x):
    """x [M, K] (K a multiple of 8) with its inputs in `mxfp4_pair_weights`' order: position 8 w + 2 i + j takes
    input 8 w + i + 4 j (register moves when a thread holds 8 consecutive inputs)."""
    groups = tl.reshape(x, (x.shape[0], x.shape[1] // 8, 2, 4))  # [M, W, j, i]
    return tl.reshape(tl.permute(groups, (0, 1, 3, 2)), (x.shape[0], x.shape[1]))


PTX_DECODE = True  # False: the Triton twin on GPUs too (bench/mxfp4_experts.py's peer rows)


def ptx_decode(where: torch.Tensor | torch.device) -> bool:
    """Whether the kernels decode MXFP4 codes with PTX (`e2m1_code_pair`, `e2m1_code_pair_fp32`) for tensors on this
    device (or this tensor's): on NVIDIA GPUs; the Triton interpreter (CPU tensors) runs the same arithmetic in
    Triton."""
    device = where.device if isinstance(where, torch.Tensor) else where
    return PTX_DECODE and device.type == "cuda" and torch.version.hip is None


def k_splits(tiles: int, K: int, block_k: int) -> int:
    """Programs that share one output tile's inputs (split-K): a decode step's few row tiles leave most of the GPU
    idle, each program walking all K; split until there are about SPLIT_TARGET programs, keeping MIN_SPLIT_STEPS
    steps each."""
    splits = 1
    while tiles * splits * 2 <= SPLIT_TARGET and K // (block_k * splits * 2) >= MIN_SPLIT_STEPS:
        splits *= 2
    return splits


def split_output(x_sorted: torch.Tensor, N: int, splits: int, block_k: int) -> tuple[torch.Tensor, int]:
    """The output buffer [splits, M, N] of `splits` programs per output over parts of K (whole steps of `block_k`
    inputs: scales stay aligned; fp32 partial sums when split, else x's dtype) and the inputs each part takes."""
    K = x_sorted.shape[1]
    k_split = triton.cdiv(triton.cdiv(K, min(splits, triton.cdiv(K, block_k))), block_k) * block_k
    splits = triton.cdiv(K, k_split)
    dtype = x_sorted.dtype if splits == 1 else torch.float32
    return torch.empty(splits, x_sorted.shape[0], N, dtype=dtype, device=x_sorted.device), k_split


def add_splits(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return out[0] if out.shape[0] == 1 else out.sum(0).to(dtype)
