"""Training checkpoints you can trust: atomic, complete, verified on load, loaded without running pickled code.

A checkpoint is a directory `step-NNNNNN/`:
  config.json + model.safetensors   the model in openk3.interop's K3 layout (`load_pretrained` reads it alone:
                                    `openk3 generate --ckpt`, `openk3 serve --ckpt`)
  tokenizer.json                    the tokenizer the run trained with
  optimizer.pt                      optimizer state (Muon momenta, AdamW moments), keyed by parameter name
  trainer.pt                        step, schedule, data position, balancing biases, run settings, every RNG
                                    state (python, numpy, torch CPU and CUDA; one entry per data-parallel rank)
  manifest.json                     size and sha256 of every file above; written last (openk3.checkpoints)
Atomic: everything is written into a hidden temporary directory beside the target, each file fsynced, then the
directory is renamed into place (and the parent fsynced; Ctrl-C waits for the renames). A process killed mid-save
leaves only the temporary directory, which loading never picks up; the previous checkpoint is untouched. On load
the manifest is checked first, so a truncated or altered file fails with a message naming it instead of a tensor
error later.

Safe to load: optimizer.pt and trainer.pt hold only tensors and plain Python types (RNG states are converted to
tensors), and are read with torch.load(weights_only=True), which builds nothing else. Checkpoints of format 1
(before 2026-12) pickled numpy's RNG state as an ndarray: they are read with numpy's array type alone added to
the allow-list, and converted on load.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from openk3.checkpoints import (
    FORMAT_VERSION,
    CheckpointError,
    fsync_file,
    step_dir_name,
    verify_checkpoint,
    write_manifest,
)
from openk3.config import ModelConfig
from openk3.interop import config_from_json, load_pretrained, save_pretrained
from openk3.interop.files import read_config
from openk3.model import K3ForCausalLM
from openk3.train.interrupt import interrupts_held


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

def _plain_rng(python_state: tuple, numpy_state: tuple) -> dict:
    """random.getstate() and np.random.get_state() as tensors and plain types."""
    version, words, gauss = python_state
    name, keys, pos, has_gauss, cached_gaussian = numpy_state
    return {"python": {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
            "numpy": {"name": name, "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}}


def rng_state() -> dict:
    """Every RNG's state as tensors and plain types (what torch.load(weights_only=True) reads back)."""
    state = {**_plain_rng(random.getstate(), np.random.get_state()), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["words"].tolist()), py["gauss"]))
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: str | Path, step: int, cfg: ModelConfig, model_state: dict[str, torch.Tensor],
                    optimizer_state: dict, trainer_state: dict, tokenizer_file: str | Path) -> Path:
    """Write `out_dir/step-NNNNNN` atomically and return its path (call on one rank only)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out_dir)
    final = out_dir / step_dir_name(step)
    tmp = out_dir / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_pretrained(model_from_state(cfg, model_state), tmp)
    shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save({**trainer_state, "format_version": FORMAT_VERSION, "step": step}, tmp / "trainer.pt")
    for path in sorted(tmp.iterdir()):
        fsync_file(path)
    write_manifest(tmp, step)
    _fsync_dir(tmp)
    publish(tmp, final)
    return final


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process: alive
        pass
    return True


def remove_abandoned(out_dir: Path) -> None:
    """Delete the temporary directories of saves whose process is gone (killed mid-save: SIGKILL, SIGTERM under
    torchrun): each holds a whole model and optimizer state that nothing will ever read. A step moved aside by
    `publish` (.old) goes only once its step is in place again: killed between publish's two renames, it is that
    step's only published copy."""
    for path in out_dir.glob(".step-*"):
        stem, _, pid = path.name.rpartition("-")
        if not (path.is_dir() and stem.endswith((".tmp", ".old")) and pid.isdigit()) or _running(int(pid)):
            continue
        if stem.endswith(".old") and not (out_dir / stem[1:-len(".old")]).is_dir():
            continue
        shutil.rmtree(path, ignore_errors=True)


def publish(tmp: Path, final: Path) -> None:
    """Rename the complete directory `tmp` to `final`. An earlier `final` (the same step saved again) is moved
    aside first and dropped after the swap; Ctrl-C waits for the renames, so a checkpoint is always in place."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    with interrupts_held():
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        if old.exists():
            shutil.rmtree(old)


# ---- load ------------------------------------------------------------------------------------------------------

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
    manifest = verify_checkpoint(directory)
    saved_cfg = read_model_config(directory)
    diffs = config_mismatch(saved_cfg, cfg)
    if diffs:
        raise CheckpointError(f"checkpoint {directory} was saved for a different model:\n  " + "\n  ".join(diffs))
    old_format = manifest["format_version"] == 1
    trainer = _safe_load(directory / "trainer.pt", numpy_arrays=old_format)
    if old_format:
        trainer["rng"] = [{**rng, **_plain_rng(rng["python"], rng["numpy"])} for rng in trainer["rng"]]
    return {"model": load_pretrained(directory).state_dict(), "optimizer": _safe_load(directory / "optimizer.pt"),
            "trainer": trainer}


def _safe_load(path: Path, numpy_arrays: bool = False) -> dict:
    """torch.load(weights_only=True): tensors and plain types only, nothing pickled is run. numpy_arrays adds
    numpy's ndarray (and only what rebuilds one) to the allow-list, for format-1 trainer states."""
    allowed = []
    if numpy_arrays:
        rebuild = np.zeros(1).__reduce__()[0]  # numpy's _reconstruct; pickled as numpy.core.* by numpy 1.x
        allowed = [rebuild, (rebuild, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype,
                   type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = re.search(r"WeightsUnpickler error: (.*?)(\. |$)", str(e), re.MULTILINE)
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} holds objects that a safe load "
                              "(torch.load(weights_only=True)) refuses, so openk3 did not write it "
                              f"({reason.group(1) if reason else 'unreadable'}); it is not loaded") from None
