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


@triton.jit
def mxfp4_word_weights(words, scales):
    """int32 words [R, W] of 8 E2M1 codes each and their block scales (E8M0 bytes, one per word, [R, W]) -> the
    weights [R, 8 W] in fp32, input 8 w + i from code i of word w (the inverse of `word_columns`' order)."""
    scale = e8m0_values(scales)
    even = tl.join(tl.join(e2m1_word_values(words, 0) * scale, e2m1_word_values(words, 4) * scale),
                   tl.join(e2m1_word_values(words, 2) * scale, e2m1_word_values(words, 6) * scale))
    odd = tl.join(tl.join(e2m1_word_values(words, 1) * scale, e2m1_word_values(words, 5) * scale),
                  tl.join(e2m1_word_values(words, 3) * scale, e2m1_word_values(words, 7) * scale))
    return tl.reshape(tl.join(even, odd), (words.shape[0], 8 * words.shape[1]))


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
