"""Sigmoid top-k routing (SPEC-K3 §5, `openk3.ops.moe.sigmoid_topk_routing`, the reference) in one Triton pass over a
tile of tokens, forward only: what inference runs on a GPU (eight small PyTorch operations per MoE layer otherwise),
and in training the picks (whose top-k would otherwise take two sort kernels a layer).

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
def _routing_kernel(logits_ptr, bias_ptr, scores_ptr, weights_ptr, indices_ptr, N, E, scaling,
                    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """BLOCK_N tokens a program (one token a program was slower at training's token counts: bench/RESULTS.md)."""
    row = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]
    e = tl.arange(0, BLOCK_E)[None, :]
    mn = row < N
    me = e < E
    s = tl.sigmoid(tl.load(logits_ptr + row * E + e, mask=mn & me, other=0.0).to(tl.float32))
    tl.store(scores_ptr + row * E + e, s, mask=mn & me)
    choice = s
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=me, other=0.0).to(tl.float32)
    choice = tl.where(me, choice, float("-inf"))
    slot = tl.arange(0, BLOCK_K)[None, :]
    picks = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pick = tl.argmax(choice, axis=1, tie_break_left=True)[:, None]
        picks = tl.where(slot == j, pick.to(tl.int64), picks)
        weights = tl.where(slot == j, tl.sum(tl.where(e == pick, s, 0.0), axis=1)[:, None], weights)
        choice = tl.where(e == pick, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    mk = mn & (slot < TOP_K)
    tl.store(indices_ptr + row * TOP_K + slot, picks, mask=mk)
    tl.store(weights_ptr + row * TOP_K + slot, weights * scaling, mask=mk)


# elements of a program's [BLOCK_N, BLOCK_E] tile of scores at most
TILE_ELEMENTS = 4096
# programs a launch aims for before tiles grow past one token: a decode step's few tokens spread over the device
# (kimi-linear-48b, 256 experts, batch 64 in 4 programs of 16 tokens: 49 us a layer, H100, 2026-12-07)
ROUTING_PROGRAMS = 256


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
        block_e = triton.next_power_of_2(E)
        block_n = min(max(TILE_ELEMENTS // block_e, 1), triton.next_power_of_2(triton.cdiv(N, ROUTING_PROGRAMS)))
        _routing_kernel[(triton.cdiv(N, block_n),)](
            logits, bias if bias is not None else logits, scores, weights, indices, N, E, scaling, TOP_K=top_k,
            HAS_BIAS=bias is not None, RENORMALIZE=renormalize, BLOCK_N=block_n, BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k))
    return weights, indices, scores


@sigmoid_topk_routing_triton.register_fake
def _(logits, bias, top_k, renormalize, scaling):
    N, E = logits.shape
    return (logits.new_empty(N, top_k, dtype=torch.float32), logits.new_empty(N, top_k, dtype=torch.int64),
            logits.new_empty(N, E, dtype=torch.float32))
