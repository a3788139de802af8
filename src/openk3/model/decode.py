"""One decode step of the hybrid model over the serving engine's pools: T new tokens for each of B sequences.

The model's own `forward` (with a `HybridCache`) is the prefill and reference path; this is the static-shape
decode walk the engine runs, and captures as CUDA graphs on a GPU: T = 1 for plain decode, T = K + 1 for the
verification of K speculative drafts (SPEC §11). It reads the layers' weights and submodules and keeps the model's
order of operations (Block AttnRes stream, norms, FFN / MoE; SPEC §4, §5). State lives in preallocated pools
addressed per sequence (`DecodeBatch`):
- KDA (SPEC §2): the conv window and the fp32 recurrent state of the sequence's slot, advanced by the T tokens in
  place; with `conv_out` / `recurrent_out` the states after each of the first T - 1 tokens are recorded too (the
  verification's rollback points);
- Gated MLA (SPEC §3): the new tokens' latents are written into the sequence's pages (block table row = its slot)
  at positions lengths[b] .. lengths[b] + T - 1, then attention runs in the absorbed form on the paged latents:
  W_UK folded into the query, W_UV applied to p . latent; the k_slice is used unrotated (NoPE). A sequence's T
  queries are one row of the paged kernel, each attending to the positions up to its own (the past read once).

Two kernel sets, same math: "triton" (the GPU path: `kda_decode`, `causal_conv_step`, `paged_mla_decode`, updating
the pools in place with no host synchronisation) and "torch" (the model's own ops on gathered states, one token at
a time: the reference, the CPU default, bit-for-bit the model's single-token forward up to the padding of the
latents). Either set runs the Linears that read one input as one product over their fused buffer when the model
has been fused (`openk3.model.common.fuse_inference_projections`, the engine's start-up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openk3.model.attnres import BlockStream
from openk3.model.common import linear_concat
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
    lengths   [B] int    tokens the sequence had before this step's tokens (where the first latent is written)
    latents   [n_mla, pages, P, R+r]    MLA latent pages (`PagePool.pages`), layer order = sorted MLA layers
    tables    [slots + 1, max_pages] int32  block tables (`BlockTables.tables`)
    conv      [n_kda, slots + 1, C, W-1]    KDA conv windows (`StatePool.conv`), layer order = sorted KDA layers
    recurrent [n_kda, slots + 1, H, K, V]   KDA states, fp32 (`StatePool.recurrent`)
    conv_out, recurrent_out  None, or [n_kda, B, T-1, ...] of the above's row shapes: filled with each sequence's
              states after each of its first T - 1 tokens (the state after the last one is in the pools)
    num_tokens  None (every row has T tokens) or [B] int: row b's first num_tokens[b] tokens are real, the rest
              padding that leaves its KDA states alone (short prefills of different lengths in one step); padding
              tokens still write latents past the row's end (rewritten before anything reads them)
    """

    slots: torch.Tensor
    lengths: torch.Tensor
    latents: torch.Tensor
    tables: torch.Tensor
    conv: torch.Tensor
    recurrent: torch.Tensor
    kernels: str = "torch"
    conv_out: torch.Tensor | None = None
    recurrent_out: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if (self.conv_out is None) != (self.recurrent_out is None):
            raise ValueError("conv_out and recurrent_out are recorded together: pass both or neither")


def kda_decode_step(layer: KimiDeltaAttention, x: torch.Tensor, j: int, batch: DecodeBatch) -> torch.Tensor:
    """x [B,T,D] -> [B,T,D] for KDA layer `layer` (pool index j)."""
    B, T, _ = x.shape
    H, K = layer.num_heads, layer.head_dim
    conv_pool, state_pool = batch.conv[j], batch.recurrent[j]
    conv_out = None if batch.conv_out is None else batch.conv_out[j]
    state_out = None if batch.recurrent_out is None else batch.recurrent_out[j]
    if batch.kernels == "triton":
        from openk3.ops.kda.triton import causal_conv_step, kda_decode

        qkv, b, f, gate = kda_input_projections(layer, x)
        y = causal_conv_step(qkv, conv_pool, layer.conv_weight(), None, batch.slots, activation="silu",
                             states_out=conv_out, num_tokens=batch.num_tokens)
        q, k, v = (t.reshape(B, T, H, K) for t in y.split(H * K, dim=-1))
        # compiled (`ModelRunner`), the activations are PyTorch ops for Inductor to fuse with their neighbours
        q, k, g, beta = layer.activate_logits(q, k, f, b, "torch" if torch.compiler.is_compiling() else "triton")
        o = kda_decode(q, k, v, g, beta, state_pool, batch.slots, states_out=state_out, num_tokens=batch.num_tokens)
        return layer.output_gated(gate, o, x.dtype)
    outputs = []
    backend = resolve_backend(layer.kda_backend, x.device, 1)  # the model's own choice for one token
    for t in range(T):  # the reference: the model's one-token ops, a token at a time
        xt = x[:, t:t + 1]
        qkv = layer.qkv(xt)[:, 0]  # [B,3HK]
        y, conv = causal_conv1d_step(qkv, layer.conv_weight(), conv_pool[batch.slots])
        q, k, v = (t_.reshape(B, 1, H, K) for t_ in y.split(H * K, dim=-1))
        f, b, gate = layer.gate_projections(xt)
        q, k, g, beta = layer.activate_logits(q, k, f, b, backend)
        o, state = kda(q, k, v, g, beta, initial_state=state_pool[batch.slots], output_final_state=True,
                       backend=backend, gate_min=layer.gate_min())
        if batch.num_tokens is not None:  # a padding token keeps its row's states
            real = (batch.num_tokens > t).view(B, 1, 1)
            conv = torch.where(real, conv, conv_pool[batch.slots])
            state = torch.where(real.unsqueeze(-1), state, state_pool[batch.slots])
        conv_pool[batch.slots], state_pool[batch.slots] = conv, state
        if t < T - 1 and conv_out is not None:
            conv_out[:, t], state_out[:, t] = conv_pool[batch.slots], state_pool[batch.slots]
        outputs.append(layer.output_gated(gate, o, xt.dtype))
    return torch.cat(outputs, dim=1)


def kda_input_projections(layer: KimiDeltaAttention, x: torch.Tensor):
    """x [B,T,D] -> (q|k|v [B,T,3HK], beta's logits [B,T,H], the forget gate's logits [B,T,H,K], the output
    gate's logits [B,T,HV]): one product over the layer's `fused["input"]` when it has it
    (`FusableLinears`; the engine fuses at start-up), else one per projection."""
    B, T, _ = x.shape
    H, K = layer.num_heads, layer.head_dim
    linears = layer.input_linears()
    y = linear_concat(x, linears, layer.fused.get("input"))
    qkv, b, f_low, g_low = y.split([3 * H * K, H, K, linears[-1].weight.shape[0]], dim=-1)
    gate = g_low if layer.output_gate == "full" else layer.g_b_proj(g_low)
    return qkv, b, layer.f_b_proj(f_low).view(B, T, H, K), gate


def mla_decode_step(layer: GatedMLA, x: torch.Tensor, j: int, batch: DecodeBatch) -> torch.Tensor:
    """x [B,T,D] -> [B,T,D] for MLA layer `layer` (pool index j): the T latents are written first, then token t
    attends to the positions up to lengths[b] + t."""
    B, T, _ = x.shape
    H, n, v, R = layer.num_heads, layer.nope_dim, layer.v_head_dim, layer.kv_lora_rank
    pool = batch.latents[j]  # [pages, P, R+r]
    P, width = pool.shape[1], pool.shape[2]
    q, latent, gate = layer.input_projections(x)  # q [B,T,H,n+r]
    positions = batch.lengths.view(B, 1) + torch.arange(T, device=x.device)  # [B,T]
    write_latents(pool, paged_positions(batch.tables, batch.slots, positions, P).reshape(-1),
                  latent.reshape(B * T, width))
    if batch.kernels == "triton":
        w = layer.kv_b_proj.weight.view(H, n + v, R)
        q_latent = torch.einsum("bhn,hnr->bhr", q[..., :n].reshape(B * T, H, n), w[:, :n])  # W_UK into the query
        q_absorbed = torch.cat([q_latent, q[..., n:].reshape(B * T, H, -1)], dim=-1).view(B, T, H, -1)
        # a sequence's T queries in one kernel row: its past is read once for all of them (padding reads nothing)
        o_latent = paged_mla_decode(q_absorbed, pool, batch.tables, batch.slots, batch.lengths + 1, R, layer.scale,
                                    num_tokens=batch.num_tokens)
        o = torch.einsum("bhr,hvr->bhv", o_latent.reshape(B * T, H, R).to(q.dtype), w[:, n:]).view(B, T, H, v)
    else:
        L = int(batch.lengths.max()) + T
        every = torch.arange(L, device=x.device).expand(B, L)
        kv = pool.view(-1, width)[paged_positions(batch.tables, batch.slots, every, P)]  # [B,L,R+r]
        o = mla_attention_absorbed(q, kv, layer.kv_b_proj.weight, nope_dim=n, v_dim=v, scale=layer.scale,
                                   lengths=batch.lengths)
    return layer.output_gated(gate, o, x.dtype)


@torch.no_grad()
def decode_forward(model, ids: torch.Tensor, batch: DecodeBatch, taps: tuple[int, ...] = (),
                   last: torch.Tensor | None = None):
    """ids [B,T] (T new tokens per sequence) -> (logits [B,T,vocab], the hidden states entering the layers in
    `taps` (what their input norms read: `openk3.draft.tapped_hidden_states`), [B,T,D] each, in taps' order); the
    pools advance by the T tokens in place. `last` [B]: only the logits at row b's position last[b], [B,1,vocab]."""
    cfg = model.config
    index = {i: j for j, i in enumerate(sorted(cfg.kda_layers))}
    index.update({i: j for j, i in enumerate(sorted(cfg.mla_layers))})
    tapped: dict[int, torch.Tensor] = {}

    def attention(layer, h: torch.Tensor) -> torch.Tensor:
        if layer.layer_idx in taps:
            tapped[layer.layer_idx] = h
        step = kda_decode_step if layer.attn_kind == "kda" else mla_decode_step
        return step(layer.self_attn, layer.input_layernorm(h), index[layer.layer_idx], batch)

    m = model.model
    h = m.embed_tokens(ids)  # [B,T,D]
    if m.block_size is None:
        for layer in m.layers:
            h = h + attention(layer, h)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
    else:
        stream = BlockStream(h, m.block_size)
        for layer in m.layers:
            x = stream.attn_input(layer.layer_idx, getattr(layer, "attn_res_proj", None),
                                  getattr(layer, "attn_res_norm", None))
            stream.add_attn(attention(layer, x))
            x = stream.mlp_input(layer.mlp_res_proj, layer.mlp_res_norm)
            stream.add_mlp(layer.mlp(layer.post_attention_layernorm(x)))
        h = stream.output(m.output_res_proj, m.output_res_norm)
    if last is not None:
        h = h[torch.arange(h.shape[0], device=h.device), last].unsqueeze(1)
    return model.lm_head(m.norm(h)), [tapped[i] for i in taps]


def decode_logits(model, ids: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
    """ids [B] (one new token per sequence) -> logits [B, vocab]; the pools advance by that token in place."""
    return decode_forward(model, ids.unsqueeze(1), batch)[0][:, 0]
