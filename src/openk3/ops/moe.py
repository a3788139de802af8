"""Mixture-of-experts routing and expert compute (SPEC-K3 §5).

Routing: s = sigmoid(logits) per expert; the top-k experts are *selected* on s + b (b = the correction bias,
never trained by gradient); the combine weights are the *unbiased* s of the selected experts, renormalised
to sum to 1, times routed_scaling_factor.

Expert weights are 3-D tensors, one slice per expert, in nn.Linear's [out, in] layout:
  gate_up [E, 2*I, Din]   rows [:I] the gate projection, rows [I:] the up projection (HF's `gate_up_proj`)
  down    [E, Dout, I]
`experts_forward` permutes tokens into expert-contiguous groups and calls `grouped_glu_mlp` on them: a loop over
the active experts here; a grouped-GEMM kernel can replace it with the same arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from openk3.ops.norms import acc_dtype


class Routing(NamedTuple):
    weights: torch.Tensor  # [N,k] fp32 combine weights (fp64 for fp64 logits)
    indices: torch.Tensor  # [N,k] int64 selected experts
    scores: torch.Tensor  # [N,E] fp32 unbiased sigmoid scores


def sigmoid_topk_routing(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    *,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> Routing:
    """logits [N,E] -> Routing. Selection on sigmoid(logits) + bias; weights from the unbiased scores."""
    scores = torch.sigmoid(logits.to(acc_dtype(logits.dtype)))
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    indices = torch.topk(choice, k=top_k, dim=-1).indices
    weights = scores.gather(-1, indices)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return Routing(weights * scaling, indices, scores)


def group_by_expert(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [N,k] -> (order [N*k]: flat (token, slot) ids sorted by expert, counts [E] tokens per expert)."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: bincount reads the max index on the host (a sync that CUDA graphs cannot capture)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def grouped_glu_mlp(
    x_sorted: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Rows of x_sorted [M,Din] grouped by expert (counts [E]) -> [M,Dout]; a loop over active experts.

    The rows are split and the weights unbound once, so backward assembles each gradient with one cat / stack;
    indexing `gate_up[e]` or slicing rows per expert would instead add a zero-padded full-size gradient per
    expert (E times the traffic of the weights and of x_sorted)."""
    sizes = counts.tolist()
    outs = []
    for xe, w_gate_up, w_down, n in zip(x_sorted.split(sizes), gate_up.unbind(0), down.unbind(0), sizes):
        if n:
            gate, up = F.linear(xe, w_gate_up).chunk(2, dim=-1)
            outs.append(F.linear(act(gate, up), w_down))
    return torch.cat(outs) if outs else x_sorted.new_empty(0, down.shape[1])


def experts_forward(
    x: torch.Tensor,
    routing_indices: torch.Tensor,
    routing_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_k w[n,k] * Expert_{idx[n,k]}(x[n]) for x [N,Din] -> [N,Dout] (x's dtype; combined in fp32)."""
    N, k = routing_indices.shape
    order, counts = group_by_expert(routing_indices, gate_up.shape[0])
    token_of = order // k  # which token each sorted row came from
    y_sorted = grouped_glu_mlp(x[token_of], counts, gate_up, down, act)
    w_sorted = routing_weights.reshape(-1)[order].unsqueeze(-1)
    acc = acc_dtype(x.dtype)
    out = torch.zeros(N, down.shape[1], dtype=acc, device=x.device)
    out.index_add_(0, token_of, y_sorted.to(acc) * w_sorted.to(acc))
    return out.to(x.dtype)
