"""Context parallelism applied to a plain K3ForCausalLM from outside (torchtitan's `parallelize_*` style).

`parallelize_cp(model, group)` installs forward wrappers; the model code stays free of distributed code. While a
`PackedBatch` is active (`with cp.active(batch):`, set by `cp_lm_losses`), the wrapped modules run on this rank's
slice of the packed stream:
  - KDA layers: `kcp.kda_layer_forward` (conv halo, state fold);
  - MLA layers (decoder and MTP blocks): `mla.mla_layer_forward` (latent all-gather, per-document causal mask);
  - the root forward: the multi-token-prediction layers read the embedding of the token k positions ahead in the
    *stream*, which for a rank's last tokens lies on the next rank (every rank of the group holds the stream's ids);
    their positions within k of a document's end predict nothing: they are computed (so shapes stay those of the
    stream) but left out of the loss and out of the MTP routers' balancing statistics.
Token-wise modules (embedding, norms, AttnRes, MoE, LM head) need nothing. Without an active batch, or with a
decode cache, every wrapper calls the module's own forward: evaluation and generation run per rank as before.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA
from openk3.model.moe import MoE
from openk3.model.transformer import K3Output
from openk3.ops.loss import linear_cross_entropy
from openk3.parallel.kcp import kda_layer_forward
from openk3.parallel.layout import SequenceSplit
from openk3.parallel.mla import mla_layer_forward


@dataclass(frozen=True)
class PackedBatch:
    """The stream's input ids [T] (every rank of the group holds all of them) and how they are split."""

    split: SequenceSplit
    ids: torch.Tensor

    def local_ids(self, rank: int) -> torch.Tensor:
        return self.ids[self.split.bounds[rank]:self.split.bounds[rank + 1]].unsqueeze(0)

    def ids_ahead(self, rank: int, k: int) -> torch.Tensor:
        """[1, L]: the id k positions further along the stream (0 past its end; such positions are not used)."""
        pos = torch.arange(self.split.bounds[rank], self.split.bounds[rank + 1], device=self.ids.device) + k
        return torch.where(pos < self.ids.numel(), self.ids[pos.clamp(max=self.ids.numel() - 1)], 0).unsqueeze(0)

    def predicts(self, rank: int, k: int) -> torch.Tensor:
        """Bool [L]: the token k positions ahead is in the same document (MTP depth k has a target)."""
        split = self.split
        return (split.positions(rank) < split.doc_lengths(rank) - k).to(self.ids.device)


class ContextParallel:
    """The context-parallel group and the packed batch the wrapped modules work on (None: plain forwards).
    activation_checkpointing: recompute the wrapped token mixers in backward (the split is passed explicitly, so
    the recomputation sees the same layout)."""

    def __init__(self, group, activation_checkpointing: bool = False):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.activation_checkpointing = activation_checkpointing
        self.batch: PackedBatch | None = None

    @contextmanager
    def active(self, batch: PackedBatch):
        if batch.split.num_ranks != self.size:
            raise ValueError(f"the batch is split over {batch.split.num_ranks} ranks, the group has {self.size}")
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None

    def run_mixer(self, forward, module, x: torch.Tensor) -> torch.Tensor:
        args = (module, x, self.batch.split, self.rank, self.group)
        if self.activation_checkpointing:
            return checkpoint(forward, *args, use_reentrant=False)
        return forward(*args)


def _wrap_mixer(module, forward, cp: ContextParallel) -> None:
    local = module.forward

    def wrapped(x, cache=None):
        if cp.batch is None or cache is not None:
            return local(x, cache)
        return cp.run_mixer(forward, module, x)

    module.forward = wrapped


def _wrap_mtp_router(router, depth: int, cp: ContextParallel) -> None:
    local = router.forward

    def wrapped(x):
        routing = local(x)
        if cp.batch is not None and router.training:
            router.last_scores = router.last_scores[cp.batch.predicts(cp.rank, depth)]
        return routing

    router.forward = wrapped


def _root_forward(model, input_ids, batch: PackedBatch, rank: int, return_mtp: bool, return_logits: bool) -> K3Output:
    """K3ForCausalLM.forward on this rank's slice, the MTP layers fed from the stream (module docstring)."""
    hidden = model.model(input_ids)
    mtp_heads = None
    if model.mtp is not None and return_mtp:
        longest = max(b - a for a, b in zip(batch.split.cu_seqlens, batch.split.cu_seqlens[1:]))
        mtp_heads = []
        h = hidden
        for k, layer in enumerate(model.mtp, start=1):
            if longest - k < 1:
                break
            h = layer(h, model.model.embed_tokens(batch.ids_ahead(rank, k)))
            mtp_heads.append(layer.norm(h))
    return model.head_output(hidden, model.model.norm(hidden), mtp_heads, return_logits)


def _wrap_root(model, cp: ContextParallel) -> None:
    local = model.forward

    def wrapped(input_ids, cache=None, *, logits_to_keep: int = 0, return_mtp: bool = True,
                return_logits: bool = True, documents=None):
        if cp.batch is None or cache is not None:
            return local(input_ids, cache, logits_to_keep=logits_to_keep, return_mtp=return_mtp,
                         return_logits=return_logits, documents=documents)
        if logits_to_keep:
            raise ValueError("logits_to_keep is not supported under context parallelism")
        if documents is not None:
            raise ValueError("packed documents are not supported under context parallelism (--packing concat)")
        return _root_forward(model, input_ids, cp.batch, cp.rank, return_mtp, return_logits)

    model.forward = wrapped


def parallelize_cp(model, group, *, activation_checkpointing: bool = False) -> ContextParallel:
    """Install the context-parallel forwards on a K3ForCausalLM (module docstring); returns the handle whose
    `active(batch)` switches them on."""
    cp = ContextParallel(group, activation_checkpointing)
    blocks = list(model.model.layers) + [m.block for m in model.mtp or []]
    for layer in blocks:
        if isinstance(layer.self_attn, KimiDeltaAttention):
            _wrap_mixer(layer.self_attn, kda_layer_forward, cp)
        elif isinstance(layer.self_attn, GatedMLA):
            _wrap_mixer(layer.self_attn, mla_layer_forward, cp)
    for depth, layer in enumerate(model.mtp or [], start=1):
        if isinstance(layer.block.mlp, MoE):
            _wrap_mtp_router(layer.block.mlp.gate, depth, cp)
    _wrap_root(model, cp)
    return cp


def cp_lm_losses(model, batch: torch.Tensor, mtp_weight: float, cp: ContextParallel):
    """(total, next-token CE, MTP CE or None) for this data-parallel rank's windows [B, T+1], like the training
    loop's `lm_losses`, with the B windows packed into one stream of B*T tokens split over the group.

    Each rank returns its share of the group's mean: (sum over its tokens) * group size / (tokens in the group), so
    that averaging over the group (FSDP averages gradients over all ranks, the loop averages the logged values)
    gives the same mean as one process; the MTP terms are normalised by the positions that have a target."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    B, T = inputs.shape
    split = SequenceSplit.even(range(0, B * T + 1, T), cp.size)
    packed = PackedBatch(split, inputs.reshape(-1))
    lo, hi = split.bounds[cp.rank], split.bounds[cp.rank + 1]
    flat_targets = targets.reshape(-1)
    want_mtp = mtp_weight > 0 and getattr(model.config, "mtp_layers", 0) > 0
    with cp.active(packed):
        out = model(packed.local_ids(cp.rank), return_mtp=want_mtp, return_logits=False)
    head = model.lm_head.weight
    lm = linear_cross_entropy(out.head_inputs[0], head, flat_targets[lo:hi], reduction="sum") * (cp.size / (B * T))
    if not want_mtp or not out.mtp_head_inputs:
        return lm, lm.detach(), None
    keep = packed.predicts(cp.rank, 1)
    ahead = flat_targets[(torch.arange(lo, hi, device=batch.device) + 1).clamp(max=B * T - 1)]
    ahead = torch.where(keep, ahead, -100)  # positions without a target are ignored
    mtp = linear_cross_entropy(out.mtp_head_inputs[0][0], head, ahead, ignore_index=-100, reduction="sum")
    mtp = mtp * (cp.size / (B * (T - 1)))
    return lm + mtp_weight * mtp, lm.detach(), mtp.detach()
