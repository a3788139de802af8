"""Reference implementations of Kimi Delta Attention (SPEC-K3 §2).

`kda_recurrent` is the specification: the token-by-token recurrence
    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t)
with alpha_t = exp(g_t). Everything else (the chunked form, the Triton kernels) is tested against it.

Layout: q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K] (log decay, <= 0); beta [B,T,H];
states [B,H,K,V] (or [N,H,K,V] with cu_seqlens and B = 1), always fp32.
"""

from __future__ import annotations

import torch


def sequence_bounds(cu_seqlens: torch.Tensor | None, batch: int, seq_len: int) -> list[tuple[int, int, int]]:
    """(batch index, start, end) of every sequence: one per batch row, or one per cu_seqlens span (B = 1)."""
    if cu_seqlens is None:
        return [(b, 0, seq_len) for b in range(batch)]
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def kda_recurrent(
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
    """Token-by-token KDA. Computes in fp32 (fp64 if the inputs are fp64); returns o in v's dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    o = torch.zeros(B, T, H, V, dtype=acc, device=q.device)
    seqs = sequence_bounds(cu_seqlens, B, T)
    finals = []
    for n, (b, start, end) in enumerate(seqs):
        if initial_state is not None:
            S = initial_state[n].to(acc).clone()
        else:
            S = torch.zeros(H, K, V, dtype=acc, device=q.device)
        for t in range(start, end):
            S = S * g[b, t].exp().unsqueeze(-1)  # decay first: Diag(alpha_t) S_{t-1}
            kt, vt = k[b, t], v[b, t]  # [H,K], [H,V]
            error = vt - torch.einsum("hk,hkv->hv", kt, S)  # write only the prediction error
            S = S + beta[b, t, :, None, None] * kt.unsqueeze(-1) * error.unsqueeze(-2)
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t] * scale, S)
        finals.append(S)
    final = torch.stack(finals) if output_final_state else None  # fp32 (fp64 for fp64 inputs)
    return o.to(v.dtype), final
