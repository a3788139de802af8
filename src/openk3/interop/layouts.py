"""Tensor-name and tensor-layout mapping between openk3's state dict and the two external key layouts.

openk3's own names mirror HF transformers' in-memory KimiLinearForCausalLM (see openk3.model). On disk:

"hub": what `KimiLinearForCausalLM.save_pretrained` writes (transformers 5 reverts its load-time conversions):
  model.layers.{i}.self_attn.{q,k,v}_conv1d.weight  [HK, 1, W] each   <- openk3 conv1d.weight [3HK, 1, W] split
                                                    (kda.fused_conv; unfused convs already have these names)
  model.layers.{i}.self_attn.A_log                  [1, 1, H, 1]      <- openk3 A_log [H]
  model.layers.{i}.block_sparse_moe.*               every FFN, dense or MoE (openk3: mlp.*)
  ...block_sparse_moe.experts.{j}.w1 / w3 / w2.weight  [I, D], [I, D], [D, I]
                                                    <- openk3 experts.gate_up_proj [E, 2I, D] rows [:I] / [I:],
                                                       experts.down_proj [E, D, I]
  everything else under the same name (self_attn.f_a_proj, dt_bias [HK], g_a_proj, o_norm, MLA projections,
  gate.weight, gate.e_score_correction_bias, shared_experts.*, input_layernorm, model.norm, lm_head).
  On load `mlp.` is accepted for `block_sparse_moe.` (Moonshot's original files name the dense FFN so).

"k3": the released K3 layout, the text model under `language_model.` (SPEC §1). Same per-tensor layouts as the
  hub (split convs, per-expert w1/w2/w3) except A_log, written as a vector [H] (H = KDA heads). Sources (SPEC §9):
  torchtitan's K3 state-dict adapter (torchtitan/models/kimi_k3/state_dict_adapter.py) maps `self_attn.A_log`
  one-to-one onto its [num_heads] parameter, and a JAX port documents "K3 stores it as [H]"; another public
  loader strips a zero tail past num_heads. So loading takes [H], or [n >= H] whose entries past H are all zero
  (a non-zero tail is an error naming the tensor and its shape). No public reader of the released shard headers
  was found that shows another shape. The dense FFN sits under `mlp.`, MoE under `block_sparse_moe.`, and these
  K3-only names (openk3 name -> file name, under language_model.model.):
    layers.{i}.attn_res_{proj,norm}   -> layers.{i}.self_attention_res_{proj,norm}   AttnRes pseudo-query [1, D]
    layers.{i}.mlp_res_{proj,norm}    -> layers.{i}.mlp_res_{proj,norm}               and its RMSNorm weight [D]
    output_res_{proj,norm}            -> output_attn_res_{proj,norm}
    layers.{i}.mlp.routed_down / latent_norm / routed_up
        -> layers.{i}.block_sparse_moe.routed_expert_down_proj / routed_expert_norm / routed_expert_up_proj
    layers.{i}.self_attn.g_proj       (KDA full-rank output gate, MLA output gate): same name
    mtp.{k}.block.*                   -> layers.{L+k}.*  (L = num_hidden_layers; DeepSeek-V3's MTP naming)
    mtp.{k}.{enorm,hnorm,eh_proj}     -> layers.{L+k}.{enorm,hnorm,eh_proj}
    mtp.{k}.norm                      -> layers.{L+k}.shared_head.norm
    (DeepSeek-V3 also stores copies of the embedding and LM head per MTP layer; openk3 shares them and does not.)
  lm_head -> language_model.lm_head. On load, layer 0's self_attention_res_{proj,norm} are accepted and dropped:
  layer 0's attention input is the embedding alone, a softmax over one source, so they cannot change anything.
  The vision tower and projector (SPEC §12) sit at the top level under the names openk3 uses in memory:
    vision_tower.patch_embed.proj.weight          [D, 3, p, p]  <- openk3's Linear [D, 3*p*p] (a Conv2d of stride p
                                                                  in the file; its (c, y, x) flattening)
    vision_tower.patch_embed.pos_emb.weight       [S, S, D]
    vision_tower.encoder.blocks.{i}.{norm0,norm1}.weight, .wqkv.weight [3*H*K, D], .wo.weight [D, H*K],
        .mlp.fc0.weight [I, D], .mlp.fc1.weight [D, I];   vision_tower.encoder.final_layernorm.weight
    mm_projector.proj.0.weight [4D, 4D], mm_projector.proj.2.weight [hidden, 4D], mm_projector.post_norm.weight
  Sources: the public K3 ports' vision code, which load the released files without renames: NeMo AutoModel
  nemo_automodel/components/models/kimi_k3/vision.py (MoonViT3dPretrainedModel, PatchMergerMLPV2), torchtitan
  torchtitan/models/kimi_k3/moonvit.py ("named to match the checkpoint"), SGLang
  python/sglang/srt/models/kimi_k3_vl.py ("weight names match the checkpoint exactly"). The fixed sincos time
  table of video (a non-persistent buffer there) is not stored, and openk3 has no video path.

Tied embeddings: lm_head is not written (HF convention) and is re-tied on load.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from openk3.config import ModelConfig

LAYOUTS = ("hub", "k3")
VISION_PREFIXES = ("vision_tower.", "mm_projector.")

_K3_RENAMES = [
    (r"\.attn_res_(proj|norm)\.", r".self_attention_res_\1."),
    (r"^model\.output_res_(proj|norm)\.", r"model.output_attn_res_\1."),
    (r"\.mlp\.routed_down\.", ".mlp.routed_expert_down_proj."),
    (r"\.mlp\.latent_norm\.", ".mlp.routed_expert_norm."),
    (r"\.mlp\.routed_up\.", ".mlp.routed_expert_up_proj."),
]
_MOE_PART = r"\.mlp\.(gate|experts|shared_experts|routed_expert_\w+)\."
_DENSE_PART = r"\.(gate_proj|up_proj|down_proj)\."


@dataclass(frozen=True)
class Entry:
    """One openk3 tensor and the file tensors it becomes: split(t) -> [file tensors], join([...]) -> t.
    read_shape maps a stored tensor's shape to the shape it is read as (a tolerated variant -> the written one)."""

    keys: tuple[str, ...]
    split: Callable[[torch.Tensor], list[torch.Tensor]]
    join: Callable[[list[torch.Tensor]], torch.Tensor]
    read_shape: Callable[[tuple[int, ...]], tuple[int, ...]] = tuple


def _same(key: str) -> Entry:
    return Entry((key,), lambda t: [t], lambda ts: ts[0])


def _rename(key: str, cfg: ModelConfig, layout: str) -> str:
    """openk3 name -> file name, for tensors whose layout is unchanged."""
    if key.startswith(VISION_PREFIXES):
        return key
    if layout == "k3":
        mtp = re.match(r"^mtp\.(\d+)\.(block\.)?", key)
        if mtp:
            rest = key[mtp.end():]
            rest = "shared_head.norm." + rest[len("norm."):] if not mtp.group(2) and rest.startswith("norm.") else rest
            key = f"model.layers.{cfg.num_layers + int(mtp.group(1))}.{rest}"
        for pattern, repl in _K3_RENAMES:
            key = re.sub(pattern, repl, key)
        key = re.sub(_MOE_PART, r".block_sparse_moe.\1.", key)
        return "language_model." + key
    return re.sub(r"\.mlp\.", ".block_sparse_moe.", key)


def _entry(key: str, meta: torch.Tensor, cfg: ModelConfig, layout: str) -> Entry:
    name = _rename(key, cfg, layout)
    if name == "vision_tower.patch_embed.proj.weight":  # Linear [D, 3*p*p] <-> Conv2d [D, 3, p, p]
        shape = (meta.shape[0], 3, cfg.vision.patch_size, cfg.vision.patch_size)
        return Entry((name,), lambda t: [t.view(shape)], lambda ts: ts[0].reshape(shape[0], -1))
    if name.endswith(".self_attn.conv1d.weight"):  # fused q|k|v conv -> three convs
        base = name[: -len("conv1d.weight")]
        sizes = [meta.shape[0] // 3] * 3
        return Entry(tuple(f"{base}{p}_conv1d.weight" for p in "qkv"),
                     lambda t: list(t.split(sizes)), lambda ts: torch.cat(ts))
    if name.endswith(".self_attn.A_log") and layout == "hub":  # [H] <-> [1, 1, H, 1]
        return Entry((name,), lambda t: [t.view(1, 1, -1, 1)], lambda ts: ts[0].reshape(-1))
    if name.endswith(".self_attn.A_log"):  # [H]; read also from [n >= H] with a zero tail (see the docstring)
        return _k3_a_log(name, meta.shape[0])
    if name.endswith(".experts.gate_up_proj"):  # [E, 2I, D] <-> per expert w1 (gate) [I, D], w3 (up) [I, D]
        base, E, inter = name[: -len("gate_up_proj")], meta.shape[0], meta.shape[1] // 2
        keys = tuple(f"{base}{j}.{w}.weight" for j in range(E) for w in ("w1", "w3"))
        return Entry(keys, lambda t: [p for e in t for p in e.split(inter)],
                     lambda ts: torch.stack([torch.cat(ts[2 * j: 2 * j + 2]) for j in range(E)]))
    if name.endswith(".experts.down_proj"):  # [E, D, I] <-> per expert w2 [D, I]
        base, E = name[: -len("down_proj")], meta.shape[0]
        return Entry(tuple(f"{base}{j}.w2.weight" for j in range(E)), lambda t: list(t.unbind(0)),
                     lambda ts: torch.stack(ts))
    return _same(name)


def _k3_a_log(name: str, heads: int) -> Entry:
    def read_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
        return (heads,) if len(shape) == 1 and shape[0] >= heads else tuple(shape)

    def join(ts: list[torch.Tensor]) -> torch.Tensor:
        t = ts[0]
        if t[heads:].any():
            raise ValueError(f"{name} has shape {list(t.shape)} with non-zero entries past the first {heads} "
                             f"(the KDA heads): expected [{heads}], or a longer vector whose tail is zero")
        return t[:heads]

    return Entry((name,), lambda t: [t], join, read_shape)


def external_plan(state: dict[str, torch.Tensor], cfg: ModelConfig, layout: str) -> dict[str, Entry]:
    """openk3 key -> Entry, for every tensor in `state` that is stored (a tied lm_head is not)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    stored = {k: t for k, t in state.items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    return {k: _entry(k, t, cfg, layout) for k, t in stored.items()}


def to_external(state: dict[str, torch.Tensor], plan: dict[str, Entry]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, entry in plan.items():
        out.update(zip(entry.keys, entry.split(state[key]), strict=True))
    return out


def from_external(get: Callable[[str], torch.Tensor], plan: dict[str, Entry]) -> Iterator[tuple[str, torch.Tensor]]:
    """(openk3 key, tensor) pairs, one at a time, from file tensors fetched with get(file name)."""
    for key, entry in plan.items():
        yield key, entry.join([get(k) for k in entry.keys])


def canonical_names(found: list[str], layout: str) -> dict[str, str]:
    """Accepted alternative spellings -> {the name `external_plan` uses: the stored name}. Inert tensors (layer 0's
    K3 self_attention_res) are left out; a name whose canonical form is also stored stays as it is (unexpected)."""
    mapping: dict[str, str] = {}
    stored = set(found)
    for name in found:
        if layout == "hub":
            canon = re.sub(r"\.mlp\.", ".block_sparse_moe.", name)
        else:
            canon = re.sub(r"\.block_sparse_moe" + _DENSE_PART, r".mlp.\1.", name)
            if re.match(r"^language_model\.model\.layers\.0\.self_attention_res_(proj|norm)\.weight$", canon):
                continue
        if canon in mapping or (canon != name and canon in stored):
            canon = name
        mapping[canon] = name
    return mapping
