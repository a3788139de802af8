"""The hybrid decoder: embedding, the KDA / MLA layer schedule with Block AttnRes (or plain pre-norm residuals),
the final norm, the LM head and the multi-token-prediction layers; with a vision config, the vision tower and
projector whose image tokens replace the image placeholders of the input (SPEC §12)."""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from openk3.cache import HybridCache
from openk3.config import ModelConfig
from openk3.model.attnres import EAGER_PHASES, BlockStream, attn_res_epochs, pseudo_query
from openk3.model.common import RMSNorm
from openk3.model.documents import Documents
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA
from openk3.model.moe import GLUMLP, MoE, TopkRouter
from openk3.model.vision import ImageBatch, MMProjector, VisionTower


def is_int_at_least(value, low: int) -> bool:
    """An integer (a Python, NumPy or 0-d integer tensor one; not a bool) >= low."""
    if isinstance(value, bool):
        return False
    try:
        return operator.index(value) >= low
    except TypeError:
        return False


def check_input_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """TypeError / ValueError naming `input_ids` for what the embedding would fail on deep inside (or, on a GPU,
    with a device-side assert): not an integer tensor, not [B, T], empty. Ids outside [0, vocab_size) are refused
    for a CPU tensor; on another device reading them back would cost a synchronisation per forward (and break CUDA
    graph capture), so there they are the caller's to check."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids [batch, tokens], got "
                        f"{type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids (torch.long), got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, tokens] (2-D), got shape {list(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {list(input_ids.shape)}); pass at least one token per sequence")
    if input_ids.device.type == "cpu" and not torch.compiler.is_compiling():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"input_ids holds token id {bad}, outside the model's vocabulary [0, {vocab_size})")


class DecoderLayer(nn.Module):
    """self_attn (KimiDeltaAttention or GatedMLA), mlp (MoE or dense GLUMLP), input_layernorm,
    post_attention_layernorm, and with Block AttnRes the pseudo-queries attn_res_* (not on layer 0) and mlp_res_*.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, attn_kind: str | None = None,
                 ffn_kind: str | None = None, attn_res: bool | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_kind = attn_kind or cfg.layer_kind(layer_idx)
        self.ffn_kind = ffn_kind or cfg.ffn_kind(layer_idx)
        D = cfg.hidden_size
        self.self_attn = KimiDeltaAttention(cfg, layer_idx) if self.attn_kind == "kda" else GatedMLA(cfg, layer_idx)
        self.mlp = MoE(cfg) if self.ffn_kind == "moe" else GLUMLP(cfg, D, cfg.dense_hidden)
        self.input_layernorm = RMSNorm(D, eps=cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(D, eps=cfg.rms_eps)
        self.use_attn_res = cfg.attn_res_block_size is not None if attn_res is None else attn_res
        if self.use_attn_res:
            if layer_idx > 0:
                self.attn_res_proj, self.attn_res_norm = pseudo_query(D), RMSNorm(D, eps=cfg.rms_eps)
            self.mlp_res_proj, self.mlp_res_norm = pseudo_query(D), RMSNorm(D, eps=cfg.rms_eps)

    def forward(self, h: torch.Tensor, cache: HybridCache | None = None, documents: Documents | None = None
                ) -> torch.Tensor:
        """Plain pre-norm residual (Kimi Linear, the MTP block); the second residual add fused into the norm.
        `documents`: a packed batch's boundaries, for the token mixer (the FFN and norms are per token)."""
        x, h = self.post_attention_layernorm.add_forward(self._mix(self.input_layernorm(h), cache, documents), h)
        return h + self.mlp(x)

    def forward_block(self, stream: BlockStream, cache: HybridCache | None = None,
                      documents: Documents | None = None) -> None:
        """Block AttnRes: reads and updates `stream` (SPEC §4). AttnRes mixes over depth, token by token, so it
        needs nothing of `documents`; the token mixer does."""
        x = stream.attn_input(self.layer_idx, getattr(self, "attn_res_proj", None),
                              getattr(self, "attn_res_norm", None), then=self.input_layernorm)
        stream.add_attn(self._mix(x, cache, documents))
        x = stream.mlp_input(self.mlp_res_proj, self.mlp_res_norm, then=self.post_attention_layernorm)
        stream.add_mlp(self.mlp(x))

    def _mix(self, x: torch.Tensor, cache: HybridCache | None, documents: Documents | None) -> torch.Tensor:
        """The token mixer, called as before without documents (wrappers that take (x, cache) keep working)."""
        return self.self_attn(x, cache) if documents is None else self.self_attn(x, cache, documents=documents)


class K3Model(nn.Module):
    """embed_tokens, layers, norm (+ output_res_proj / output_res_norm with Block AttnRes)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        D = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, D)
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=cfg.init_std)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.block_size = cfg.attn_res_block_size
        if self.block_size is not None:
            self.output_res_proj, self.output_res_norm = pseudo_query(D), RMSNorm(D, eps=cfg.rms_eps)
            self.attn_res_phases = EAGER_PHASES  # compile_blocks swaps in compiled versions
        self.norm = RMSNorm(D, eps=cfg.rms_eps)

    def forward(self, input_ids: torch.Tensor, cache: HybridCache | None = None,
                inputs_embeds: torch.Tensor | None = None, documents: Documents | None = None) -> torch.Tensor:
        """input_ids [B,T] (or their embeddings, inputs_embeds [B,T,D]) -> the hidden state before the final norm
        [B,T,D]. `documents`: the document boundaries of a packed batch (training; openk3.model.documents)."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.block_size is None:
            for layer in self.layers:
                h = layer(h, cache, documents)
            return h
        epochs = attn_res_epochs(self.layers, (self.output_res_proj, self.output_res_norm), self.block_size)
        stream = BlockStream(h, self.block_size, epochs, self.attn_res_phases)
        for layer in self.layers:
            layer.forward_block(stream, cache, documents)
        return stream.output(self.output_res_proj, self.output_res_norm)


class MTPLayer(nn.Module):
    """One multi-token-prediction depth (DeepSeek-V3 style):
        h' = eh_proj([enorm(embed(token t+k)) ; hnorm(h_t)])      eh_proj [D, 2D]: columns [:D] read the embedding
        h' = block(h')                                             one decoder layer, plain pre-norm residual
        logits = lm_head(norm(h'))                                 the main model's (shared) LM head
    The block is a Gated MLA layer (global attention over the sequence, as DeepSeek-V3's MTP block; the incoming
    hidden states already carry order from the KDA layers, so NoPE is fine) with the model's MoE FFN (dense when
    cfg.moe is None). Parameter names: mtp.{k}.{enorm,hnorm,eh_proj,block.*,norm}."""

    def __init__(self, cfg: ModelConfig, depth: int):
        super().__init__()
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, eps=cfg.rms_eps)
        self.hnorm = RMSNorm(D, eps=cfg.rms_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        nn.init.normal_(self.eh_proj.weight, mean=0.0, std=cfg.init_std)
        self.block = DecoderLayer(cfg, cfg.num_layers + depth, attn_kind="mla",
                                  ffn_kind="moe" if cfg.moe is not None else "dense", attn_res=False)
        self.norm = RMSNorm(D, eps=cfg.rms_eps)

    def forward(self, hidden: torch.Tensor, next_embed: torch.Tensor, documents: Documents | None = None
                ) -> torch.Tensor:
        """hidden [B,T,D] (h_t), next_embed [B,T,D] (embedding of the token k positions ahead) -> [B,T,D];
        `documents`: the boundaries of these T positions in a packed batch (the block attends within them)."""
        return self.block(self.combine(hidden, next_embed), None, documents)

    def combine(self, hidden: torch.Tensor, next_embed: torch.Tensor) -> torch.Tensor:
        """The block's input h' (the class docstring); `compile_blocks` compiles it, so the norms, the concatenation
        and autocast's cast are one pass each way."""
        return self.eh_proj(torch.cat([self.enorm(next_embed), self.hnorm(hidden)], dim=-1))


@dataclass
class K3Output:
    logits: torch.Tensor | None  # [B,T,vocab] (the last `logits_to_keep` positions if set); None: return_logits=False
    mtp_logits: torch.Tensor | None = None  # [B,T-1,vocab]: position t predicts token t+2
    mtp_logits_all: list[torch.Tensor] | None = None  # depth k (1-based): [B,T-k,vocab], position t -> token t+k+1
    hidden_states: torch.Tensor | None = None  # [B,T,D] before the final norm (what the MTP layers read)
    # return_logits=False: the LM head's inputs instead of its outputs (training applies the head inside its loss,
    # openk3.ops.loss): norm(hidden) [B,T,D] and, per MTP depth k, that layer's normed output [B,T-k,D]
    head_inputs: torch.Tensor | None = None
    mtp_head_inputs: list[torch.Tensor] | None = None


class K3ForCausalLM(nn.Module):
    """The K3 / Kimi Linear language model. Parameter names mirror HF's KimiLinearForCausalLM where the component is
    the same: model.embed_tokens, model.layers.{i}.{self_attn,mlp,input_layernorm,post_attention_layernorm}.*,
    model.norm, lm_head; K3 additions: model.layers.{i}.{attn_res,mlp_res}_{proj,norm}, model.output_res_*,
    mtp.{k}.* (see the module docstrings for each projection's layout); with cfg.vision, vision_tower.* and
    mm_projector.* (openk3.model.vision, the released names).

    `model(input_ids)` -> K3Output(logits, mtp_logits). `model(input_ids, cache=model.new_cache(B))` appends the
    tokens to the cache's sequences (then mtp_logits is None). Images: `model(ids, images=ImageBatch)` encodes
    them and puts their tokens, in order, at the positions where ids hold cfg.vision.image_token_id (row-major over
    the batch: one placeholder per image token, the prompt already expanded); `image_embeds=` [N, hidden] passes
    tokens encoded beforehand (`encode_images`), e.g. the slice of a prompt's image tokens a prefill chunk holds.
    Without either, placeholder ids embed like any token."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = K3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=cfg.init_std)
        self.mtp = nn.ModuleList(MTPLayer(cfg, k) for k in range(cfg.mtp_layers)) if cfg.mtp_layers else None
        if cfg.vision is not None:
            self.vision_tower = VisionTower(cfg)
            self.mm_projector = MMProjector(cfg)

    def encode_images(self, images: ImageBatch) -> torch.Tensor:
        """Packed images -> their image tokens [N, hidden] (image after image, each in raster order)."""
        if self.config.vision is None:
            raise ValueError(f"model {self.config.name!r} has no vision tower (config field 'vision' is None)")
        return self.mm_projector(self.vision_tower(images), images.grid_hws)

    def embed_inputs(self, input_ids: torch.Tensor, images: ImageBatch | None = None,
                     image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings [B,T,D] with image tokens at the placeholder positions (see the class docstring)."""
        h = self.model.embed_tokens(input_ids)
        if images is not None:
            if image_embeds is not None:
                raise ValueError("pass images or image_embeds, not both")
            image_embeds = self.encode_images(images)
        if image_embeds is None:
            return h
        slots = input_ids == self.config.vision.image_token_id
        if int(slots.sum()) != image_embeds.shape[0]:
            raise ValueError(f"input_ids hold {int(slots.sum())} image placeholders "
                             f"(id {self.config.vision.image_token_id}) for {image_embeds.shape[0]} image tokens")
        return h.masked_scatter(slots.unsqueeze(-1), image_embeds.to(h.dtype))

    def new_cache(self, batch_size: int, capacity: int = 0) -> HybridCache:
        """An empty decode cache for `batch_size` sequences on this model's device and dtype."""
        for name, value, low in (("batch_size", batch_size, 1), ("capacity", capacity, 0)):
            if not is_int_at_least(value, low):
                raise ValueError(f"new_cache: {name} must be an integer >= {low}, got {value!r}")
        p = self.model.embed_tokens.weight
        return HybridCache.empty(self.config, batch_size, device=p.device, dtype=p.dtype, capacity=capacity)

    def forward(self, input_ids: torch.Tensor, cache: HybridCache | None = None, *, logits_to_keep: int = 0,
                return_mtp: bool = True, return_logits: bool = True, images: ImageBatch | None = None,
                image_embeds: torch.Tensor | None = None, documents: Documents | None = None) -> K3Output:
        """input_ids [B,T]. logits_to_keep > 0 computes logits for the last that many positions only.
        return_logits=False leaves the logits None and returns the LM head's inputs (K3Output.head_inputs,
        mtp_head_inputs), for a loss that applies the head itself without [B,T,vocab] logits. `documents`: the
        document boundaries of a packed batch (openk3.model.documents; no cache): every token mixer works within
        each document, the MTP blocks too (an MTP position whose target lies in the next document is computed
        all the same; the loss leaves it out, openk3.train.loop.lm_losses)."""
        check_input_ids(input_ids, self.config.vocab_size)
        if not is_int_at_least(logits_to_keep, 0):
            raise ValueError(f"logits_to_keep must be an integer >= 0 (0: every position), got {logits_to_keep!r}")
        B, T = input_ids.shape
        if cache is not None and cache.batch_size != B:
            raise ValueError(f"cache holds {cache.batch_size} sequences but input_ids has batch size {B}")
        if documents is not None and cache is not None:
            raise ValueError("packed documents are a training input: pass documents or a cache, not both")
        embeds = self.embed_inputs(input_ids, images, image_embeds)
        hidden = self.model(input_ids, cache, inputs_embeds=embeds, documents=documents)
        if cache is not None:
            cache.advance(T)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
        mtp_heads = None
        if self.mtp is not None and cache is None and return_mtp and T > 1:
            mtp_heads = []
            h = hidden
            for k, layer in enumerate(self.mtp, start=1):
                if T - k < 1:
                    break
                h = layer(h[:, : T - k], embeds[:, k:], None if documents is None else documents.prefix(T - k))
                mtp_heads.append(layer.norm(h))
        return self.head_output(hidden, self.model.norm(kept), mtp_heads, return_logits)

    def head_output(self, hidden: torch.Tensor, head_input: torch.Tensor, mtp_head_inputs: list[torch.Tensor] | None,
                    return_logits: bool) -> K3Output:
        """The K3Output from the LM head's inputs (the main head's, and each MTP depth's when the MTP layers ran):
        their logits, or (return_logits=False) the inputs themselves."""
        if not return_logits:
            return K3Output(logits=None, hidden_states=hidden, head_inputs=head_input, mtp_head_inputs=mtp_head_inputs)
        out = K3Output(logits=self.lm_head(head_input), hidden_states=hidden)
        if mtp_head_inputs is not None:
            out.mtp_logits_all = [self.lm_head(x) for x in mtp_head_inputs]
            out.mtp_logits = out.mtp_logits_all[0] if out.mtp_logits_all else None
        return out

    def routers(self) -> Iterator[tuple[int, TopkRouter]]:
        """(layer index, router) for every MoE layer; the MTP layers' routers come as num_layers + depth."""
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, MoE):
                yield i, layer.mlp.gate
        for k, layer in enumerate(self.mtp or []):
            if isinstance(layer.block.mlp, MoE):
                yield self.config.num_layers + k, layer.block.mlp.gate

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
