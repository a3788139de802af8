"""load_pretrained / save_pretrained: checkpoint directories (config.json + safetensors) <-> K3ForCausalLM.

A directory's layout is read from its config.json: a `text_config` means the K3 layout, model_type "kimi_linear"
(without `text_config`) the Kimi Linear hub layout. openk3's own checkpoints are K3-layout directories: the K3
layout expresses every openk3 config, and save -> load gives back the same config and bit-identical tensors.
Routed experts may be stored MXFP4-packed (compressed-tensors' `mxfp4-pack-quantized`, declared by the config's
`quantization_config`; see quantization.py): loading dequantizes them, save_pretrained(quantization="mxfp4")
writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from openk3.checkpoints import MANIFEST, latest_checkpoint
from openk3.config import ModelConfig
from openk3.interop.configs import config_from_hub, config_from_k3, config_to_hub, config_to_k3
from openk3.interop.files import (
    CONFIG_NAME,
    TensorReader,
    check_tensor_set,
    read_config,
    write_config,
    write_tensors,
)
from openk3.interop.layouts import LAYOUTS, Entry, canonical_names, external_plan, from_external, to_external
from openk3.interop.quantization import (
    QUANTIZATIONS,
    PackedExpertsReader,
    pack_experts,
    quantization_config,
    read_quantization,
)
from openk3.model import K3ForCausalLM


def detect_layout(config: dict[str, Any]) -> str:
    if "text_config" in config:
        return "k3"
    if config.get("model_type") == "kimi_linear":
        return "hub"
    raise ValueError("config.json is neither the K3 layout (a 'text_config' section) nor Kimi Linear "
                     f"(model_type 'kimi_linear'); got model_type {config.get('model_type')!r}")


def config_from_json(config: dict[str, Any]) -> tuple[ModelConfig, str]:
    """A checkpoint's config.json -> (ModelConfig, layout)."""
    layout = detect_layout(config)
    return (config_from_k3(config) if layout == "k3" else config_from_hub(config)), layout


@dataclass
class CheckpointPlan:
    """A checkpoint directory checked against the model its config describes, before any weight is read."""

    cfg: ModelConfig
    layout: str
    mxfp4: bool  # routed experts stored MXFP4-packed
    model: K3ForCausalLM  # on the meta device, each tensor in the dtype it is loaded in
    plan: dict[str, Entry]  # openk3 key -> the file tensors it is joined from (`layouts.external_plan`)
    names: dict[str, str]  # plan's file names -> names as stored (an MXFP4 pair: the weight it reads as)


def plan_checkpoint(path: str | Path, dtype: torch.dtype | None = None) -> CheckpointPlan:
    """Read config.json and the shard headers; ValueError listing every missing, unexpected or wrongly shaped
    tensor (and for a `quantization_config` openk3 does not read). The model takes `dtype`, or when None the stored
    dtype of the token embedding (the KeepFp32 tensors stay fp32 either way)."""
    config = read_config(path)
    cfg, layout = config_from_json(config)
    mxfp4 = read_quantization(config) is not None
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    meta_state = model.state_dict()
    plan = external_plan(meta_state, cfg, layout)
    expected = {k: tuple(t.shape) for k, t in to_external(meta_state, plan).items()}
    with TensorReader(path) as files:
        stored = (PackedExpertsReader(files) if mxfp4 else files).shapes()
        names = canonical_names(list(stored), layout)
        read_shape = {key: entry.read_shape for entry in plan.values() for key in entry.keys}
        found = {canon: read_shape.get(canon, tuple)(stored[name]) for canon, name in names.items()}
        check_tensor_set(expected, found, where=str(path))
        model.to(dtype or files.dtype(names[plan["model.embed_tokens.weight"].keys[0]]))  # on meta: target dtypes
    return CheckpointPlan(cfg, layout, mxfp4, model, plan, names)


def checkpoint_path(path: str | Path) -> Path:
    """A checkpoint directory as given, or for a training run directory (no config.json, step-*/ checkpoints) its
    latest complete checkpoint."""
    if not (Path(path) / CONFIG_NAME).is_file() and (latest := latest_checkpoint(path)) is not None:
        return latest
    return Path(path)


def load_pretrained(path: str | Path, dtype: torch.dtype | None = None) -> K3ForCausalLM:
    """Build the model a checkpoint directory describes and load its weights; returned in eval mode.

    The model takes `dtype`, or when None the stored dtype of the token embedding; the tensors openk3 keeps in
    fp32 (A_log, dt_bias, the router) stay fp32 either way, so an openk3 checkpoint loads back with the dtypes it
    was saved with. MXFP4-packed routed experts are dequantized to that dtype (exactly: every MXFP4 value is a bf16
    value). A missing, unexpected or wrongly shaped tensor raises one ValueError that lists all of them; so does a
    `quantization_config` whose format openk3 does not read (naming it). `path` may also be a training run
    directory (`openk3 train --out`): its latest complete checkpoint is read, as the CLI commands do.
    `openk3.interop.device_load` loads straight onto a GPU instead (and can keep MXFP4 experts packed)."""
    path = checkpoint_path(path)
    p = plan_checkpoint(path, dtype)
    with TensorReader(path) as files:
        reader = PackedExpertsReader(files) if p.mxfp4 else files
        reader.shapes()  # (a PackedExpertsReader finds its MXFP4 pairs in the headers)
        model = p.model
        targets = {k: t.dtype for k, t in model.state_dict().items()}
        state = {k: t.to(targets[k]) for k, t in from_external(lambda canon: reader.get(p.names[canon]), p.plan)}
    if p.cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    return finish_loading(model)


def finish_loading(model: K3ForCausalLM) -> K3ForCausalLM:
    """Re-tie a tied LM head and check that every tensor was loaded; the model in eval mode."""
    if model.config.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    unset = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if unset:  # a tensor the model creates but does not save (a non-persistent buffer) has no data to load
        raise RuntimeError(f"tensors not restored from the checkpoint (not in the model's state_dict): {unset}")
    return model.eval()


def save_pretrained(model: K3ForCausalLM, path: str | Path, layout: str = "k3",
                    max_shard_bytes: int | None = None, quantization: str | None = None) -> None:
    """Write config.json and the weights. layout "k3" (default; openk3's own format, any config) or "hub"
    (Kimi Linear, readable by transformers' KimiLinearForCausalLM; ValueError for K3-only configs).
    max_shard_bytes splits the weights into shards with an index, as HF does for large models.
    `path` is created if absent; in an existing directory config.json and the weight files of an earlier save are
    replaced (a stale index or shard is removed, as HF's save_pretrained does) and other files are left alone. A
    training checkpoint (`step-NNNNNN/`, its files listed in a manifest) or a training run directory is refused,
    as a file is: writing there would corrupt the checkpoint or shadow the run's latest one.
    quantization "mxfp4" writes the routed experts MXFP4-packed as the released K3 files are (the rest as is)
    with the matching `quantization_config`; None (default) writes the weights as the model holds them (for a
    model under QAT, the full-precision master weights)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
    if not isinstance(getattr(model, "config", None), ModelConfig):
        raise TypeError(f"model must be an openk3 K3ForCausalLM (with a ModelConfig .config), got "
                        f"{type(model).__name__}")
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int)
                                        or max_shard_bytes < 1):
        raise ValueError(f"max_shard_bytes must be None or a positive integer, got {max_shard_bytes!r}")
    path = Path(path)
    check_save_dir(path)
    cfg = model.config
    config = config_to_k3(cfg) if layout == "k3" else config_to_hub(cfg)
    state = model.state_dict()
    tensors = to_external(state, external_plan(state, cfg, layout))
    if quantization is not None:
        tensors = pack_experts(tensors)
        config["quantization_config"] = quantization_config(tensors)
    path.mkdir(parents=True, exist_ok=True)
    write_config(path, config)
    write_tensors(path, tensors, max_shard_bytes=max_shard_bytes)


def check_save_dir(path: Path) -> None:
    """save_pretrained's target: refused when it is a file, a training checkpoint or a training run directory."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"save_pretrained: {str(path)!r} is a file; give a directory")
    if (path / MANIFEST).is_file():
        raise ValueError(f"save_pretrained: {str(path)!r} is a training checkpoint ({MANIFEST} lists its files); "
                         "writing into it would corrupt it: choose a new directory")
    if path.is_dir() and latest_checkpoint(path) is not None:
        raise ValueError(f"save_pretrained: {str(path)!r} is a training run (it holds step-*/ checkpoints); a "
                         "config.json there would shadow its latest checkpoint: choose a new directory")
