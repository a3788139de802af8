"""The EAGLE-3-style draft model (SPEC §11): the target's MTP layer reading a fusion of three target hidden states.

Features: the hidden states entering three target layers (`taps`, low / middle / high; EAGLE-3's reference taps
layers 2, L//2 and L-3) are concatenated and projected by a bias-free Linear(3D -> D), `fc`: F_t = fc([h_lo; h_mid;
h_hi]) at position t. "Entering layer i" is what layer i's attention reads before its input norm: the residual
stream, or with Block AttnRes the layer's attention mix (SPEC §4). `tapped_hidden_states` records them with forward
pre-hooks on those norms, so any forward of the target (training batch, prefill, verification) yields them.

The draft at position t reads (prev_t, x_t): x_t the token at t, prev_t = F_{t-1} (zeros at t = 0) when the draft
works on the target's context, or the draft's own output hidden at t-1 when it drafts ahead. It runs the MTP
layer's pieces: x = eh_proj([enorm(embed(x_t)); hnorm(prev_t)]), one Gated MLA + FFN block (plain pre-norm
residual), logits = lm_head(norm(h)) with the target's embedding and LM head (shared, frozen). Its output at t
predicts x_{t+1}, the target's own prediction there. The draft latent at t depends only on tokens <= t, so it
can be cached with the target's latents at the same position (the serving engine's paged pool does so).

Training-time test (`unroll`, EAGLE-3): step 0 runs the draft on the target's features at every position of a
window; step i > 0 feeds each position its own step-(i-1) output with the true token i positions further, and
attends to the real context (step-0 latents at positions <= t) plus its own earlier drafted positions (steps 1..i
at t), as it will when drafting.

Files in a checkpoint directory: the fine-tuned MTP layer is the target's `mtp.{depth}` (model.safetensors, the
released layout's layers.{L+depth}); `draft.safetensors` holds `fc.weight`; `draft.json` the taps, the MTP depth
and how it was trained.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from openk3.cache import MLALayerCache
from openk3.model.decode import DecodeBatch, mla_decode_step
from openk3.ops.attention import mla_expand_kv, mla_mask

DRAFT_CONFIG = "draft.json"
DRAFT_WEIGHTS = "draft.safetensors"
FORMAT_VERSION = 1


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's reference taps: the hidden states entering layers 2, L//2 and L-3, each clamped into [0, L-1]."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


@contextmanager
def tapped_hidden_states(model: nn.Module, taps: tuple[int, ...]) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, every forward of `model` (a K3ForCausalLM) stores the hidden state entering each layer in
    `taps` into the yielded dict (layer index -> [B,T,D]; a later forward replaces it)."""
    tapped: dict[int, torch.Tensor] = {}
    hooks = []
    for i in sorted(set(taps)):
        def record(module, args, i=i):
            tapped[i] = args[0]
        hooks.append(model.model.layers[i].input_layernorm.register_forward_pre_hook(record))
    try:
        yield tapped
    finally:
        for hook in hooks:
            hook.remove()


class EagleDraft(nn.Module):
    """fc [D, 3D] (bias-free) + the target's MTP layer `mtp[depth]` (shared with the target, fine-tuned in place),
    with the target's embed_tokens and lm_head (shared, never trained). `taps`: the three target layers read."""

    def __init__(self, target: nn.Module, taps: tuple[int, ...] | None = None, depth: int = 0):
        super().__init__()
        cfg = target.config
        if target.mtp is None or not 0 <= depth < len(target.mtp):
            raise ValueError(f"the target {cfg.name!r} has {cfg.mtp_layers} MTP layers (config field mtp_layers): "
                             f"the draft is fine-tuned from MTP layer {depth}")
        taps = default_taps(cfg.num_layers) if taps is None else tuple(int(i) for i in taps)
        if len(taps) != 3 or not all(0 <= i < cfg.num_layers for i in taps):
            raise ValueError(f"draft taps must be 3 layer indices in [0, {cfg.num_layers - 1}], got {list(taps)}")
        D = cfg.hidden_size
        self.taps, self.depth = taps, depth
        self.layer = target.mtp[depth]
        self.embed_tokens, self.lm_head = target.model.embed_tokens, target.lm_head
        weight = self.embed_tokens.weight
        self.fc = nn.Linear(3 * D, D, bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():  # start as the MTP layer reading the high tap alone
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * D:].copy_(torch.eye(D))

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [*self.fc.parameters(), *self.layer.parameters()]

    def fuse(self, tapped: dict[int, torch.Tensor]) -> torch.Tensor:
        """The recorded taps -> the draft features F [B,T,D]."""
        return self.fc(torch.cat([tapped[i] for i in self.taps], dim=-1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.layer.norm(hidden))

    def _block_input(self, prev: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        return layer.eh_proj(torch.cat([layer.enorm(self.embed_tokens(tokens)), layer.hnorm(prev)], dim=-1))

    def _block(self, x: torch.Tensor, q: torch.Tensor, gate: torch.Tensor | None, kv: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """The MTP block from its Gated MLA's projections of input_layernorm(x) (q and the output gate's logits:
        `GatedMLA.input_projections`): attention over the latents kv [B,L,R+r] with the boolean mask [T,L] or
        [B,1,T,L], then the FFN; plain pre-norm residuals (as DecoderLayer.forward)."""
        block = self.layer.block
        attn = block.self_attn
        k, v = mla_expand_kv(kv, attn.kv_b_proj.weight, attn.num_heads, attn.nope_dim, attn.v_head_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=attn.scale)
        h = x + attn.output_gated(gate, o.transpose(1, 2), x.dtype)
        return h + block.mlp(block.post_attention_layernorm(h))

    def step(self, prev: torch.Tensor, tokens: torch.Tensor, latents: MLALayerCache,
             lengths: torch.Tensor) -> torch.Tensor:
        """Draft positions lengths[b] .. lengths[b] + T - 1 of each sequence: prev [B,T,D], tokens [B,T]. Their
        latents are written into `latents` at those positions (it holds the earlier ones); returns the draft's
        hidden states [B,T,D] (`logits` turns them into predictions of the next tokens)."""
        T = tokens.shape[1]
        x = self._block_input(prev, tokens)
        q, latent, gate = self.layer.block.self_attn.input_projections(self.layer.block.input_layernorm(x))
        kv = latents.append(latent, lengths, int(lengths.max()) + T)
        return self._block(x, q, gate, kv, mla_mask(lengths, T, kv.shape[1]))

    def decode(self, prev: torch.Tensor, tokens: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """`step` over the serving engine's pools with static shapes (`openk3.model.decode`, CUDA-graph safe):
        positions batch.lengths[b] .. + T - 1, the draft's latents in the last layer of batch.latents."""
        block = self.layer.block
        x = self._block_input(prev, tokens)
        h = x + mla_decode_step(block.self_attn, block.input_layernorm(x), batch.latents.shape[0] - 1, batch)
        return h + block.mlp(block.post_attention_layernorm(h))

    def unroll(self, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over windows: features F [B,T,D] and tokens [B,T] -> logits [B,T,V] per step i <
        `steps`; step i at index t predicts token t+i+1 (the target's distribution at position t+i), so only
        t < T - i is meaningful."""
        B, T = tokens.shape
        prev = torch.cat([features.new_zeros(B, 1, features.shape[-1]), features[:, :-1]], dim=1)
        context = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
        own = torch.eye(T, dtype=torch.bool, device=tokens.device)
        latents, out = [], []
        for i in range(steps):
            ahead = torch.cat([tokens[:, i:], tokens.new_zeros(B, i)], dim=1)  # x_{t+i} (0 past the window)
            x = self._block_input(prev, ahead)
            q, latent, gate = self.layer.block.self_attn.input_projections(self.layer.block.input_layernorm(x))
            latents.append(latent)
            prev = self._block(x, q, gate, torch.cat(latents, dim=1), torch.cat([context] + [own] * i, dim=1))
            out.append(self.logits(prev))
        return out


def save_draft(draft: EagleDraft, directory: str | Path, **training) -> None:
    """Write draft.safetensors (fc) and draft.json (taps, MTP depth, `training` notes) into `directory`; the MTP
    layer itself is saved with the target's weights."""
    from openk3.interop.files import save_safetensors

    directory = Path(directory)
    save_safetensors({"fc.weight": draft.fc.weight.detach().cpu().contiguous()}, directory / DRAFT_WEIGHTS)
    meta = {"format_version": FORMAT_VERSION, "taps": list(draft.taps), "mtp_depth": draft.depth,
            "training": training}
    (directory / DRAFT_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")


def has_draft(directory: str | Path) -> bool:
    return (Path(directory) / DRAFT_CONFIG).is_file()


def load_draft(target: nn.Module, directory: str | Path) -> EagleDraft:
    """The draft stored in a checkpoint directory, on `target` (loaded from the same directory)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not has_draft(directory):
        raise FileNotFoundError(f"{directory} holds no draft model ({DRAFT_CONFIG}); train one with "
                                f"`openk3 draft --ckpt {directory} --out DIR` and pass DIR")
    meta = json.loads((directory / DRAFT_CONFIG).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory / DRAFT_CONFIG} has format_version {meta.get('format_version')!r}; this "
                         f"openk3 reads {FORMAT_VERSION}")
    draft = EagleDraft(target, meta["taps"], meta["mtp_depth"])
    weights = load_file(directory / DRAFT_WEIGHTS)
    fc = weights.get("fc.weight")
    if fc is None or fc.shape != draft.fc.weight.shape:
        raise ValueError(f"{directory / DRAFT_WEIGHTS} must hold fc.weight of shape {list(draft.fc.weight.shape)}, "
                         f"got {None if fc is None else list(fc.shape)}")
    with torch.no_grad():
        draft.fc.weight.copy_(fc)
    return draft
