"""torch.compile applied per decoder block, from outside the model (as torchtitan does), for the fp32 islands:
Inductor fuses the casts, norms, gates, SiTU-GLU, routing and AttnRes elementwise work of each piece into a few
kernels. (While torch.compile traces, the layers use the PyTorch references instead of the hand-written Triton
kernels, `ops.fused.use_triton`, so both paths can be measured: `bench/train.py gpu` has a compiled row.)

Compiled units: each decoder layer's token mixer, FFN and two norms (the MTP blocks' too; the units that
activation checkpointing and FSDP2 also wrap, compiled in place so parameter names do not change), each MTP
layer's input projection (`MTPLayer.combine`: two norms, a concatenation, a cast and a product), and the two
Block AttnRes phases, which run between them on the shared block stream (phase 2 together with the residual add
before it and the pre-norm after it: one fused pass each way, `ops.attnres.attn_res_merge_norm`). The serving
engine's `compile_prefill` compiles all but the token mixers, with dynamic shapes: a prefill runs those units
eagerly otherwise, dozens of small operations each (the MoE's routing and grouping, AttnRes phase 1); the decode
step, compiled whole, inlines them.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.attnres import COMPILABLE_PHASES, EAGER_PHASES, Phases


def compile_blocks(model: nn.Module, token_mixers: bool = True, **options) -> nn.Module:
    """Compile `model` (a K3ForCausalLM) block by block in place; `options` go to torch.compile (e.g. backend,
    mode, dynamic). Apply after activation checkpointing; returns the model. token_mixers=False leaves the KDA and
    MLA layers eager (serving: their cache reads and writes are the engine's)."""
    for unit in _units(model, token_mixers):
        unit.compile(**options)
    for layer in model.mtp or []:
        layer.combine = torch.compile(layer.combine, **options)  # an instance attribute over the method
    if model.model.block_size is not None:
        model.model.attn_res_phases = Phases(*(torch.compile(fn, **options) for fn in COMPILABLE_PHASES))
    return model


def uncompile_blocks(model: nn.Module) -> nn.Module:
    """Undo `compile_blocks`: every unit runs eagerly again (e.g. after a compile failed at start-up)."""
    for unit in _units(model, token_mixers=True):
        unit._compiled_call_impl = None  # what nn.Module.compile sets; torch has no public way back
    for layer in model.mtp or []:
        layer.__dict__.pop("combine", None)
    model.model.attn_res_phases = EAGER_PHASES
    return model


def _units(model: nn.Module, token_mixers: bool) -> list[nn.Module]:
    blocks = list(model.model.layers) + [m.block for m in model.mtp or []]
    return [unit for layer in blocks for unit in ((layer.self_attn,) if token_mixers else ()) +
            (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)]
