"""Block Attention Residuals (SPEC-K3 §4): the per-sublayer parameters and the block bookkeeping.

Per sublayer: a pseudo-query `*_res_proj` = Linear(D, 1, bias=False) (weight [1, D], init 0 so the mix starts
uniform, as in the AttnRes paper) and an RMSNorm weight `*_res_norm.weight` [D] (init 1). Names on a decoder layer:
attn_res_proj / attn_res_norm (absent on layer 0, whose attention input is the embedding alone) and
mlp_res_proj / mlp_res_norm; on the model: output_res_proj / output_res_norm (before the final norm).

The stream is `blocks` (completed block sums; the first is the token embedding) plus `partial` (the running sum of
the current block). Decoder layer l:
  1. if blocks: x = AttnRes(blocks + [partial]) else x = partial (layer 0: the embedding)
  2. if l % block_size == 0: blocks.append(partial)                       (the layer opens a block)
  3. h = attn(input_layernorm(x)); partial = h if the layer opened a block else partial + h
  4. x = AttnRes(blocks + [partial]); partial = partial + mlp(post_attention_layernorm(x))
Output: AttnRes(blocks + [partial]) -> model.norm -> lm_head.

Two-phase computation: `blocks` changes only when a layer opens a block, and the pseudo-queries are parameters, so
every AttnRes that runs while `blocks` has a given length (an "epoch") is known in advance (`attn_res_epochs`).
When an epoch starts, all its queries are scored against the block sums in one pass (`ops.attnres.
attn_res_blocks`); each AttnRes then only merges the current partial sum in (`attn_res_merge`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from openk3.model.common import RMSNorm
from openk3.ops.attnres import attn_res_blocks, attn_res_merge, attn_res_merge_norm
from openk3.ops.norms import acc_dtype, compute_dtype

Query = tuple[nn.Linear, RMSNorm]  # one sublayer's pseudo-query and norm


class Phases(NamedTuple):
    """The functions the stream computes with: the ops, or their torch.compile'd versions (compile_blocks)."""
    blocks: Callable = attn_res_blocks  # phase 1
    merge: Callable = attn_res_merge  # phase 2
    # phase 2 and the sublayer's pre-norm as one function (compiled: one fused pass each way, whose backward keeps
    # what Inductor's partitioner chooses); None: phase 2, then the norm module, recomputed in backward
    merge_norm: Callable | None = None


EAGER_PHASES = Phases()
COMPILABLE_PHASES = Phases(attn_res_blocks, attn_res_merge, attn_res_merge_norm)


def pseudo_query(dim: int) -> nn.Linear:
    proj = nn.Linear(dim, 1, bias=False)
    nn.init.zeros_(proj.weight)
    return proj


def attn_res_epochs(layers, output: Query, block_size: int) -> list[list[Query]]:
    """The AttnRes queries in the order the stream runs them, grouped by epoch (epoch k runs while `blocks` holds
    k + 1 sums): the attention query of a block-opening layer still mixes the previous epoch's blocks."""
    epochs: list[list[Query]] = []
    for l, layer in enumerate(layers):
        if l % block_size == 0:
            if l > 0:
                epochs[-1].append((layer.attn_res_proj, layer.attn_res_norm))
            epochs.append([])
        else:
            epochs[-1].append((layer.attn_res_proj, layer.attn_res_norm))
        epochs[-1].append((layer.mlp_res_proj, layer.mlp_res_norm))
    epochs[-1].append(output)
    eps = {norm.eps for epoch in epochs for _, norm in epoch}
    if len(eps) != 1:
        raise ValueError(f"Block AttnRes needs one RMSNorm eps for all its norms, got {sorted(eps)}")
    return epochs


class BlockStream:
    """The (blocks, partial) state of Block AttnRes while the decoder layers run, computed in two phases over the
    `epochs` of queries (`attn_res_epochs`); each call names the query it expects, as a check on the plan. Without
    a plan (epochs=None) every AttnRes runs phase 1 for itself alone: the same values, for callers that step the
    layers one token at a time and gain nothing from batching the queries."""

    def __init__(self, embedding: torch.Tensor, block_size: int, epochs: list[list[Query]] | None = None,
                 phases: Phases = EAGER_PHASES):
        self.blocks: list[torch.Tensor] = []
        self.partial = embedding
        self._pending: torch.Tensor | None = None  # a sublayer output not yet added to `partial` (`_add`)
        self.block_size = block_size
        self._epochs = epochs
        self._phases = phases

    def _open_epoch(self) -> None:
        """Phase 1 for the epoch that starts now that `blocks` grew (with a plan: for all its queries at once)."""
        self._blocks_dtype = functools.reduce(torch.promote_types, (b.dtype for b in self.blocks))
        self._queries = self._epochs[len(self.blocks) - 1] if self._epochs is not None else None
        if self._queries is not None:
            self._q = self._query_vectors(self._queries)
            mixed = self._phases.blocks(self.blocks, torch.stack(self._q), self._queries[0][1].eps)
            self._rows = list(zip(mixed.mix, mixed.lse))
            self._next = 0

    def _query_vectors(self, queries: list[Query]) -> list[torch.Tensor]:
        """[D] per query: its norm weight times its pseudo-query, in the fp32 (fp64) compute dtype. Tensors of their
        own, not rows of a [Q, D] matrix: a compiled phase 2 would guard on Q through their base. The projection's
        [1, D] weight is viewed flat, not indexed: the view's backward is free, an index's fills and copies."""
        acc = acc_dtype(self._blocks_dtype)
        return [norm.weight.to(acc) * proj.weight.view(-1).to(acc) for proj, norm in queries]

    def _merge(self, proj: nn.Linear, norm: RMSNorm, then: nn.Module | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Phase 2 for the next query of the epoch, which must be (proj, norm); then `then` (the sublayer's
        pre-norm) on the result, if given. A fused merge_norm returns it in `out_dtype` (default: the merge's
        dtype); the eager paths return the merge's dtype."""
        fused = then is not None and self._phases.merge_norm is not None
        if not fused:
            self._settle()
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in (self.partial, self._pending) if t is not None],
                                 self._blocks_dtype)
        if self._queries is None:
            (q_vec,) = self._query_vectors([(proj, norm)])
            mixed = self._phases.blocks(self.blocks, q_vec[None], norm.eps)
            mix, lse = mixed.mix[0], mixed.lse[0]
        else:
            q = self._next
            if q >= len(self._queries) or self._queries[q][0] is not proj or self._queries[q][1] is not norm:
                raise RuntimeError("Block AttnRes ran its sublayers in another order than attn_res_epochs planned")
            self._next += 1
            (mix, lse), q_vec = self._rows[q], self._q[q]
        if fused:
            # the pending residual add, phase 2 and the pre-norm: one function, on CUDA a Triton pass each way (at
            # k3-debug's step on an H200 3.9 ms less than compiled, whose backward Inductor partitions, and 2.7 GiB
            # less peak; compiled, it had been 2.9 GiB more than recomputing as below, and 3.4 ms less)
            x, partial = self._phases.merge_norm(mix, lse, self.partial, self._pending, q_vec, norm.eps, dtype,
                                                 then.weight, then.eps, out_dtype)
            if self._pending is not None:
                self.partial, self._pending = partial, None
            return x
        if then is None or not torch.is_grad_enabled() or self._queries is None:
            return self._merge_then(then, mix, lse, self.partial, q_vec, norm.eps, dtype)
        # Eagerly, phase 2 and the pre-norm after it are recomputed in backward: for backward they would keep the
        # merged input (fp32, for the norm) and phase 2's copies of the partial sum, 8 bytes per channel and token
        # under bf16 autocast; the checkpoint keeps its inputs (the partial sum, this query's row of the block mix,
        # lse and query), and backward reruns one elementwise pass and a matrix-vector product per token.
        return checkpoint(self._merge_then, then, mix, lse, self.partial, q_vec, norm.eps, dtype,
                          use_reentrant=False, preserve_rng_state=False)

    def _merge_then(self, then, mix, lse, partial, query, eps, dtype) -> torch.Tensor:
        x = self._phases.merge(mix, lse, partial, query, eps, dtype)
        return x if then is None else then(x)

    def _settle(self) -> None:
        """Add the pending sublayer output into the partial sum (`_add`)."""
        if self._pending is not None:
            self.partial, self._pending = self.partial + self._pending, None

    def _add(self, h: torch.Tensor) -> None:
        """partial += h, deferred to the next merge: a compiled merge_norm adds it in its own fused pass (an add of
        its own, and in backward the sum of the partial sum's gradients and their cast for h: docs/training.md);
        other merges add it first."""
        self._settle()
        self._pending = h

    def attn_input(self, layer_idx: int, proj: nn.Linear | None, norm: RMSNorm | None,
                   then: nn.Module | None = None) -> torch.Tensor:
        """Steps 1-2: the attention sublayer's input, normalised by `then` if given (its pre-norm, computed with
        phase 2: fused when compiled, and then in autocast's dtype; recomputed in backward eagerly);
        opens a block when layer_idx % block_size == 0."""
        merged = len(self.blocks) > 0
        # a token mixer reads its input through matmuls alone, which under autocast read it in autocast's dtype:
        # a fused merge_norm writes it in that dtype (the same bits, and no fp32 copy written and read back to be
        # cast). Its gradient then comes back in that dtype too, summed over the mixer's products inside its
        # compiled graph; eagerly autograd would sum them in bf16, so the eager paths keep the merge's dtype.
        x = self._merge(proj, norm, then, compute_dtype(self.partial)) if merged else self.partial
        self._opened = layer_idx % self.block_size == 0
        if self._opened:
            self._settle()
            self.blocks.append(self.partial)
            self._open_epoch()
        return x if merged or then is None else then(x)  # layer 0 (the embedding alone): normalised after phase 1

    def add_attn(self, h: torch.Tensor) -> None:
        if self._opened:
            self.partial = h  # (nothing pending: the merge before took it)
        else:
            self._add(h)

    def mlp_input(self, proj: nn.Linear, norm: RMSNorm, then: nn.Module | None = None) -> torch.Tensor:
        """Step 4's FFN input, normalised by `then` if given (as in `attn_input`)."""
        return self._merge(proj, norm, then)

    def add_mlp(self, h: torch.Tensor) -> None:
        self._add(h)

    def output(self, proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
        return self._merge(proj, norm)
