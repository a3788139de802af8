"""Config translation between HF-style `config.json` dicts and openk3's ModelConfig.

Two external families (SPEC-K3 §1):
- "hub": Kimi Linear as HF transformers' `KimiLinearConfig` reads and writes it (model_type "kimi_linear").
- "k3": the released K3 layout: the text model's keys under `text_config`, with the K3 additions
  (`mla_use_output_gate`, `hidden_act: "situ"`, SiTU betas, `routed_expert_hidden_size` = latent width,
  `latent_moe_use_norm`, `attn_res_block_size`, `linear_attn_config.gate_lower_bound` / `use_full_rank_gate`).
  Settings openk3 has and the released config does not (the KDA gate family, the fused-conv switch, the disputed
  MLA output norm, the eps of the MLA latent norms, the config's name) travel in an `openk3` sub-dict of
  `text_config`; MTP depth uses DeepSeek-V3's `num_nextn_predict_layers`. The vision tower and projector
  (SPEC §12) are the `vision_config` section with the released keys (`vt_hidden_size`, `vt_num_hidden_layers`,
  `vt_num_attention_heads`, `qkv_hidden_size`, `vt_intermediate_size`, `patch_size`, `init_pos_emb_height` /
  `_width`, `pos_emb_interpolation_mode`, `merge_kernel_size`, `projector_ln_eps`, the design switches
  `norm_type: rmsnorm`, `mm_projector_type: patchmergerv2`, bias flags false, ...; key names and values as
  NeMo AutoModel's KimiK3VisionConfig and torchtitan's MoonViTConfig carry the released ones) and the top-level
  `media_placeholder_token_id`; openk3's own settings (the tower's norm eps, the RoPE base, the preprocessing
  pixel budget) travel in `vision_config.openk3`. No `vision_config`: a text-only model.

Both directions raise ValueError naming the field for anything openk3 cannot represent (or, when writing,
anything the target family cannot express). Layer lists in `linear_attn_config` are 1-based; openk3's are 0-based.
"""

from __future__ import annotations

import math
from typing import Any

from openk3.config import KDAConfig, MLAConfig, ModelConfig, MoEConfig, VisionConfig

_MISSING = object()


def _pick(d: dict[str, Any], *names: str, default: Any = _MISSING, kind: type | None = None) -> Any:
    """The first of `names` present in d (HF configs spell some fields two ways), else default; with `kind` (int or
    float) converted to it, a ValueError naming the field for a value that is not such a number (a string, a bool,
    a fractional or non-finite number where an integer belongs)."""
    for name in names:
        if name in d:
            value = d[name]
            if kind is None:
                return value
            if value is None and default is not _MISSING:  # null: as if absent
                return default
            return _number(value, name, kind)
    if default is _MISSING:
        raise ValueError(f"config.json lacks required field {names[0]!r}")
    return default if kind is None or default is None else _number(default, names[0], kind)


def _number(value: Any, field: str, kind: type) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise ValueError(f"config field {field!r} must be {'an integer' if kind is int else 'a number'}, "
                         f"got {value!r}")
    return kind(value)


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"unsupported config field {field!r}: {message}")


# ---- reading -------------------------------------------------------------------------------------------------

def _mla_layers(d: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Zero-based MLA positions: `layer_types` wins (as in transformers), else linear_attn_config's 1-based lists."""
    if d.get("layer_types") is not None:
        types = list(d["layer_types"])
        _require(len(types) == num_layers, "layer_types", f"needs {num_layers} entries, got {len(types)}")
        unknown = sorted(set(types) - {"full_attention", "linear_attention"})
        _require(not unknown, "layer_types", f"entries must be full_attention/linear_attention, got {unknown}")
        return tuple(i for i, t in enumerate(types) if t == "full_attention")
    lac = d.get("linear_attn_config") or {}
    full = [int(i) for i in _pick(lac, "full_attn_layers")]
    kda = [int(i) for i in _pick(lac, "kda_layers")]
    covered = sorted(full + kda)
    _require(covered == list(range(1, num_layers + 1)), "linear_attn_config.full_attn_layers/kda_layers",
             f"must together list each layer 1..{num_layers} exactly once, got full={full} kda={kda}")
    return tuple(sorted(i - 1 for i in full))


def _first_k_dense(d: dict[str, Any], num_layers: int) -> int:
    """`mlp_layer_types` wins (as in transformers); openk3 models only a dense prefix followed by MoE layers."""
    _require(d.get("moe_layer_freq", 1) in (1, None), "moe_layer_freq", "only 1 (every layer after the dense prefix "
             f"is MoE) is supported, got {d.get('moe_layer_freq')!r}")
    if d.get("mlp_layer_types") is None:
        return _pick(d, "first_k_dense_replace", default=1, kind=int)
    types = list(d["mlp_layer_types"])
    k = types.count("dense")
    _require(types == ["dense"] * k + ["sparse"] * (num_layers - k), "mlp_layer_types",
             f"must be {num_layers} entries, 'dense' then 'sparse', got {types}")
    return k


def _moe(d: dict[str, Any], k3: bool) -> MoEConfig | None:
    raw = _pick(d, "num_experts", "num_local_experts")
    num_experts = 0 if raw is None else _number(raw, "num_experts", int)
    if num_experts == 0:  # openk3 writes 0 for a model without MoE layers
        return None
    n_group = int(_pick(d, "num_expert_group", "n_group", default=1) or 1)
    topk_group = int(_pick(d, "topk_group", default=1) or 1)
    _require(n_group == 1 or topk_group >= n_group, "num_expert_group (n_group)",
             f"grouped top-k routing is not modelled; need n_group == 1 or topk_group >= n_group, "
             f"got n_group={n_group}, topk_group={topk_group}")
    activation = d.get("moe_router_activation_func", "sigmoid")
    _require(activation == "sigmoid", "moe_router_activation_func", f"only 'sigmoid' is supported, got {activation!r}")
    latent = d.get("routed_expert_hidden_size") if k3 else None
    return MoEConfig(
        num_experts=num_experts,
        top_k=_pick(d, "num_experts_per_token", "num_experts_per_tok", kind=int),
        expert_hidden=_pick(d, "moe_intermediate_size", kind=int),
        num_shared_experts=_pick(d, "num_shared_experts", "n_shared_experts", default=1, kind=int),
        latent_dim=None if latent is None else _number(latent, "routed_expert_hidden_size", int),
        latent_norm=bool(d.get("latent_moe_use_norm", False)) if k3 else False,
        # absent: transformers' KimiLinearConfig default 2.446 (hub); K3's route scale 1.0 (SPEC §5)
        routed_scaling_factor=_pick(d, "routed_scaling_factor", default=1.0 if k3 else 2.446, kind=float),
        renormalize=bool(_pick(d, "moe_renormalize", "norm_topk_prob", default=True)),
    )


def _activation(d: dict[str, Any]) -> str:
    act = d.get("hidden_act", "silu")
    _require(act in ("silu", "situ"), "hidden_act", f"must be 'silu' (SwiGLU) or 'situ' (SiTU-GLU), got {act!r}")
    return "swiglu" if act == "silu" else "situ"


def _common(d: dict[str, Any], k3: bool) -> dict[str, Any]:
    """Fields both families spell the same way."""
    num_layers = _pick(d, "num_hidden_layers", kind=int)
    hidden = _pick(d, "hidden_size", kind=int)
    heads = _pick(d, "num_attention_heads", kind=int)
    kv_heads = d.get("num_key_value_heads")
    _require(kv_heads in (None, heads), "num_key_value_heads",
             f"MLA uses one K/V per head; must equal num_attention_heads={heads}, got {kv_heads}")
    _require(not d.get("attention_bias", False), "attention_bias", "biases in attention are not modelled")
    _require(d.get("mla_use_nope", True) is not False, "mla_use_nope", "openk3's MLA is NoPE only (SPEC §3)")
    lac = d.get("linear_attn_config") or {}
    kda = KDAConfig(
        num_heads=_pick(lac, "num_heads", default=_pick(d, "linear_num_heads", default=32, kind=int), kind=int),
        head_dim=_pick(lac, "head_dim", default=_pick(d, "linear_head_dim", default=128, kind=int), kind=int),
        conv_kernel=_pick(lac, "short_conv_kernel_size",
                          default=_pick(d, "linear_conv_kernel_dim", default=4, kind=int), kind=int),
    )
    mla = MLAConfig(
        num_heads=heads,
        q_lora_rank=_pick(d, "q_lora_rank", default=None, kind=int),
        kv_lora_rank=_pick(d, "kv_lora_rank", kind=int),
        qk_nope_head_dim=_pick(d, "qk_nope_head_dim", kind=int),
        qk_rope_head_dim=_pick(d, "qk_rope_head_dim", kind=int),
        v_head_dim=_pick(d, "v_head_dim", kind=int),
    )
    return dict(
        vocab_size=_pick(d, "vocab_size", kind=int),
        hidden_size=hidden,
        num_layers=num_layers,
        mla_layers=_mla_layers(d, num_layers),
        kda=kda,
        mla=mla,
        moe=_moe(d, k3),
        first_k_dense=_first_k_dense(d, num_layers),
        dense_hidden=_pick(d, "intermediate_size", kind=int),
        activation=_activation(d),
        rms_eps=_pick(d, "rms_norm_eps", default=1e-5, kind=float),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_seq_len=_pick(d, "max_position_embeddings", "model_max_length", default=4096, kind=int),
        init_std=_pick(d, "initializer_range", default=0.02, kind=float),
    )


# the released design switches openk3 implements (SPEC §12); any other value is refused when reading
_VISION_DESIGN = {
    "pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
    "norm_type": "rmsnorm", "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh", "projector_hidden_act": "gelu",
    "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
}


def _vision(d: dict[str, Any], text_hidden: int) -> VisionConfig | None:
    """The top-level `vision_config` (with `media_placeholder_token_id`) -> VisionConfig, None when absent."""
    v = d.get("vision_config")
    if v is None:
        return None
    for key, value in _VISION_DESIGN.items():
        _require(v.get(key, value) == value, f"vision_config.{key}", f"openk3 implements {value!r}, got {v[key]!r}")
    size = v.get("init_pos_emb_height", 64)
    _require(v.get("init_pos_emb_width", size) == size, "vision_config.init_pos_emb_width",
             f"the position table must be square; height is {size}")
    merge = list(v.get("merge_kernel_size", [2, 2]))
    _require(len(merge) == 2 and merge[0] == merge[1], "vision_config.merge_kernel_size",
             f"must be a square [m, m], got {merge}")
    width, heads = _pick(v, "vt_hidden_size", kind=int), _pick(v, "vt_num_attention_heads", kind=int)
    qkv = int(v.get("qkv_hidden_size") or width)
    _require(qkv % heads == 0, "vision_config.qkv_hidden_size", f"{qkv} must divide into {heads} heads")
    _require(v.get("mm_hidden_size", width) in (None, width), "vision_config.mm_hidden_size",
             f"must equal vt_hidden_size={width}")
    _require(v.get("text_hidden_size", text_hidden) == text_hidden, "vision_config.text_hidden_size",
             f"must equal the text hidden_size={text_hidden}")
    extra = v.get("openk3") or {}
    return VisionConfig(
        num_layers=_pick(v, "vt_num_hidden_layers", kind=int), hidden_size=width, num_heads=heads,
        head_dim=qkv // heads, intermediate_size=_pick(v, "vt_intermediate_size", kind=int),
        patch_size=int(v.get("patch_size", 14)), merge_size=int(merge[0]), pos_emb_size=int(size),
        pos_emb_interpolation=str(v.get("pos_emb_interpolation_mode", "bilinear")),
        rope_theta=_pick(extra, "rope_theta", default=10000.0, kind=float),
        norm_eps=_pick(extra, "norm_eps", default=1e-5, kind=float),
        projector_eps=_pick(v, "projector_ln_eps", default=1e-5, kind=float),
        image_token_id=int(_pick(d, "media_placeholder_token_id", default=v.get("media_placeholder_token_id", 163605))),
        max_pixels=int(extra.get("max_pixels", VisionConfig.max_pixels)),
    )


def _vision_to_k3(vc: VisionConfig, text_hidden: int) -> dict[str, Any]:
    return {
        "model_type": "kimi_k3_vision", **_VISION_DESIGN,
        "vt_num_hidden_layers": vc.num_layers, "vt_hidden_size": vc.hidden_size, "vt_num_attention_heads": vc.num_heads,
        "qkv_hidden_size": vc.num_heads * vc.head_dim, "vt_intermediate_size": vc.intermediate_size,
        "patch_size": vc.patch_size, "init_pos_emb_height": vc.pos_emb_size, "init_pos_emb_width": vc.pos_emb_size,
        "init_pos_emb_time": 4, "pos_emb_interpolation_mode": vc.pos_emb_interpolation,
        "merge_kernel_size": [vc.merge_size, vc.merge_size], "mm_hidden_size": vc.hidden_size,
        "projector_ln_eps": vc.projector_eps, "text_hidden_size": text_hidden,
        "media_placeholder_token_id": vc.image_token_id,
        "openk3": {"norm_eps": vc.norm_eps, "rope_theta": vc.rope_theta, "max_pixels": vc.max_pixels},
    }


def config_from_hub(d: dict[str, Any]) -> ModelConfig:
    """A Kimi Linear `config.json` (as transformers writes it, or Moonshot's original) -> ModelConfig."""
    _require(_activation(d) == "swiglu", "hidden_act", "Kimi Linear's KDA conv uses hidden_act; only 'silu' matches")
    _require(int(d.get("num_nextn_predict_layers", 0) or 0) == 0, "num_nextn_predict_layers",
             "Kimi Linear checkpoints carry no MTP layers")
    fields = _common(d, k3=False)
    fields["tie_embeddings"] = False  # transformers' KimiLinearForCausalLM never ties; lm_head is always stored
    fields["kda"].gate, fields["kda"].output_gate, fields["kda"].fused_conv = "kimi", "lowrank", True
    fields["mla"].output_gate = False
    return ModelConfig(name=str(d.get("model_type", "kimi_linear")), attn_res_block_size=None, mtp_layers=0,
                       **fields)


def config_from_k3(d: dict[str, Any]) -> ModelConfig:
    """A K3-layout `config.json` (top level with `text_config`, or the text config itself) -> ModelConfig."""
    t = d.get("text_config", d)
    fields = _common(t, k3=True)
    lac = t.get("linear_attn_config") or {}
    extra = t.get("openk3") or {}
    fields["kda"].gate = extra.get("kda_gate", "k3")
    fields["kda"].gate_lower_bound = _pick(lac, "gate_lower_bound", default=-5.0, kind=float)
    fields["kda"].output_gate = "full" if lac.get("use_full_rank_gate", True) else "lowrank"
    fields["kda"].fused_conv = bool(extra.get("kda_fused_conv", False))
    fields["mla"].output_gate = bool(t.get("mla_use_output_gate", True))
    fields["mla"].output_norm = bool(extra.get("mla_output_norm", False))
    fields["mla"].norm_eps = _pick(extra, "mla_norm_eps", default=1e-6, kind=float)
    block = t.get("attn_res_block_size")
    return ModelConfig(
        name=str(extra.get("name", "k3")),
        situ_beta_gate=_pick(t, "activation_situ_beta", default=4.0, kind=float),
        situ_beta_up=_pick(t, "activation_situ_linear_beta", default=25.0, kind=float),
        attn_res_block_size=None if block is None else _number(block, "attn_res_block_size", int),
        mtp_layers=_pick(t, "num_nextn_predict_layers", default=0, kind=int),
        vision=_vision(d, fields["hidden_size"]),
        **fields,
    )


# ---- writing -------------------------------------------------------------------------------------------------

def _write_common(cfg: ModelConfig) -> dict[str, Any]:
    full = [i + 1 for i in cfg.mla_layers]
    d: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "intermediate_size": cfg.dense_hidden,
        "first_k_dense_replace": cfg.first_k_dense,
        "num_attention_heads": cfg.mla.num_heads,
        "num_key_value_heads": cfg.mla.num_heads,
        "q_lora_rank": cfg.mla.q_lora_rank,
        "kv_lora_rank": cfg.mla.kv_lora_rank,
        "qk_nope_head_dim": cfg.mla.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.mla.qk_rope_head_dim,
        "v_head_dim": cfg.mla.v_head_dim,
        "mla_use_nope": True,
        "hidden_act": "silu" if cfg.activation == "swiglu" else "situ",
        "rms_norm_eps": cfg.rms_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "linear_attn_config": {
            "full_attn_layers": sorted(full),
            "kda_layers": [i + 1 for i in cfg.kda_layers],
            "num_heads": cfg.kda.num_heads,
            "head_dim": cfg.kda_head_dim,
            "short_conv_kernel_size": cfg.kda.conv_kernel,
        },
    }
    moe = cfg.moe
    if moe is None:
        d["num_experts"] = 0
    else:
        d.update({
            "num_experts": moe.num_experts,
            "num_experts_per_token": moe.top_k,
            "num_shared_experts": moe.num_shared_experts,
            "moe_intermediate_size": moe.expert_hidden,
            "moe_renormalize": moe.renormalize,
            "routed_scaling_factor": moe.routed_scaling_factor,
            "moe_router_activation_func": "sigmoid",
            "num_expert_group": 1,
            "topk_group": 1,
            "moe_layer_freq": 1,
        })
    return d


def config_to_hub(cfg: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> a Kimi Linear `config.json` that transformers' KimiLinearConfig reads back to the same model.

    Raises ValueError listing every setting Kimi Linear cannot express (K3-only features)."""
    checks = {
        "activation": (cfg.activation == "swiglu", "'swiglu'"),
        "kda.gate": (cfg.kda.gate == "kimi", "'kimi'"),
        "kda.output_gate": (cfg.kda.output_gate == "lowrank", "'lowrank'"),
        "mla.output_gate": (not cfg.mla.output_gate, "False"),
        "mla.output_norm": (not cfg.mla.output_norm, "False"),
        "moe.latent_dim": (cfg.moe is None or cfg.moe.latent_dim is None, "None"),
        "attn_res_block_size": (cfg.attn_res_block_size is None, "None"),
        "mtp_layers": (cfg.mtp_layers == 0, "0"),
        "tie_embeddings": (not cfg.tie_embeddings, "False"),
        "mla.norm_eps": (cfg.mla.norm_eps == 1e-6, "1e-6, transformers' fixed eps of the MLA latent norms"),
        "vision": (cfg.vision is None, "None (Kimi Linear is text-only)"),
    }
    bad = [f"{name} (must be {allowed})" for name, (ok, allowed) in checks.items() if not ok]
    if bad:
        raise ValueError(f"the Kimi Linear hub layout cannot express these config fields: {', '.join(bad)}; "
                         "save with layout='k3' instead")
    d = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", **_write_common(cfg)}
    if cfg.moe is None:  # transformers builds MoE layers from first_k_dense_replace alone
        d["first_k_dense_replace"] = cfg.num_layers
    # transformers stores max_position_embeddings as model_max_length; absent pad/bos/eos would default to Kimi's
    # 163k-vocab token ids (out of range for a smaller vocab), so they are written as null.
    d["model_max_length"] = cfg.max_seq_len
    d.update(pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return d


def config_to_k3(cfg: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> a K3-layout `config.json` (text model under `text_config`); config_from_k3 inverts it."""
    t = {"model_type": "kimi_linear", **_write_common(cfg)}
    t["max_position_embeddings"] = cfg.max_seq_len
    t["mla_use_output_gate"] = cfg.mla.output_gate
    t["activation_situ_beta"] = cfg.situ_beta_gate
    t["activation_situ_linear_beta"] = cfg.situ_beta_up
    t["attn_res_block_size"] = cfg.attn_res_block_size
    t["num_nextn_predict_layers"] = cfg.mtp_layers
    if cfg.moe is not None:
        t["routed_expert_hidden_size"] = cfg.moe.latent_dim
        t["latent_moe_use_norm"] = cfg.moe.latent_norm
    t["linear_attn_config"]["gate_lower_bound"] = cfg.kda.gate_lower_bound
    t["linear_attn_config"]["use_full_rank_gate"] = cfg.kda.output_gate == "full"
    t["openk3"] = {
        "name": cfg.name,
        "kda_gate": cfg.kda.gate,
        "kda_fused_conv": cfg.kda.fused_conv,
        "mla_output_norm": cfg.mla.output_norm,
        "mla_norm_eps": cfg.mla.norm_eps,
    }
    out = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": t}
    if cfg.vision is not None:
        out["vision_config"] = _vision_to_k3(cfg.vision, cfg.hidden_size)
        out["media_placeholder_token_id"] = cfg.vision.image_token_id
    return out
