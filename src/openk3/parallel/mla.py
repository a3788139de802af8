"""Gated MLA under context parallelism (SPEC §10): all-gather the compressed latent, attend per document.

Each rank computes the per-token cache entry [RMSNorm(latent) | k_slice] (kv_lora_rank + qk_rope_head_dim values,
576 at K3 size) of its own tokens; one differentiable all-gather (`comm.gather_rows`: backward sums the gradient
over the ranks and keeps this rank's rows) gives every rank the whole stream's entries. A query at global position
p of document d attends the keys of d up to p: for each local piece of a document, the keys from the document's
start to the piece's last token, with a bottom-right-aligned causal mask (`ops.attention.causal_sdpa`: the fused
SDPA kernels take the mask without materialising it), never through cuDNN (`ops.attention.NO_CUDNN`: its backward
gave wrong gradients on these strided tensors on a GPU, bench/RESULTS.md).
"""

from __future__ import annotations

import torch

from openk3.ops.attention import NO_CUDNN, causal_sdpa, mla_expand_kv
from openk3.parallel.comm import gather_rows
from openk3.parallel.layout import SequenceSplit


def mla_attention_documents(q: torch.Tensor, kv_all: torch.Tensor, kv_b: torch.Tensor, split: SequenceSplit,
                            rank: int, *, nope_dim: int, v_dim: int, scale: float) -> torch.Tensor:
    """q [L,H,n+r] of rank `rank`'s tokens, kv_all [T,R+r] the whole stream's cache entries -> o [L,H,v]."""
    H = q.shape[1]
    lo = split.bounds[rank]
    cu = split.local_cu_seqlens(rank)
    outs = []
    for a, b in zip(cu, cu[1:]):
        doc_start = split.cu_seqlens[split.doc_of(lo + a)]
        k, v = mla_expand_kv(kv_all[None, doc_start:lo + b], kv_b, H, nope_dim, v_dim)  # [1,H,Lk,.]
        outs.append(causal_sdpa(q[None, a:b].transpose(1, 2), k, v, scale, backends=NO_CUDNN)[0].transpose(0, 1))
    return torch.cat(outs)


def mla_layer_forward(layer, x: torch.Tensor, split: SequenceSplit, rank: int, group) -> torch.Tensor:
    """`GatedMLA.forward` for this rank's tokens x [1, L, D] of a packed stream (no cache)."""
    B, L, _ = x.shape
    if B != 1:
        raise ValueError(f"context parallelism works on one packed stream (batch 1), got batch {B}")
    q = layer.query(x)
    kv_all = gather_rows(layer.latent(x)[0], [split.size(r) for r in range(split.num_ranks)], rank, group)
    o = mla_attention_documents(q[0], kv_all, layer.kv_b_proj.weight, split, rank, nope_dim=layer.nope_dim,
                                v_dim=layer.v_head_dim, scale=layer.scale).unsqueeze(0)
    return layer.output(x, o)
