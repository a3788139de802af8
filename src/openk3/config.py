"""Model configuration: dataclasses, validation and the presets (SPEC-K3 §1).

A config is data. `ModelConfig.validate()` runs once at construction and raises ValueError naming the field
and the allowed values for anything impossible. `from_dict` / `to_dict` give a JSON round trip (used for
checkpoints and `--config FILE` overrides, `with_config_file`); unknown keys and values of the wrong type are an
error naming the field, not silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACTIVATIONS = ("situ", "swiglu")
KDA_GATES = ("k3", "kimi")
KDA_OUTPUT_GATES = ("full", "lowrank")
POS_EMB_INTERPOLATIONS = ("bilinear", "bicubic")


@dataclass
class KDAConfig:
    """Kimi Delta Attention layer (SPEC §2).

    gate="k3": lower-bounded gate g = gate_lower_bound * sigmoid(exp(A_log) * (f + dt_bias)).
    gate="kimi": Kimi Linear's g = -exp(A_log) * softplus(f + dt_bias) (no bound).
    output_gate="full": sigmoid(g_proj(x)) (K3); "lowrank": g_b(g_a(x)) (Kimi Linear).
    fused_conv: one depthwise conv over q|k|v (Kimi Linear's layout) instead of three.
    """

    num_heads: int = 4
    head_dim: int | None = None  # None: hidden_size // num_heads
    conv_kernel: int = 4
    gate: str = "k3"
    gate_lower_bound: float = -5.0
    output_gate: str = "full"
    fused_conv: bool = False


@dataclass
class MLAConfig:
    """Gated Multi-head Latent Attention (SPEC §3). NoPE: the "rope" slice exists but is never rotated."""

    num_heads: int = 4
    q_lora_rank: int | None = 64  # None: a single full-rank wq (Kimi Linear)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    output_gate: bool = True  # y = wo(sigmoid(g_proj(x)) * o)
    output_norm: bool = False  # the disputed RMSNorm of o before the gate (SPEC §3); default off
    norm_eps: float = 1e-6  # eps of q_a_layernorm / kv_a_layernorm (HF Kimi Linear: the RMSNorm default 1e-6)


@dataclass
class MoEConfig:
    """(Stable Latent) MoE (SPEC §5). latent_dim=None gives a plain full-width MoE (Kimi Linear)."""

    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 64
    num_shared_experts: int = 1
    latent_dim: int | None = 64
    latent_norm: bool = True
    routed_scaling_factor: float = 1.0
    renormalize: bool = True


@dataclass
class VisionConfig:
    """The MoonViT-V2-style vision tower and its projector (SPEC §12); defaults are K3's released sizes.

    Tower: patch_size x patch_size RGB patches -> Linear -> + learned pos_emb_size^2 position table (interpolated
    to the image's patch grid) -> num_layers pre-norm blocks (2D RoPE attention, tanh-GELU MLP) -> RMSNorm.
    Projector: merge_size x merge_size space-to-depth -> Linear -> GELU (erf) -> Linear(-> hidden_size) -> RMSNorm.
    image_token_id: the placeholder the prompt carries for every image token (163605 in the Kimi tokenizer).
    max_pixels: preprocessing budget; an image is resized into it (openk3.images), a setting of openk3's.
    """

    num_layers: int = 27
    hidden_size: int = 1024
    num_heads: int = 12
    head_dim: int = 128  # qkv width num_heads * head_dim (1536 in K3, not hidden_size)
    intermediate_size: int = 4096
    patch_size: int = 14
    merge_size: int = 2
    pos_emb_size: int = 64  # the learned table is pos_emb_size x pos_emb_size patches
    pos_emb_interpolation: str = "bilinear"  # K3's released pos_emb_interpolation_mode (NeMo's, torchtitan's configs)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    projector_eps: float = 1e-5
    image_token_id: int = 163605
    max_pixels: int = 4096 * 14 * 14  # 4096 patches, 1024 image tokens

    @property
    def unit(self) -> int:
        """Image sides are multiples of this: one merged token covers unit x unit pixels (28 in K3)."""
        return self.patch_size * self.merge_size

    @property
    def merged_size(self) -> int:
        """Width of a merged token entering the projector (merge_size^2 * hidden_size)."""
        return self.merge_size ** 2 * self.hidden_size


@dataclass
class ModelConfig:
    name: str = "custom"
    vocab_size: int = 4096
    hidden_size: int = 128
    num_layers: int = 8
    mla_layers: tuple[int, ...] = (3, 7)  # zero-based; every other layer is KDA
    kda: KDAConfig = field(default_factory=KDAConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    moe: MoEConfig | None = field(default_factory=MoEConfig)  # None: every FFN is dense
    first_k_dense: int = 1
    dense_hidden: int = 256
    activation: str = "situ"
    situ_beta_gate: float = 4.0
    situ_beta_up: float = 25.0
    attn_res_block_size: int | None = 2  # decoder layers per AttnRes block; None: plain residual stream
    mtp_layers: int = 1
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 4096
    init_std: float = 0.02
    vision: VisionConfig | None = None  # None: a text-only model

    def __post_init__(self) -> None:
        self.mla_layers = tuple(int(i) for i in self.mla_layers)
        self.validate()

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def kda_head_dim(self) -> int:
        return self.kda.head_dim if self.kda.head_dim is not None else self.hidden_size // self.kda.num_heads

    def layer_kind(self, i: int) -> str:
        return "mla" if i in self.mla_layers else "kda"

    def ffn_kind(self, i: int) -> str:
        return "dense" if self.moe is None or i < self.first_k_dense else "moe"

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.mla_layers)

    # ---- validation ----------------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str, value: Any) -> None:
            if not ok:
                raise ValueError(f"config field {name!r} must be {allowed}, got {value!r}")

        for name in ("vocab_size", "hidden_size", "num_layers", "dense_hidden", "max_seq_len"):
            need(getattr(self, name) >= 1, name, "a positive integer", getattr(self, name))
        need(self.activation in ACTIVATIONS, "activation", f"one of {ACTIVATIONS}", self.activation)
        need(self.mtp_layers >= 0, "mtp_layers", ">= 0", self.mtp_layers)
        need(0 <= self.first_k_dense <= self.num_layers, "first_k_dense", f"in [0, {self.num_layers}]",
             self.first_k_dense)
        bad = [i for i in self.mla_layers if not 0 <= i < self.num_layers]
        need(not bad, "mla_layers", f"zero-based layer indices in [0, {self.num_layers - 1}]", self.mla_layers)
        need(len(set(self.mla_layers)) == len(self.mla_layers), "mla_layers", "distinct indices", self.mla_layers)
        if self.attn_res_block_size is not None:
            need(self.attn_res_block_size >= 1, "attn_res_block_size", ">= 1 or None", self.attn_res_block_size)
        need(self.situ_beta_gate > 0 and self.situ_beta_up > 0, "situ_beta_gate/situ_beta_up", "> 0",
             (self.situ_beta_gate, self.situ_beta_up))

        kda = self.kda
        need(kda.num_heads >= 1, "kda.num_heads", "a positive integer", kda.num_heads)
        if kda.head_dim is None:
            need(self.hidden_size % kda.num_heads == 0, "kda.num_heads",
                 f"a divisor of hidden_size={self.hidden_size} (or set kda.head_dim)", kda.num_heads)
        else:
            need(kda.head_dim >= 1, "kda.head_dim", "a positive integer or None", kda.head_dim)
        need(kda.conv_kernel >= 1, "kda.conv_kernel", ">= 1", kda.conv_kernel)
        need(kda.gate in KDA_GATES, "kda.gate", f"one of {KDA_GATES}", kda.gate)
        need(kda.output_gate in KDA_OUTPUT_GATES, "kda.output_gate", f"one of {KDA_OUTPUT_GATES}", kda.output_gate)
        need(-5.0 <= kda.gate_lower_bound < 0.0, "kda.gate_lower_bound", "in [-5, 0)", kda.gate_lower_bound)

        mla = self.mla
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            need(getattr(mla, name) >= 1, f"mla.{name}", "a positive integer", getattr(mla, name))
        need(mla.qk_rope_head_dim >= 0, "mla.qk_rope_head_dim", ">= 0", mla.qk_rope_head_dim)
        if mla.q_lora_rank is not None:
            need(mla.q_lora_rank >= 1, "mla.q_lora_rank", "a positive integer or None", mla.q_lora_rank)
        need(mla.norm_eps > 0, "mla.norm_eps", "> 0", mla.norm_eps)

        moe = self.moe
        if moe is not None:
            need(moe.num_experts >= 1, "moe.num_experts", "a positive integer", moe.num_experts)
            need(1 <= moe.top_k <= moe.num_experts, "moe.top_k", f"in [1, num_experts={moe.num_experts}]",
                 moe.top_k)
            need(moe.expert_hidden >= 1, "moe.expert_hidden", "a positive integer", moe.expert_hidden)
            need(moe.num_shared_experts >= 0, "moe.num_shared_experts", ">= 0", moe.num_shared_experts)
            if moe.latent_dim is not None:
                need(1 <= moe.latent_dim <= self.hidden_size, "moe.latent_dim",
                     f"in [1, hidden_size={self.hidden_size}] or None", moe.latent_dim)

        vis = self.vision
        if vis is not None:
            for name in ("num_layers", "hidden_size", "num_heads", "intermediate_size", "patch_size", "merge_size",
                         "pos_emb_size"):
                need(getattr(vis, name) >= 1, f"vision.{name}", "a positive integer", getattr(vis, name))
            need(vis.head_dim >= 4 and vis.head_dim % 4 == 0, "vision.head_dim",
                 "a positive multiple of 4 (2D RoPE rotates x and y in interleaved pairs)", vis.head_dim)
            need(vis.pos_emb_interpolation in POS_EMB_INTERPOLATIONS, "vision.pos_emb_interpolation",
                 f"one of {POS_EMB_INTERPOLATIONS}", vis.pos_emb_interpolation)
            need(vis.rope_theta > 0, "vision.rope_theta", "> 0", vis.rope_theta)
            need(vis.norm_eps > 0 and vis.projector_eps > 0, "vision.norm_eps/vision.projector_eps", "> 0",
                 (vis.norm_eps, vis.projector_eps))
            need(0 <= vis.image_token_id < self.vocab_size, "vision.image_token_id",
                 f"a token id in [0, vocab_size={self.vocab_size})", vis.image_token_id)
            need(vis.max_pixels >= vis.unit ** 2, "vision.max_pixels",
                 f">= {vis.unit ** 2} (one {vis.unit} x {vis.unit} image token)", vis.max_pixels)

    # ---- (de)serialisation ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mla_layers"] = list(self.mla_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        sub = {"kda": KDAConfig, "mla": MLAConfig, "moe": MoEConfig, "vision": VisionConfig}
        for key, sub_cls in sub.items():
            if key in d and isinstance(d[key], dict):
                d[key] = _build(sub_cls, d[key], prefix=f"{key}.")
        return _build(cls, d)

    def with_overrides(self, overrides: dict[str, Any]) -> ModelConfig:
        """A new config with fields replaced; nested sections (kda/mla/moe/vision) merge key by key."""
        if not isinstance(overrides, dict):
            raise ValueError(f"config overrides must be a JSON object of fields, got {overrides!r}")
        merged = self.to_dict()
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
        return ModelConfig.from_dict(merged)

    def with_config_file(self, path: str | Path) -> ModelConfig:
        """`with_overrides` from `--config FILE` (a JSON object); a ValueError names the file and the field."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--config {path} does not exist")
        overrides = read_json(path, f"--config {path}")
        try:
            return self.with_overrides(overrides)
        except ValueError as exc:
            raise ValueError(f"--config {path}: {exc}") from None


def read_json(file: Path, name: str) -> Any:
    """The JSON value in `file`; a ValueError naming it as `name` when it is not JSON (or not text)."""
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{name} is not valid JSON ({exc})") from None


def _build(cls, d: dict[str, Any], prefix: str = ""):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown config field(s) {[prefix + u for u in unknown]}; allowed: {sorted(names)}")
    hints = typing.get_type_hints(cls)
    for name, value in d.items():
        if not _has_type(value, hints[name]):
            raise ValueError(f"config field {prefix + name!r} must be {_type_words(hints[name])}, got {value!r}")
    return cls(**d)


def _has_type(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's annotation (an int is a float; a bool is not a number)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_has_type(value, h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return isinstance(value, (list, tuple)) and all(_has_type(v, typing.get_args(hint)[0]) for v in value)
    if hint in (int, float):
        return isinstance(value, (int, hint)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_words(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_words(h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"a list of {_type_words(typing.get_args(hint)[0]).removeprefix('an ').removeprefix('a ')}s"
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return words.get(hint, "an object of its fields")


# ---- presets -------------------------------------------------------------------------------------------------

def _k3() -> ModelConfig:
    """The released K3 (SPEC §1): 93 layers, MLA at 3, 7, ..., 91 and 92; the MoonViT-V2 tower (SPEC §12)."""
    return ModelConfig(
        name="k3",
        vocab_size=163840,
        hidden_size=7168,
        num_layers=93,
        mla_layers=tuple(range(3, 93, 4)) + (92,),
        kda=KDAConfig(num_heads=96, head_dim=128, conv_kernel=4, gate="k3", gate_lower_bound=-5.0),
        mla=MLAConfig(num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(num_experts=896, top_k=16, expert_hidden=3072, num_shared_experts=2, latent_dim=3584),
        first_k_dense=1,
        dense_hidden=33792,
        attn_res_block_size=12,
        mtp_layers=1,
        max_seq_len=1_048_576,
        vision=VisionConfig(),
    )


def _k3_debug() -> ModelConfig:
    """A GPU-scale K3 (a few hundred million parameters) for kernels, profiling and short runs."""
    return ModelConfig(
        name="k3-debug",
        vocab_size=32768,
        hidden_size=1024,
        num_layers=12,
        mla_layers=(3, 7, 11),
        kda=KDAConfig(num_heads=8, head_dim=128),
        mla=MLAConfig(num_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(num_experts=32, top_k=4, expert_hidden=512, num_shared_experts=1, latent_dim=512),
        dense_hidden=2816,
        attn_res_block_size=4,
        max_seq_len=65536,
    )


def _k3_tiny() -> ModelConfig:
    """Seconds per step on a CPU: the default for demos and tests. Same topology rules as K3."""
    return ModelConfig(
        name="k3-tiny",
        vocab_size=4096,
        hidden_size=128,
        num_layers=8,
        mla_layers=(3, 7),
        kda=KDAConfig(num_heads=4, head_dim=32),
        mla=MLAConfig(num_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
                      qk_rope_head_dim=16, v_head_dim=32),
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=64, num_shared_experts=1, latent_dim=64),
        dense_hidden=256,
        attn_res_block_size=2,
        max_seq_len=4096,
    )


def _k3_tiny_vl() -> ModelConfig:
    """A vision-language model that learns on a CPU: k3-tiny's widths at half the depth, a 512-token vocabulary
    (the last id is the image placeholder) and a two-block vision tower 128 wide (`openk3 train --preset
    k3-tiny-vl` trains it on the embedded synthetic shapes task, openk3.train.shapes)."""
    cfg = _k3_tiny()
    cfg.name, cfg.vocab_size, cfg.num_layers, cfg.mla_layers = "k3-tiny-vl", 512, 4, (3,)
    cfg.vision = VisionConfig(num_layers=2, hidden_size=128, num_heads=4, head_dim=32, intermediate_size=512,
                              pos_emb_size=16, image_token_id=511, max_pixels=168 * 168)
    cfg.validate()
    return cfg


def _kimi_linear_48b() -> ModelConfig:
    """Kimi Linear 48B-A3B (HF `kimi_linear`): softplus gate, low-rank output gate, plain residuals, SwiGLU."""
    return ModelConfig(
        name="kimi-linear-48b",
        vocab_size=163840,
        hidden_size=2304,
        num_layers=27,
        mla_layers=(3, 7, 11, 15, 19, 23, 26),
        kda=KDAConfig(num_heads=32, head_dim=128, conv_kernel=4, gate="kimi", output_gate="lowrank",
                      fused_conv=True),
        mla=MLAConfig(num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=False),
        moe=MoEConfig(num_experts=256, top_k=8, expert_hidden=1024, num_shared_experts=1, latent_dim=None,
                      latent_norm=False, routed_scaling_factor=2.446),
        first_k_dense=1,
        dense_hidden=9216,
        activation="swiglu",
        attn_res_block_size=None,
        mtp_layers=0,
        max_seq_len=1_048_576,
    )


PRESETS = {
    "k3": _k3,
    "k3-debug": _k3_debug,
    "k3-tiny": _k3_tiny,
    "k3-tiny-vl": _k3_tiny_vl,
    "kimi-linear-48b": _kimi_linear_48b,
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
