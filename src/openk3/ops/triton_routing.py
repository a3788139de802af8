"""Sigmoid top-k routing (SPEC-K3 §5, `openk3.ops.moe.sigmoid_topk_routing`, the reference) in one Triton pass per
token, forward only: what inference runs on a GPU (eight small PyTorch operations per MoE layer otherwise).

    s = sigmoid(logits)        the k experts of the largest s + bias (the selection bias: Quantile Balancing's)
    w_j = s[e_j] / (sum_j s[e_j] + 1e-20) * scaling       (without renormalisation: s[e_j] * scaling)

The k picks are k passes of argmax over the E experts (the first of equal values), each then excluded: the same
descending order as torch.topk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _routing_kernel(logits_ptr, bias_ptr, scores_ptr, weights_ptr, indices_ptr, E, scaling,
                    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    me = e < E
    s = tl.sigmoid(tl.load(logits_ptr + row * E + e, mask=me, other=0.0).to(tl.float32))
    tl.store(scores_ptr + row * E + e, s, mask=me)
    choice = s
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=me, other=0.0).to(tl.float32)
    choice = tl.where(me, choice, float("-inf"))
    slot = tl.arange(0, BLOCK_K)
    picks = tl.zeros([BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pick = tl.argmax(choice, axis=0, tie_break_left=True)
        picks = tl.where(slot == j, pick.to(tl.int64), picks)
        weights = tl.where(slot == j, tl.sum(tl.where(e == pick, s, 0.0), axis=0), weights)
        choice = tl.where(e == pick, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    mk = slot < TOP_K
    tl.store(indices_ptr + row * TOP_K + slot, picks, mask=mk)
    tl.store(weights_ptr + row * TOP_K + slot, weights * scaling, mask=mk)


# A torch custom op, so that torch.compile keeps the launch whole (the compiled decode step: Inductor would
# otherwise lower top-k to two sort kernels of its own and fuse the rest around them)
@torch.library.custom_op("openk3::sigmoid_topk_routing", mutates_args=())
def sigmoid_topk_routing_triton(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                                scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [N, k] fp32, indices [N, k] int64, scores [N, E] fp32) for logits [N, E]; no autograd."""
    logits = logits.contiguous()
    N, E = logits.shape
    scores = torch.empty(N, E, dtype=torch.float32, device=logits.device)
    weights = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    if N:
        _routing_kernel[(N,)](logits, bias if bias is not None else logits, scores, weights, indices, E, scaling,
                              TOP_K=top_k, HAS_BIAS=bias is not None, RENORMALIZE=renormalize,
                              BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k))
    return weights, indices, scores


@sigmoid_topk_routing_triton.register_fake
def _(logits, bias, top_k, renormalize, scaling):
    N, E = logits.shape
    return (logits.new_empty(N, top_k, dtype=torch.float32), logits.new_empty(N, top_k, dtype=torch.int64),
            logits.new_empty(N, E, dtype=torch.float32))
