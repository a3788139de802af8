"""One decode step of the hybrid model over the serving engine's pools: one new token for each of B sequences.

The model's own `forward` (with a `HybridCache`) is the prefill and reference path; this is the static-shape
decode walk the engine runs, and captures as CUDA graphs on a GPU. It reads the layers' weights and submodules
and keeps the model's order of operations (Block AttnRes stream, norms, FFN / MoE; SPEC §4, §5). State lives in
preallocated pools addressed per sequence (`DecodeBatch`):
- KDA (SPEC §2): the conv window and the fp32 recurrent state of the sequence's slot, updated in place;
- Gated MLA (SPEC §3): the new token's latent is written into the sequence's pages (block table row = its slot)
  at position `lengths[b]`, then attention runs in the absorbed form on the paged latents: W_UK folded into the
  query, W_UV applied to p . latent; the k_slice is used unrotated (NoPE).

Two kernel sets, same math: "triton" (the GPU path: `kda_decode`, `causal_conv_step`, `paged_mla_decode`, updating
the pools in place with no host synchronisation) and "torch" (the model's own ops on gathered states: the
reference, the CPU default, bit-for-bit the model's single-token forward up to the padding of the latents).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openk3.model.attnres import BlockStream
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA
from openk3.ops.attention import mla_attention_absorbed
from openk3.ops.conv import causal_conv1d_step
from openk3.ops.kda import kda, resolve_backend
from openk3.ops.paged_mla import paged_mla_decode, paged_positions, write_latents

KERNELS = ("triton", "torch")


@dataclass
class DecodeBatch:
    """Per-step inputs (B rows) and the pools they address.

    slots     [B] int    the sequence's state-pool slot, also its block-table row
    lengths   [B] int    tokens the sequence had before this step's token (where its latent is written)
    latents   [n_mla, pages, P, R+r]    MLA latent pages (`PagePool.pages`), layer order = sorted MLA layers
    tables    [slots + 1, max_pages] int32  block tables (`BlockTables.tables`)
    conv      [n_kda, slots + 1, C, W-1]    KDA conv windows (`StatePool.conv`), layer order = sorted KDA layers
    recurrent [n_kda, slots + 1, H, K, V]   KDA states, fp32 (`StatePool.recurrent`)
    """

    slots: torch.Tensor
    lengths: torch.Tensor
    latents: torch.Tensor
    tables: torch.Tensor
    conv: torch.Tensor
    recurrent: torch.Tensor
    kernels: str = "torch"
    num_splits: int = 1  # split-KV programs per sequence in the paged MLA kernel

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")


def kda_decode_step(layer: KimiDeltaAttention, x: torch.Tensor, j: int, batch: DecodeBatch) -> torch.Tensor:
    """x [B,1,D] -> [B,1,D] for KDA layer `layer` (pool index j)."""
    B = x.shape[0]
    H, K = layer.num_heads, layer.head_dim
    conv_pool, state_pool = batch.conv[j], batch.recurrent[j]
    if batch.kernels == "triton":
        from openk3.ops.kda.triton import causal_conv_step, kda_decode

        qkv, b, f, gate = kda_input_projections(layer, x)
        y = causal_conv_step(qkv[:, 0], conv_pool, layer.conv_weight(), None, batch.slots, activation="silu")
        q, k, v = (t.reshape(B, 1, H, K) for t in y.split(H * K, dim=-1))
        # compiled (`ModelRunner`), the activations are PyTorch ops for Inductor to fuse with their neighbours
        q, k, g, beta = layer.activate_logits(q, k, f, b, "torch" if torch.compiler.is_compiling() else "triton")
        o = kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state_pool, batch.slots).unsqueeze(1)
        return layer.output_gated(gate, o, x.dtype)
    qkv = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)[:, 0]  # [B,3HK]
    backend = resolve_backend(layer.kda_backend, x.device, 1)  # the model's own choice for one token
    y, conv_pool[batch.slots] = causal_conv1d_step(qkv, layer.conv_weight(), conv_pool[batch.slots])
    q, k, v = (t.reshape(B, 1, H, K) for t in y.split(H * K, dim=-1))
    q, k, g, beta = layer.activate(q, k, x, backend)
    o, state_pool[batch.slots] = kda(q, k, v, g, beta, initial_state=state_pool[batch.slots],
                                     output_final_state=True, backend=backend, gate_min=layer.gate_min())
    return layer.output(x, o)


def kda_input_projections(layer: KimiDeltaAttention, x: torch.Tensor):
    """x [B,1,D] -> (q|k|v [B,1,3HK], beta's logits [B,1,H], the forget gate's logits [B,1,H,K], the output
    gate's logits [B,1,HV]): one matrix-vector product over `fused_input_weight` when the layer has it
    (`KimiDeltaAttention.fuse_input_projections`; the engine fuses at start-up), else one per projection."""
    B, T, _ = x.shape
    H, K = layer.num_heads, layer.head_dim
    linears, fused = layer.input_linears(), layer.fused_input_weight
    y = F.linear(x, fused) if fused is not None else torch.cat([lin(x) for lin in linears], dim=-1)
    qkv, b, f_low, g_low = y.split([3 * H * K, H, K, linears[-1].weight.shape[0]], dim=-1)
    gate = g_low if layer.output_gate == "full" else layer.g_b_proj(g_low)
    return qkv, b, layer.f_b_proj(f_low).view(B, T, H, K), gate


def mla_decode_step(layer: GatedMLA, x: torch.Tensor, j: int, batch: DecodeBatch) -> torch.Tensor:
    """x [B,1,D] -> [B,1,D] for MLA layer `layer` (pool index j)."""
    B = x.shape[0]
    H, n, v, R = layer.num_heads, layer.nope_dim, layer.v_head_dim, layer.kv_lora_rank
    pool = batch.latents[j]  # [pages, P, R+r]
    P, width = pool.shape[1], pool.shape[2]
    q = layer.query(x)  # [B,1,H,n+r]
    write_latents(pool, paged_positions(batch.tables, batch.slots, batch.lengths, P), layer.latent(x)[:, 0])
    if batch.kernels == "triton":
        w = layer.kv_b_proj.weight.view(H, n + v, R)
        q_latent = torch.einsum("bhn,hnr->bhr", q[:, 0, :, :n], w[:, :n])  # W_UK folded into the query
        q_absorbed = torch.cat([q_latent, q[:, 0, :, n:]], dim=-1)
        o_latent = paged_mla_decode(q_absorbed, pool, batch.tables, batch.slots, batch.lengths + 1, R, layer.scale,
                                    batch.num_splits)
        o = torch.einsum("bhr,hvr->bhv", o_latent.to(q.dtype), w[:, n:]).unsqueeze(1)  # W_UV on the way out
    else:
        L = int(batch.lengths.max()) + 1
        positions = torch.arange(L, device=x.device).expand(B, L)
        kv = pool.view(-1, width)[paged_positions(batch.tables, batch.slots, positions, P)]  # [B,L,R+r]
        o = mla_attention_absorbed(q, kv, layer.kv_b_proj.weight, nope_dim=n, v_dim=v, scale=layer.scale,
                                   lengths=batch.lengths)
    return layer.output(x, o)


def fuse_kda_inputs(model) -> None:
    """`KimiDeltaAttention.fuse_input_projections` on every KDA layer of `model` (the serving engine's start-up)."""
    for module in model.modules():
        if isinstance(module, KimiDeltaAttention):
            module.fuse_input_projections()


@torch.no_grad()
def decode_logits(model, ids: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
    """ids [B] (one new token per sequence) -> logits [B, vocab]; the pools advance by that token in place."""
    cfg = model.config
    index = {i: j for j, i in enumerate(sorted(cfg.kda_layers))}
    index.update({i: j for j, i in enumerate(sorted(cfg.mla_layers))})

    def attention(layer, h: torch.Tensor) -> torch.Tensor:
        step = kda_decode_step if layer.attn_kind == "kda" else mla_decode_step
        return step(layer.self_attn, h, index[layer.layer_idx], batch)

    m = model.model
    h = m.embed_tokens(ids.unsqueeze(1))  # [B,1,D]
    if m.block_size is None:
        for layer in m.layers:
            h = h + attention(layer, layer.input_layernorm(h))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
    else:
        stream = BlockStream(h, m.block_size)
        for layer in m.layers:
            x = stream.attn_input(layer.layer_idx, getattr(layer, "attn_res_proj", None),
                                  getattr(layer, "attn_res_norm", None))
            stream.add_attn(attention(layer, layer.input_layernorm(x)))
            x = stream.mlp_input(layer.mlp_res_proj, layer.mlp_res_norm)
            stream.add_mlp(layer.mlp(layer.post_attention_layernorm(x)))
        h = stream.output(m.output_res_proj, m.output_res_norm)
    return model.lm_head(m.norm(h))[:, 0]
