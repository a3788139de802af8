"""Kimi Delta Attention: one entry point, several backends (SPEC-K3 §2).

`kda(...)` is the contract every backend meets: the token-by-token recurrence (the specification),
the chunked WY/UT form in plain PyTorch (fast on CPU, any T), and the Triton kernels on CUDA.
`backend="auto"` picks Triton for CUDA tensors when Triton is importable and the chunked form otherwise;
the environment variable OPENK3_KDA_BACKEND (recurrent | chunked | triton) overrides "auto".
"""

from __future__ import annotations

import os

import torch

from openk3.ops.kda.chunked import kda_chunked
from openk3.ops.kda.reference import kda_recurrent

BACKENDS = ("auto", "recurrent", "chunked", "triton")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"kda backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    forced = os.environ.get("OPENK3_KDA_BACKEND")
    if forced:
        if forced not in BACKENDS[1:]:
            raise ValueError(f"OPENK3_KDA_BACKEND must be one of {BACKENDS[1:]}, got {forced!r}")
        return forced
    return "triton" if device.type == "cuda" and _triton_available() else "chunked"


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


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention over [B,T,H,K] inputs; returns (o [B,T,H,V] in v's dtype, final state fp32 or None).

    g is the already-activated log decay (<= 0), beta the already-activated write strength in (0, 1),
    scale defaults to K^-0.5 and multiplies q.
    """
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    kwargs = dict(
        scale=scale, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens
    )
    name = resolve_backend(backend, q.device)
    if name == "recurrent":
        return kda_recurrent(q, k, v, g, beta, **kwargs)
    if name == "chunked":
        return kda_chunked(q, k, v, g, beta, **kwargs)
    from openk3.ops.kda.triton import kda_triton

    return kda_triton(q, k, v, g, beta, **kwargs)


__all__ = ["kda", "kda_recurrent", "kda_chunked", "resolve_backend", "check_kda_inputs"]
