"""Training checkpoints you can trust: atomic, complete, verified on load.

A checkpoint is a directory `step-NNNNNN/`:
  config.json + model.safetensors   the model in openk3.interop's K3 layout (`load_pretrained` reads it alone:
                                    `openk3 generate --ckpt`, `openk3 serve --ckpt`)
  tokenizer.json                    the tokenizer the run trained with
  optimizer.pt                      optimizer state (Muon momenta, AdamW moments), keyed by parameter name
  trainer.pt                        step, schedule, data position, balancing biases, run settings, every RNG
                                    state (python, numpy, torch CPU and CUDA; one entry per data-parallel rank)
  manifest.json                     size and sha256 of every file above; written last
Atomic: everything is written into a hidden temporary directory beside the target, each file fsynced, then the
directory is renamed into place (and the parent fsynced). A process killed mid-save leaves only the temporary
directory, which loading never picks up; the previous checkpoint is untouched. On load the manifest is checked
first, so a truncated or altered file fails with a message naming it instead of a tensor error later.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from openk3.config import ModelConfig
from openk3.interop import config_from_json, load_pretrained, save_pretrained
from openk3.interop.files import read_config
from openk3.model import K3ForCausalLM

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted, or does not match this run."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- model files (config.json + model.safetensors, written by openk3.interop) -----------------------------------

def model_from_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> K3ForCausalLM:
    """A CPU model holding `state` without copying it (built on the meta device, tensors assigned)."""
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    model.load_state_dict({k: v.detach().cpu() for k, v in state.items()}, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def read_model_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no config.json: not an openk3 model or checkpoint directory")
    try:
        return config_from_json(read_config(directory))[0]
    except (ValueError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not a readable openk3 config: {e}") from None


# ---- save ------------------------------------------------------------------------------------------------------

def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: str | Path, step: int, cfg: ModelConfig, model_state: dict[str, torch.Tensor],
                    optimizer_state: dict, trainer_state: dict, tokenizer_file: str | Path) -> Path:
    """Write `out_dir/step-NNNNNN` atomically and return its path (call on one rank only)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / step_dir_name(step)
    tmp = out_dir / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_pretrained(model_from_state(cfg, model_state), tmp)
    shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save({**trainer_state, "format_version": FORMAT_VERSION, "step": step}, tmp / "trainer.pt")
    files = sorted(p.name for p in tmp.iterdir())
    for name in files:
        _fsync_file(tmp / name)
    manifest = {"format_version": FORMAT_VERSION, "step": step,
                "files": {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
                          for name in files}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    _fsync_file(tmp / MANIFEST)
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step: move the old one aside first, drop it after the swap
        old = out_dir / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(out_dir)
    return final


# ---- load ------------------------------------------------------------------------------------------------------

def verify_checkpoint(directory: str | Path) -> dict:
    """The manifest after checking every listed file's size and sha256; CheckpointError otherwise."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist")
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete: no {MANIFEST} (was the save interrupted?)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {directory} is corrupted: unreadable {MANIFEST} ({e})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {directory} has format version {manifest.get('format_version')}, "
                              f"this openk3 reads version {FORMAT_VERSION}")
    for name, meta in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory} is corrupted: {name} is missing")
        size = path.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"checkpoint {directory} is corrupted: {name} has {size} bytes, "
                                  f"the manifest says {meta['bytes']}")
        if _sha256(path) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {directory} is corrupted: {name} does not match its sha256 "
                                  f"in {MANIFEST}")
    return manifest


def config_mismatch(saved: ModelConfig, current: ModelConfig) -> list[str]:
    a, b = saved.to_dict(), current.to_dict()
    diffs = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            diffs.append(f"{key}: checkpoint {a.get(key)!r}, this run {b.get(key)!r}")
    return diffs


def load_checkpoint(directory: str | Path, cfg: ModelConfig) -> dict:
    """Verified contents of a checkpoint for a run whose model config is `cfg`.

    Returns {"model": state dict, "optimizer": ..., "trainer": ...}. Any difference between the saved model
    config and `cfg` is a CheckpointError listing the differing fields.
    """
    directory = Path(directory)
    verify_checkpoint(directory)
    saved_cfg = read_model_config(directory)
    diffs = config_mismatch(saved_cfg, cfg)
    if diffs:
        raise CheckpointError(f"checkpoint {directory} was saved for a different model:\n  " + "\n  ".join(diffs))
    return {
        "model": load_pretrained(directory).state_dict(),
        "optimizer": torch.load(directory / "optimizer.pt", weights_only=False),
        "trainer": torch.load(directory / "trainer.pt", weights_only=False),
    }


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The highest complete step directory under out_dir (temporary directories are ignored)."""
    out_dir = Path(out_dir)
    steps = sorted(p for p in out_dir.glob("step-*") if p.is_dir() and (p / MANIFEST).is_file())
    return steps[-1] if steps else None
