"""Block Attention Residuals (SPEC-K3 §4): a softmax-weighted mix over depth, per token.

    keys_i  = RMSNorm_noweight(v_i)                 (fp32, also under a bf16 autocast: `fp32_island`)
    score_i = sum_d (r_d * w_d) * keys_i[d]         w: the pseudo-query [D], r: the RMSNorm weight [D]
    h       = sum_i softmax_i(score) * v_i          (values are the raw sources)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from openk3.ops.fused import use_triton
from openk3.ops.norms import acc_dtype, fp32_island, rms_norm


def attn_res(
    sources: list[torch.Tensor] | torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """sources: a list of N tensors [...,D] (or one stacked [N,...,D]); query, norm_weight [D] -> [...,D]."""
    v = torch.stack(list(sources)) if isinstance(sources, list | tuple) else sources
    acc = acc_dtype(v.dtype)
    vf = v.to(acc)
    keys = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps)
    with fp32_island(v):
        scores = keys @ (norm_weight.to(acc) * query.to(acc).reshape(-1))  # [N,...]
    p = scores.softmax(0).unsqueeze(-1)
    return (p * vf).sum(0).to(v.dtype)


# ---- two-phase form (SPEC §4): the block sums are fixed while a block runs and the pseudo-queries do not depend on
# the input, so every query of a block is scored against the block sums in one batched pass (phase 1); each
# sublayer then merges its running partial sum into that result by online softmax (phase 2).

class BlockMix(NamedTuple):
    mix: tuple[torch.Tensor, ...]  # per query q, [..., D] fp32: its softmax mix of the block sums alone
    lse: tuple[torch.Tensor, ...]  # per query q, [...] fp32: logsumexp over the block sums of its scores


def attn_res_blocks(blocks: list[torch.Tensor], queries: torch.Tensor, eps: float = 1e-5) -> BlockMix:
    """Phase 1. blocks: N tensors [..., D]; queries [Q, D] (row q: r_q * w_q, its norm weight times its
    pseudo-query). One pass over the block sums for all Q queries; each query's row of the result is a tensor of
    its own, so that no query's use makes autograd build a zero-filled [..., Q, D] gradient (as indexing one
    [..., Q, D] result per query would) and, compiled, the backward takes the rows' gradients without a stacked
    copy. On CUDA (block sums in 16/32-bit floats, fp32 queries) one Triton pass each way
    (`ops.triton_attnres.blocks_triton`; inside torch.compile too, as a graph break, where autograd records),
    where its tiles fit."""
    if _blocks_take_triton(blocks, queries):
        return BlockMix(*_blocks_triton(blocks, queries, eps))
    return attn_res_blocks_reference(blocks, queries, eps)


def attn_res_blocks_reference(blocks: list[torch.Tensor], queries: torch.Tensor, eps: float = 1e-5) -> BlockMix:
    """`attn_res_blocks` in PyTorch's ops (off CUDA, for fp64 and for tiles the kernels do not hold; Inductor
    compiles it)."""
    v = torch.stack(blocks, dim=-2)  # [..., N, D], the sources' promoted dtype
    vf = v.to(acc_dtype(v.dtype))
    inv_rms = torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps)  # [..., N, 1]: the keys are vf * inv_rms
    with fp32_island(v):
        scores = (vf @ queries.to(vf.dtype).T) * inv_rms  # [..., N, Q]
        p = scores.softmax(-2)  # over the N block sums (not exp(scores - lse): softmax's backward is the stable one)
        if torch.compiler.is_compiling():
            # per query a sum over the N (few) block sums, which Inductor fuses into one pass writing Q tensors (the
            # batched matmul is one [Q, N] x [N, D] product per token for cuBLAS, ~1.7 ms a call for k3-debug's
            # step; and views of one [..., Q, D] result would make a compiled phase 2 guard on Q through their base)
            N, Q = scores.shape[-2:]
            mix = tuple(sum(p[..., n, q, None] * vf[..., n, :] for n in range(N)) for q in range(Q))
            return BlockMix(mix, tuple(scores[..., q].logsumexp(-1) for q in range(Q)))
        return BlockMix((p.transpose(-1, -2) @ vf).unbind(-2), scores.logsumexp(-2).unbind(-1))


def _blocks_take_triton(blocks: list[torch.Tensor], queries: torch.Tensor) -> bool:
    if queries.dtype != torch.float32 or not all(use_triton(b, compiled=True) for b in blocks):
        return False
    if torch.compiler.is_compiling() and not torch.is_grad_enabled():
        # inference compiled (the serving engine's decode step): Inductor fuses the reference into the step's
        # graph, where the kernel's graph break cut the step at every layer into frames that each recompiled
        # per layer, past Dynamo's recompile limit (the rest then ran eagerly)
        return False
    from openk3.ops.triton_attnres import blocks_triton_fits  # triton is an optional dependency

    return blocks_triton_fits(len(blocks), blocks[0].shape[-1])


@torch.compiler.disable
def _blocks_triton(*args) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    from openk3.ops.triton_attnres import blocks_triton  # triton is an optional dependency

    return blocks_triton(*args)


def attn_res_merge(mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, query: torch.Tensor,
                   eps: float = 1e-5, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Phase 2: AttnRes over the block sums + [partial] for one query: mix [..., D] and lse [...] are its row of
    phase 1 (`BlockMix.mix[q]`, `BlockMix.lse[q]`), query [D] = r_q * w_q. In the merged softmax the
    partial sum (score s) weighs e^s / (e^s + e^lse) and the blocks together e^lse / (e^s + e^lse), shared as in
    their own mix: a softmax over the two logits (s, lse), so that neither weight is formed as 1 minus the other
    (which loses a tiny weight, and its gradient, to rounding). Returns `dtype` (default: the partial sum's).
    Without autograd, CUDA tensors take one Triton pass (`ops.triton_attnres`, where `ops.fused.use_triton` says)."""
    if use_triton(partial) and mix.dtype == torch.float32 and not (
            torch.is_grad_enabled() and any(t.requires_grad for t in (mix, lse, partial, query))):
        from openk3.ops.triton_attnres import attn_res_merge_triton  # triton is an optional dependency

        return attn_res_merge_triton(mix, lse, partial, query, eps, dtype or partial.dtype)
    pf = partial.to(mix.dtype)
    q = query.to(pf.dtype)
    with fp32_island(pf):
        # compiled, a product and sum that Inductor fuses with the norm's reduction; eagerly a matrix-vector product
        # (one read of the partial sum; under torch.compile it stays a cuBLAS call of its own, two kernels at batch 1)
        dot = (pf * q).sum(-1) if torch.compiler.is_compiling() else pf @ q
        s = dot * torch.rsqrt(pf.pow(2).mean(-1) + eps)  # [...]
    weights = torch.stack([s, lse], dim=-1).softmax(-1).unsqueeze(-2)  # [..., 1, 2]
    return (weights[..., 0] * pf + weights[..., 1] * mix).to(dtype or partial.dtype)


def attn_res_merge_norm(mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, addend: torch.Tensor | None,
                        query: torch.Tensor, eps: float, dtype: torch.dtype | None, weight: torch.Tensor,
                        norm_eps: float, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`attn_res_merge` over partial + `addend` (the last sublayer's output, not yet added; None: nothing to add),
    then the sublayer's pre-norm (RMSNorm with `weight` and `norm_eps`) on its output, in `out_dtype` (default:
    the merge's); returns (normalised input, the new partial sum). The form `compile_blocks` runs. On CUDA, with
    phase 1 in fp32 (as under a bf16 autocast: bf16 partial sums, fp32 mixes), one Triton pass each way
    (`ops.triton_attnres.merge_norm_triton`; inside torch.compile too, as a graph break: the whole function is the
    kernel). Elsewhere the PyTorch form, which `compile_blocks` compiles: Inductor makes the residual add, phase 2
    and the norm one pass per token forward, and four backward (the sums over tokens of the query's and the norm
    weight's gradients each re-read the rows)."""
    fp32 = dtype == torch.float32 and all(t.dtype == torch.float32 for t in (mix, weight, query))
    if fp32 and use_triton(partial, compiled=True) and (addend is None or use_triton(addend, compiled=True)):
        return _merge_norm_triton(mix, lse, partial, addend, query, eps, weight, norm_eps, out_dtype or torch.float32)
    return attn_res_merge_norm_reference(mix, lse, partial, addend, query, eps, dtype, weight, norm_eps, out_dtype)


def attn_res_merge_norm_reference(mix, lse, partial, addend, query, eps, dtype, weight, norm_eps,
                                  out_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`attn_res_merge_norm` in PyTorch's ops (off CUDA, and for other dtypes; Inductor compiles it)."""
    if addend is not None:
        partial = partial + addend
    x = rms_norm(attn_res_merge(mix, lse, partial, query, eps, dtype), weight, norm_eps)
    return (x if out_dtype is None else x.to(out_dtype)), partial


@torch.compiler.disable
def _merge_norm_triton(*args) -> tuple[torch.Tensor, torch.Tensor]:
    from openk3.ops.triton_attnres import merge_norm_triton  # triton is an optional dependency

    return merge_norm_triton(*args)
