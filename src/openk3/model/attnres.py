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
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.common import RMSNorm
from openk3.ops.attnres import attn_res


def pseudo_query(dim: int) -> nn.Linear:
    proj = nn.Linear(dim, 1, bias=False)
    nn.init.zeros_(proj.weight)
    return proj


def mix(sources: list[torch.Tensor], proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
    """AttnRes over `sources` (each [...,D]) with this sublayer's pseudo-query and norm weight."""
    if len(sources) == 1:
        return sources[0]  # softmax over one source is 1
    return attn_res(sources, proj.weight[0], norm.weight, norm.eps)


class BlockStream:
    """The (blocks, partial) state of Block AttnRes while the decoder layers run."""

    def __init__(self, embedding: torch.Tensor, block_size: int):
        self.blocks: list[torch.Tensor] = []
        self.partial = embedding
        self.block_size = block_size

    def attn_input(self, layer_idx: int, proj: nn.Linear | None, norm: RMSNorm | None) -> torch.Tensor:
        """Steps 1-2: the attention sublayer's input; opens a block when layer_idx % block_size == 0."""
        x = self.partial if not self.blocks else mix(self.blocks + [self.partial], proj, norm)
        self._opened = layer_idx % self.block_size == 0
        if self._opened:
            self.blocks.append(self.partial)
        return x

    def add_attn(self, h: torch.Tensor) -> None:
        self.partial = h if self._opened else self.partial + h

    def mlp_input(self, proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
        return mix(self.blocks + [self.partial], proj, norm)

    def add_mlp(self, h: torch.Tensor) -> None:
        self.partial = self.partial + h

    def output(self, proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
        return mix(self.blocks + [self.partial], proj, norm)
