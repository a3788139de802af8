"""`kda_triton` and `kda_triton_fused`: the chunked Triton kernels behind an autograd.Function (SPEC-K3 §2).

Saved for backward: the inputs as given (for the fused variant the raw projections and logits, so no
activated copy stays alive; A_log and dt_bias are kept on the context), the initial state's presence, and the
state at the start of every chunk (hs, in the kernels' operand dtype: bf16 for 16-bit inputs, fp32 for fp32).
Recomputed in backward: the activations (fused variant), the state-independent chunk terms (W, U, Qd, kg, Aqk,
gc; one token-parallel launch, cheaper than keeping four [T,H,K] tensors alive) and the pseudo-values U - W S.
"""

from __future__ import annotations

import torch

from openk3.ops.kda.triton.activations import GATES, activations_backward
from openk3.ops.kda.triton.chunk_bwd import chunk_kda_bwd
from openk3.ops.kda.triton.chunk_fwd import FusedActivation, chunk_kda_fwd
from openk3.ops.kda.triton.layout import chunk_layout

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _KDAChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, scale, cu_seqlens, output_final_state, save,
                gate):
        """gate None: g, beta activated. gate (kind, g_min): g and beta are logits, q and k unnormalised."""
        B, T, H, K = q.shape
        V = v.shape[-1]
        flat = [x.reshape(B * T, H, -1).contiguous() for x in (q, k, v, g)]
        beta_flat = beta.reshape(B * T, H).contiguous()
        act = None
        if gate is not None:
            act = FusedActivation(A_log.float().contiguous(), dt_bias.float().reshape(-1).contiguous(),
                                  kimi=gate[0] == "kimi", g_min=gate[1])
        h0 = None if initial_state is None else initial_state.float().contiguous()
        lay = chunk_layout(B, T, cu_seqlens, q.device)
        o, ht, hs = chunk_kda_fwd(*flat, beta_flat, scale, h0, output_final_state, lay, save_states=save, act=act)
        if save:
            ctx.save_for_backward(*flat, beta_flat, hs)
            ctx.lay, ctx.scale, ctx.shape, ctx.has_h0 = lay, scale, (B, T, H, K, V), h0 is not None
            ctx.h0_dtype = None if initial_state is None else initial_state.dtype
            ctx.act = act  # its A_log / dt_bias: fp32 copies (or the parameters themselves when already fp32)
            ctx.param_dtypes = None if act is None else (A_log.dtype, dt_bias.dtype, dt_bias.shape)
        return o.reshape(B, T, H, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, hs = ctx.saved_tensors
        B, T, H, K, V = ctx.shape
        act = ctx.act
        do = do.reshape(B * T, H, V).contiguous()
        dht = None if dht is None else dht.float().contiguous()
        dq, dk, dv, dg, dbeta, dh0 = chunk_kda_bwd(q, k, v, g, beta, ctx.scale, hs, do, dht, ctx.has_h0, ctx.lay, act)
        d_A_log = d_dt_bias = None
        if act is not None:
            a_dtype, b_dtype, b_shape = ctx.param_dtypes
            dq, dk, dg, dbeta, d_A_log, d_dt_bias = activations_backward(
                q, k, g, beta, act.A_log, act.dt_bias, dq, dk, dg, dbeta, g_min=act.g_min, kimi=act.kimi)
            d_A_log, d_dt_bias = d_A_log.to(a_dtype), d_dt_bias.reshape(b_shape).to(b_dtype)
        grads = [x.reshape(B, T, H, -1) for x in (dq, dk, dv, dg)]
        dh0 = None if dh0 is None else dh0.to(ctx.h0_dtype)
        return (*grads, dbeta.reshape(B, T, H), d_A_log, d_dt_bias, dh0, None, None, None, None, None)


def _run(q, k, v, g, beta, A_log, dt_bias, gate, scale, initial_state, output_final_state, cu_seqlens):
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    out_dtype = v.dtype
    if q.dtype not in _KERNEL_DTYPES:
        q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    leaves = [x for x in (q, k, v, g, beta, A_log, dt_bias, initial_state) if x is not None]
    save = torch.is_grad_enabled() and any(x.requires_grad for x in leaves)  # keep per-chunk states for backward
    o, ht = _KDAChunkFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, cu_seqlens,
                                    output_final_state, save, gate)
    return o.to(out_dtype), ht


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA on the Triton kernels; the contract of `openk3.ops.kda.kda` (pre-activated g and beta).

    Exact (to rounding) while the gates of any 15 consecutive tokens of a chunk sum to more than about -85
    (per-token g >= -5.5 always qualifies; K3's gate is bounded by -5, SPEC §2): the chunk's e^-G stays inside
    fp32 range. Past that, e^-G overflows and outputs turn inf/NaN, so Kimi Linear's unbounded softplus gate
    needs the chunked reference (or a gate floor) when its decays get that strong. fp64 inputs compute in fp32.
    """
    return _run(q, k, v, g, beta, None, None, None, scale, initial_state, output_final_state, cu_seqlens)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`kda_triton` on `kda_activations(q, k, f, b, A_log, dt_bias, gate=gate, g_min=g_min)` with the activations
    fused into the chunk kernels: they read the raw projections q, k [B,T,H,K], the gate logits f [B,T,H,K] and
    the beta logits b [B,T,H] and apply the L2 norms, the gate and the sigmoid themselves, forward and backward,
    so the activated tensors are never written. Differentiable in every input, A_log [H] and dt_bias [H,K] (or
    [H*K]) included. The gate range caveat of `kda_triton` applies to the computed g."""
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    return _run(q, k, v, f, b, A_log, dt_bias, (gate, float(g_min)), scale, initial_state, output_final_state,
                cu_seqlens)
