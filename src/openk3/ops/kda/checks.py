"""Argument checks shared by `openk3.ops.kda.kda` and the backends and wrappers that take its arguments directly
(a module of its own, so the Triton kernels need not import the package that dispatches to them)."""

from __future__ import annotations

import math

import torch


def check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    """Shape/dtype validation shared by every backend; errors name the argument."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B,T,H,K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have q's shape {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B,T,H,V] with B,T,H = {B},{T},{H}, got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B,T,H] = {(B, T, H)}, got {tuple(beta.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"{name} must be a floating tensor (fp32/bf16/fp16/fp64), got {x.dtype}")
    V = v.shape[-1]
    n_states = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1, got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D tensor [N+1] of sequence offsets")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        offsets = cu_seqlens.tolist()
        if offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {offsets}")
        n_states = len(offsets) - 1
    if initial_state is not None and tuple(initial_state.shape) != (n_states, H, K, V):
        raise ValueError(
            f"initial_state must be [{n_states},{H},{K},{V}] (one per sequence), got {tuple(initial_state.shape)}"
        )


def check_kda_options(gate_min, state_offsets, T: int, cu_seqlens) -> tuple[int, ...] | None:
    """gate_min a finite log decay <= 0; state_offsets (returned as a tuple of ints) within (0, T], never with
    cu_seqlens."""
    if gate_min is not None and not (math.isfinite(gate_min) and gate_min <= 0):
        raise ValueError(f"gate_min must be a finite log decay <= 0, got {gate_min}")
    if state_offsets is None:
        return None
    offsets = tuple(int(t) for t in state_offsets)
    if cu_seqlens is not None:
        raise ValueError("state_offsets cannot be combined with cu_seqlens (offsets are per sequence of a batch)")
    bad = [t for t in offsets if not 0 < t <= T]
    if bad:
        raise ValueError(f"state_offsets must lie in (0, T={T}], got {bad}")
    return offsets
