"""Parameter and cache accounting of a model configuration: one definition for `openk3 info` and `openk3 train`.

The model is built on the meta device (no memory), so even `k3` (2.8T parameters) is counted in a second.
Headline totals are the language model's (as the published 2.8T / 104B): embeddings, LM head and every layer with
all of its experts; the MTP layers and the vision tower with its projector (SPEC §12, `vision_tower.*` /
`mm_projector.*`) are counted on their own (`parameter_summary` names each). Activated parameters: everything
except the routed experts a token does not use, i.e. routed experts count top_k / num_experts of their size.
Embeddings and the LM head are included in both totals (once when tied).

Cache accounting (per sequence): a KDA layer holds its recurrent state H*K*V in fp32 and its conv state
(2HK+HV)*(W-1) in the activation dtype (bf16): constant in the sequence length. An MLA layer holds
kv_lora_rank + qk_rope_head_dim values per token in bf16.
"""

from __future__ import annotations

import torch

from openk3.config import ModelConfig

COMPONENTS = (
    "embeddings", "lm_head", "kda", "mla", "moe_experts", "moe_shared", "moe_latent", "moe_router",
    "dense_ffn", "attn_res", "norms",
)
BF16_BYTES, FP32_BYTES = 2, 4


def build_meta_model(cfg: ModelConfig):
    """The model with every tensor on the meta device (shapes only)."""
    from openk3.model import K3ForCausalLM

    with torch.device("meta"):
        return K3ForCausalLM(cfg)


def component_of(name: str, cfg: ModelConfig) -> str:
    """Which accounting bucket a parameter name belongs to ("mtp", "vision_tower", "mm_projector" outside the
    language model's totals)."""
    if name.startswith("mtp."):
        return "mtp"
    if name.startswith(("vision_tower.", "mm_projector.")):
        return name.split(".")[0]
    if name.startswith("model.embed_tokens."):
        return "embeddings"
    if name.startswith("lm_head."):
        return "lm_head"
    if "_res_" in name:
        return "attn_res"
    if name.startswith("model.layers."):
        layer = int(name.split(".")[2])
        rest = name.split(".", 3)[3]
        if rest.startswith("self_attn."):
            return cfg.layer_kind(layer)
        if rest.startswith("mlp."):
            part = rest.split(".")[1]
            if cfg.ffn_kind(layer) == "dense":
                return "dense_ffn"
            return {"experts": "moe_experts", "shared_experts": "moe_shared", "gate": "moe_router"}.get(
                part, "moe_latent"
            )
    return "norms"  # input_layernorm, post_attention_layernorm, model.norm


def count_parameters(cfg: ModelConfig) -> dict:
    """{"total_params", "active_params", "breakdown": {component: count}, "mtp_params", "mtp_active_params",
    "vision_params", "vision_breakdown": {"vision_tower", "mm_projector"}} (vision: 0 for a text-only model)."""
    model = build_meta_model(cfg)
    breakdown = dict.fromkeys(COMPONENTS, 0)
    vision = {"vision_tower": 0, "mm_projector": 0}
    mtp = mtp_experts = 0
    for name, p in model.named_parameters():  # tied weights are listed once
        comp = component_of(name, cfg)
        if comp == "mtp":
            mtp += p.numel()
            mtp_experts += p.numel() if ".mlp.experts." in name else 0
        elif comp in vision:
            vision[comp] += p.numel()
        else:
            breakdown[comp] += p.numel()
    total = sum(breakdown.values())
    idle = 0.0
    if cfg.moe is not None:
        idle = 1.0 - cfg.moe.top_k / cfg.moe.num_experts
    active = total - round(breakdown["moe_experts"] * idle)
    return {
        "total_params": total,
        "active_params": active,
        "breakdown": breakdown,
        "mtp_params": mtp,
        "mtp_active_params": mtp - round(mtp_experts * idle),
        "vision_params": sum(vision.values()),
        "vision_breakdown": vision,
    }


def cache_bytes(cfg: ModelConfig, context: int = 1 << 20) -> dict:
    """Decode-cache sizes in bytes: KDA state (constant per sequence), MLA latent per token, a sequence at `context`."""
    H, K, W = cfg.kda.num_heads, cfg.kda_head_dim, cfg.kda.conv_kernel
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    kda_recurrent = n_kda * H * K * K * FP32_BYTES
    kda_conv = n_kda * 3 * H * K * (W - 1) * BF16_BYTES
    mla_per_token = n_mla * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * BF16_BYTES
    constant = kda_recurrent + kda_conv
    return {
        "kda_layers": n_kda,
        "mla_layers": n_mla,
        "kda_recurrent_bytes_per_sequence": kda_recurrent,
        "kda_conv_bytes_per_sequence": kda_conv,
        "kda_bytes_per_sequence": constant,
        "mla_bytes_per_token": mla_per_token,
        "context_tokens": context,
        "mla_bytes_per_sequence_at_context": mla_per_token * context,
        "bytes_per_sequence_at_context": constant + mla_per_token * context,
        "bytes_per_token_at_context": (constant + mla_per_token * context) / max(context, 1),
    }


def short_count(n: float) -> str:
    """2824920 -> '2.825M' (three decimals, K / M / B / T)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3f}{unit}"
    return str(int(n))


def expert_bytes(routed_expert_params: int) -> dict:
    """Bytes of the routed experts' weights in bf16 and in MXFP4 (SPEC §13: a 4-bit value each plus one 8-bit
    E8M0 scale per 32, i.e. 17/32 byte per weight), as the released checkpoint stores them."""
    return {"bf16": routed_expert_params * BF16_BYTES, "mxfp4": routed_expert_params * 17 // 32}


def parameter_summary(counts: dict) -> str:
    """One line for a run's announcement: "2.825M parameters + 0.241M MTP" (+ the vision tower and projector)."""
    extras = [(counts["mtp_params"], "MTP"), (counts["vision_params"], "vision tower and projector")]
    return f"{short_count(counts['total_params'])} parameters" + "".join(
        f" + {short_count(n)} {name}" for n, name in extras if n)
