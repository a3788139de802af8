"""Kimi Delta Attention: one entry point, several backends (SPEC-K3 §2).

`kda(...)` is the contract every backend meets: the token-by-token recurrence (the specification),
the chunked WY/UT form in plain PyTorch (fast on CPU, any T), and the Triton kernels on CUDA.
`resolve_backend` is the one place "auto" becomes a backend; callers that want another pass it explicitly
(the CLI turns OPENK3_KDA_BACKEND into such an argument; nothing here reads the environment).
"""

from __future__ import annotations

import torch

from openk3.ops.kda.checks import check_kda_inputs, check_kda_options
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
    offsets = check_kda_options(gate_min, state_offsets, T, cu_seqlens)
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
