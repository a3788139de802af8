"""Training checkpoint directories on disk: the manifest, and finding a run's latest checkpoint.

Below both train and serve (cli -> train / serve -> this), so `openk3 generate` and `openk3 serve --ckpt` resolve
a run directory without importing the training stack. Writing and loading the contents is train/checkpoint.py.

A run directory (`openk3 train --out`) holds `step-NNNNNN/` checkpoints. Each is complete once its
`manifest.json` exists: the size and sha256 of every other file in it, written last (train/checkpoint.py writes
into a temporary directory and renames it into place, so an interrupted save leaves no `step-*` directory).
Its `format_version` says how the trainer state is stored: 1 = pickled numpy / Python RNG objects (read through a
narrow allow-list, see train/checkpoint.py), 2 = tensors and plain types only.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted, or does not match this run."""


# what a command raises for bad input, said in one line (`openk3.cli`, and the server's engine process at start-up):
# an impossible config or input, a path missing or of the wrong kind, a checkpoint that does not fit, a diverged run
INPUT_ERRORS = (ValueError, OSError, CheckpointError, FloatingPointError)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def write_manifest(directory: Path, step: int) -> dict:
    """Write (and fsync) the manifest of every file now in `directory`; returns it."""
    files = sorted(p.name for p in directory.iterdir() if p.name != MANIFEST)
    manifest = {"format_version": FORMAT_VERSION, "step": step,
                "files": {name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
                          for name in files}}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
    fsync_file(directory / MANIFEST)
    return manifest


def verify_checkpoint(directory: str | Path) -> dict:
    """The manifest after checking every listed file's size and sha256; CheckpointError otherwise."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "is a file, not a checkpoint directory" if directory.exists() else "does not exist"
        raise CheckpointError(f"checkpoint {directory} {what}")
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete: no {MANIFEST} (was the save interrupted?)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {directory} is corrupted: unreadable {MANIFEST} ({e})") from None
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint {directory} has format version {manifest.get('format_version')}, "
                              f"this openk3 reads versions {', '.join(map(str, READABLE_VERSIONS))}")
    for name, meta in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory} is corrupted: {name} is missing")
        size = path.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"checkpoint {directory} is corrupted: {name} has {size} bytes, "
                                  f"the manifest says {meta['bytes']}")
        if sha256_file(path) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {directory} is corrupted: {name} does not match its sha256 "
                                  f"in {MANIFEST}")
    return manifest


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The highest complete step directory under out_dir (temporary directories are ignored)."""
    out_dir = Path(out_dir)
    steps = sorted(p for p in out_dir.glob("step-*") if p.is_dir() and (p / MANIFEST).is_file())
    return steps[-1] if steps else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a training --out directory (its latest complete checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        if path.exists():
            raise NotADirectoryError(f"{path} is a file, not a checkpoint or run directory")
        raise FileNotFoundError(f"{path} does not exist")
    if (path / "config.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint (no config.json) nor a run directory with step-*/ "
                                "checkpoints")
    return latest
