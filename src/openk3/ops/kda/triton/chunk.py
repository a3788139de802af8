"""`kda_triton` and `kda_triton_fused`: the chunked Triton kernels behind an autograd.Function (SPEC-K3 §2).

Saved for backward: the inputs as given (for the fused variant the raw projections and logits, so no
activated copy stays alive; A_log and dt_bias are kept on the context), the initial state, and what the
forward's kernels produced that the backward reads: the pseudo-values U - W S (pvs, [T,H,V]) and the chunk
terms W, Qd, kg, Aqk, gc, in the kernels' operand dtype (bf16 for 16-bit inputs, fp32 for fp32; gc fp32):
about V + 3 K + 16 values a token and head, where recomputing them would take a product with every state and a
second prepare kernel (a faster forward + backward for somewhat more memory: docs/kernels.md, bench/RESULTS.md).
Recomputed in backward: the state at the start of every chunk (K V / 16 values a token and head), replayed from
pvs, kg and gc (chunk_bwd.replay_states), and the activations (fused variant), inside the kernels.

Gates: any g <= 0 is exact (to rounding). A declared floor (`gate_min`, K3's -5) clamps g there and, when it is
>= BOUNDED_GATE_MIN, selects the faster bounded mode of the kernels (chunk_fwd.py); without one the kernels take
block-local decay anchors that hold for any gate, Kimi Linear's unbounded softplus gate included.
"""

from __future__ import annotations

import torch

from openk3.ops.kda.checks import check_kda_inputs, check_kda_options
from openk3.ops.kda.triton.activations import GATES, activations_backward
from openk3.ops.kda.triton.chunk_bwd import chunk_kda_bwd, reverse_pass
from openk3.ops.kda.triton.chunk_fwd import (
    GateSpec,
    chunk_kda_final_state,
    chunk_kda_fwd,
    gate_spec,
    prepare,
    state_block,
)
from openk3.ops.kda.triton.layout import CHUNK, chunk_layout
from openk3.ops.transfer import to_device

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _flat(B: int, T: int, *xs: torch.Tensor) -> list[torch.Tensor]:
    """[B,T,H,*] -> contiguous [B*T,H,*]: the kernels' token-major layout (beta [B,T,H] -> [B*T,H])."""
    return [x.reshape(B * T, *x.shape[2:]).contiguous() for x in xs]


class _KDAChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, scale, cu_seqlens, output_final_state, save,
                gate: GateSpec, checkpoints):
        """With fused activations in `gate` (A_log, dt_bias given): g and beta are logits, q and k unnormalised.
        `checkpoints`: None or (slot per chunk, number of slots); the states there come out non-differentiable."""
        B, T, H, K = q.shape
        V = v.shape[-1]
        *flat, beta_flat = _flat(B, T, q, k, v, g, beta)
        h0 = None if initial_state is None else initial_state.float().contiguous()
        lay = chunk_layout(B, T, cu_seqlens, q.device)
        o, ht, saved, ckpt = chunk_kda_fwd(*flat, beta_flat, scale, h0, output_final_state, lay, save_states=save,
                                           gate=gate, checkpoints=checkpoints)
        if save:
            ctx.save_for_backward(*flat, beta_flat, *saved)
            ctx.lay, ctx.scale, ctx.shape, ctx.has_h0 = lay, scale, (B, T, H, K, V), h0 is not None
            ctx.h0_dtype = None if initial_state is None else initial_state.dtype
            ctx.gate = gate  # the gate's A_log / dt_bias: fp32 copies (or the fp32 parameters)
            ctx.param_dtypes = None if not gate.fused else (A_log.dtype, dt_bias.dtype, dt_bias.shape)
        if ckpt is not None:
            ctx.mark_non_differentiable(ckpt)
        return o.reshape(B, T, H, V), ht, ckpt

    @staticmethod
    def backward(ctx, do, dht, _dckpt):
        q, k, v, g, beta, *saved = ctx.saved_tensors
        B, T, H, K, V = ctx.shape
        gate = ctx.gate
        do = do.reshape(B * T, H, V).contiguous()
        dht = None if dht is None else dht.float().contiguous()
        dq, dk, dv, dg, dbeta, dh0 = chunk_kda_bwd(q, k, v, g, beta, ctx.scale, saved, do, dht, ctx.has_h0,
                                                   ctx.lay, gate)
        d_A_log = d_dt_bias = None
        if gate.fused:
            a_dtype, b_dtype, b_shape = ctx.param_dtypes
            dq, dk, dg, dbeta, d_A_log, d_dt_bias = activations_backward(
                q, k, g, beta, gate.A_log, gate.dt_bias, dq, dk, dg, dbeta, g_min=gate.g_min, kimi=gate.kimi)
            d_A_log, d_dt_bias = d_A_log.to(a_dtype), d_dt_bias.reshape(b_shape).to(b_dtype)
        grads = [x.reshape(B, T, H, -1) for x in (dq, dk, dv, dg)]
        dh0 = None if dh0 is None else dh0.to(ctx.h0_dtype)
        return (*grads, dbeta.reshape(B, T, H), d_A_log, d_dt_bias, dh0, *[None] * 7)


def checkpoint_slots(offsets: tuple[int, ...], T: int, device) -> tuple[torch.Tensor, int] | None:
    """The state pass's checkpoint table for chunk-aligned `offsets` < T (the state after t tokens is the state
    before chunk t / CHUNK): slot per chunk (-1: none) and the number of slots; None without such offsets."""
    inner = sorted({t for t in offsets if t < T})
    if not inner:
        return None
    slots = [-1] * -(-T // CHUNK)
    for n, t in enumerate(inner):
        slots[t // CHUNK] = n
    return to_device(slots, device, torch.int32), len(inner)  # queued: a serving prefill must not wait here


# torch.compile (compile_blocks) breaks its graph here instead of tracing into the kernels: they are fused already,
# and Inductor's re-compilation of them fails on torch 2.11 (the float `scale` typed fp64 inside a tl.dot).
@torch.compiler.disable
def _run(q, k, v, g, beta, A_log, dt_bias, gate, scale, initial_state, output_final_state, cu_seqlens,
         state_offsets):
    K, T = q.shape[-1], q.shape[1]
    scale = K**-0.5 if scale is None else float(scale)
    out_dtype = v.dtype
    if q.dtype not in _KERNEL_DTYPES:
        q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    offsets = tuple(state_offsets or ())
    bad = [t for t in offsets if not 0 < t <= T or t % CHUNK]
    if bad:
        raise ValueError(f"state_offsets must be multiples of {CHUNK} in (0, T={T}] for the Triton backend, got {bad}")
    if offsets and cu_seqlens is not None:
        raise ValueError("state_offsets cannot be combined with cu_seqlens")
    leaves = [x for x in (q, k, v, g, beta, A_log, dt_bias, initial_state) if x is not None]
    save = torch.is_grad_enabled() and any(x.requires_grad for x in leaves)  # keep per-chunk states for backward
    need_final = output_final_state or T in offsets
    o, ht, ckpt = _KDAChunkFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, cu_seqlens,
                                          need_final, save, gate, checkpoint_slots(offsets, T, q.device))
    if state_offsets is None:
        return o.to(out_dtype), ht
    inner = sorted({t for t in offsets if t < T})
    states = [ht if t == T else ckpt[inner.index(t)] for t in offsets]
    return o.to(out_dtype), (ht if output_final_state else None), states


def kda_triton(
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
    gate_min: float | None = None,
    state_offsets: tuple[int, ...] | None = None,
):
    """Chunked KDA on the Triton kernels; the contract of `openk3.ops.kda.kda` (pre-activated g and beta).

    Any gate g <= 0 is exact to rounding; `gate_min`, a lower bound the caller guarantees, clamps g there and,
    when >= -5.5 (K3's -5), runs the faster bounded kernels. With `state_offsets` (multiples of 16 in (0, T],
    no cu_seqlens) the fp32 states after those many tokens come back too, from the same pass (not
    differentiable): returns (o, final state or None, states). fp64 inputs compute in fp32.
    """
    return _run(q, k, v, g, beta, None, None, gate_spec(gate_min), scale, initial_state, output_final_state,
                cu_seqlens, state_offsets)


def kda_triton_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    gate: str = "k3",
    g_min: float = -5.0,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_offsets: tuple[int, ...] | None = None,
):
    """`kda_triton` on `kda_activations(q, k, f, b, A_log, dt_bias, gate=gate, g_min=g_min)` with the activations
    fused into the chunk kernels: they read the raw projections q, k [B,T,H,K], the gate logits f [B,T,H,K] and
    the beta logits b [B,T,H] and apply the L2 norms, the gate and the sigmoid themselves, forward and backward,
    so the activated tensors are never written. Differentiable in every input, A_log [H] and dt_bias [H,K] (or
    [H*K]) included. K3's gate is bounded by g_min (the bounded kernels when g_min >= -5.5), Kimi Linear's by
    nothing (the any-gate kernels)."""
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    spec = gate_spec(None, A_log.float().contiguous(), dt_bias.float().reshape(-1).contiguous(), kimi=gate == "kimi",
                     g_min=float(g_min))
    return _run(q, k, v, f, b, A_log, dt_bias, spec, scale, initial_state, output_final_state, cu_seqlens,
                state_offsets)


@torch.compiler.disable
def initial_state_grad_triton(q, k, v, g, beta, do, *, scale=None, cu_seqlens=None, gate_min=None,
                              final_state_grad=None) -> torch.Tensor:
    """`openk3.ops.kda.transition.kda_initial_state_grad` on the kernels: the prepare kernel's chunk terms (no U)
    and the reverse state pass from the final state's gradient (`final_state_grad`, default zero), whose dh0 it
    is; fp32 [N,H,K,V']. The pass's other outputs (dU, the per-chunk state gradients) are never written: no
    intra-chunk backward runs. final_state_grad may be wider than do, [N,H,K,V'] with V' >= V: its columns past V
    take zero dO (from [0 | I] the result is [dS0 | M^T], M the span's transition)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dht = final_state_grad
    if dht is not None and (dht.dim() != 4 or tuple(dht.shape[:3]) != (N, H, K) or dht.shape[-1] < V):
        raise ValueError(f"final_state_grad must be [{N},{H},{K},V'] with V' >= V = {V}, got {tuple(dht.shape)}")
    scale = K**-0.5 if scale is None else float(scale)
    if q.dtype not in _KERNEL_DTYPES:
        q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    *flat, do = _flat(B, T, q, k, v, g, beta, do.to(v.dtype))
    lay = chunk_layout(B, T, cu_seqlens, q.device)
    terms = prepare(*flat, scale, lay, gate_spec(gate_min), with_u=False)
    dht = None if dht is None else dht.float().contiguous()
    width = V if dht is None else dht.shape[-1]
    return reverse_pass(terms, do, dht, True, lay, state_block(lay.n_seqs, H, width), q.dtype, store=False)[2]


@torch.compiler.disable
def kda_final_state_triton(k, v, g, beta, *, initial_state=None, cu_seqlens=None, gate_min=None) -> torch.Tensor:
    """The final state of each sequence alone: `kda_triton(q, k, v, g, beta, ..., output_final_state=True)[1]`
    without the outputs, so without q (the prepare kernel skips Qd and Aqk, the state pass skips O). fp32
    [N,H,K,V'] (N = B, or the number of sequences with cu_seqlens). initial_state (any float dtype) may be wider
    than v, [N,H,K,V'] with V' >= V: its columns past V then take zero values, as if v were zero-padded to V'
    (KCP's transition, `openk3.ops.kda.transition`). Not differentiable: raises if asked for a gradient."""
    check_kda_inputs(k, k, v, g, beta, None, cu_seqlens)
    check_kda_options(gate_min, None, k.shape[1], cu_seqlens)
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and (initial_state.dim() != 4 or tuple(initial_state.shape[:3]) != (N, H, K)
                                      or initial_state.shape[-1] < V):
        raise ValueError(f"initial_state must be [{N},{H},{K},V'] with V' >= V = {V}, got "
                         f"{tuple(initial_state.shape)}")
    leaves = [x for x in (k, v, g, beta, initial_state) if x is not None]
    if torch.is_grad_enabled() and any(x.requires_grad for x in leaves):
        raise RuntimeError("kda_final_state_triton is not differentiable: call it under torch.no_grad() (or use "
                           "kda_triton(..., output_final_state=True))")
    if k.dtype not in _KERNEL_DTYPES:
        k, v, g, beta = (x.float() for x in (k, v, g, beta))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    lay = chunk_layout(B, T, cu_seqlens, k.device)
    return chunk_kda_final_state(*_flat(B, T, k, v, g, beta), h0, lay, gate_spec(gate_min))
