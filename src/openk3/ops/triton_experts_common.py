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
