"""Kimi Delta Attention: one entry point, several backends (SPEC-K3 §2).

`kda(...)` is the contract every backend meets: the token-by-token recurrence (the specification),
the chunked WY/UT form in plain PyTorch (fast on CPU, any T), and the Triton kernels on CUDA.
`resolve_backend` is the one place "auto" becomes a backend; callers that want another pass it explicitly
(the CLI turns OPENK3_KDA_BACKEND into such an argument; nothing here reads the environment).
"""

from __future__ import annotations

import math

import torch

from openk3.ops.kda.chunked import CHUNK_SIZE, kda_chunked, kda_chunked_with_states
from openk3.ops.kda.reference import kda_recurrent

BACKENDS = ("auto", "recurrent", "chunked", "triton")
SHORT_CALL_TOKENS = 8  # chunked calls this short that want states off the chunk grid run the recurrence


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device, num_tokens: int) -> str:
    """The backend a call of `num_tokens` tokens per sequence on `device` runs: `backend` itself unless it is
    "auto"; for "auto" the Triton kernels on CUDA (when triton imports), on CPU the recurrence for one token
    (the cheapest form there) and the chunked form otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"kda backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if torch.device(device).type == "cuda" and _triton_available():
        return "triton"
    return "recurrent" if num_tokens == 1 else "chunked"


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


def _check_options(gate_min, state_offsets, T: int, cu_seqlens) -> tuple[int, ...] | None:
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


def _split_at(q, k, v, g, beta, offsets, initial_state, **kwargs):
    """KDA over segments that end at each offset, chained through their final states (the same result as one
    call): (o, final state, the states at the offsets)."""
    outputs, states, state, start = [], [], initial_state, 0
    for end in [*sorted(set(offsets)), q.shape[1]]:
        if end > start:
            o, state = kda(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end], beta[:, start:end],
                           initial_state=state, output_final_state=True, **kwargs)
            outputs.append(o)
            states.append((end, state))
        start = end
    at = dict(states)
    return torch.cat(outputs, dim=1), state, [at[t] for t in offsets]


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
    gate_min: float | None = None,
    state_offsets: tuple[int, ...] | None = None,
):
    """Kimi Delta Attention over [B,T,H,K] inputs; returns (o [B,T,H,V] in v's dtype, final state fp32 or None).

    g is the already-activated log decay (<= 0), beta the already-activated write strength in (0, 1),
    scale defaults to K^-0.5 and multiplies q. `gate_min`: a lower bound of g the caller guarantees (K3's
    -5); every backend clamps g there, and the Triton kernels take their faster bounded mode for it (any g
    is exact without it). `state_offsets`: also return the fp32 states after those many tokens, (o, final
    state or None, [states]) — from the same pass where the backend can (chunk-aligned offsets), by chained
    calls otherwise. `cu_seqlens` (int32/int64 [N+1], B = 1) may stay on the host: it is validated there and
    queued to the GPU kernels from pinned memory, where a device copy must be read back (the host waits).
    """
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    T = q.shape[1]
    offsets = _check_options(gate_min, state_offsets, T, cu_seqlens)
    name = resolve_backend(backend, q.device, T)
    kwargs = dict(scale=scale, cu_seqlens=cu_seqlens)
    if offsets is not None and any(t % CHUNK_SIZE for t in offsets):
        if name == "chunked" and T <= SHORT_CALL_TOKENS:
            # e.g. speculative verification, a state after every drafted token: the recurrence yields each state
            # as it goes, the chunked form would run one padded chunk per segment (CPU, 8 sequences x 4 tokens,
            # 3 offsets: 2.5 ms against 13.3 ms; bench/RESULTS.md, speculative decoding). Same results.
            name = "recurrent"
        o, final, states = _split_at(q, k, v, g, beta, offsets, initial_state, backend=name, gate_min=gate_min,
                                     **kwargs)
        return o, (final if output_final_state else None), states
    if name == "triton":
        from openk3.ops.kda.triton import kda_triton

        return kda_triton(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                          gate_min=gate_min, state_offsets=offsets, **kwargs)
    if gate_min is not None:
        g = g.clamp_min(gate_min)
    if offsets is not None:
        if name == "chunked":
            o, states, final = kda_chunked_with_states(q, k, v, g, beta, offsets, scale=scale,
                                                       initial_state=initial_state)
        else:
            o, final, states = _split_at(q, k, v, g, beta, offsets, initial_state, backend=name, **kwargs)
        return o, (final if output_final_state else None), states
    fn = kda_recurrent if name == "recurrent" else kda_chunked
    return fn(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state, **kwargs)


__all__ = ["kda", "kda_recurrent", "kda_chunked", "resolve_backend", "check_kda_inputs", "BACKENDS"]
