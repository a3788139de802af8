"""Checkpoint directories on disk: config.json plus safetensors, single-file or sharded with an index.

The file conventions are HF's: `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards with
`model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {key: file}}).
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from openk3.config import read_json

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint directory as a dict; a ValueError saying what is wrong otherwise: the path does
    not exist or is a file, it has no config.json, or that is not a JSON object (naming the file)."""
    path = Path(path)
    if not path.is_dir():
        what = "is a file, not a checkpoint directory" if path.exists() else "does not exist"
        raise ValueError(f"no {CONFIG_NAME}: checkpoint directory {str(path)!r} {what}")
    file = path / CONFIG_NAME
    if not file.is_file():
        raise ValueError(f"no {CONFIG_NAME} in checkpoint directory {str(path)!r}")
    config = read_json(file, str(file))
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}")
    return config


def write_config(path: str | Path, config: dict[str, Any]) -> None:
    (Path(path) / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def weight_map(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the file that holds it."""
    path = Path(path)
    index = path / INDEX_NAME
    if index.is_file():
        try:
            where = {key: path / name for key, name in json.loads(index.read_text())["weight_map"].items()}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): "
                             f"{type(exc).__name__}: {exc}") from None
        missing = sorted({file.name for file in where.values() if not file.is_file()})
        if missing:
            raise FileNotFoundError(f"checkpoint {str(path)!r} lacks {len(missing)} of the shards its {INDEX_NAME} "
                                    f"lists: {', '.join(missing)}")
        return where
    files = [path / SINGLE_NAME] if (path / SINGLE_NAME).is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in checkpoint directory {str(path)!r}")
    out: dict[str, Path] = {}
    for file in files:
        with open_safetensors(file) as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def open_safetensors(file: Path):
    """safe_open, with a file that is not readable safetensors (truncated, corrupted) a ValueError naming it, and
    one that cannot be opened (a directory, no permission) an OSError naming it."""
    try:
        return safe_open(file, "pt")
    except SafetensorError as exc:
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupted?): {exc}") from None
    except OSError as exc:
        raise OSError(f"{file} cannot be opened: {exc.strerror or exc}") from None


class TensorReader:
    """Open shards of a checkpoint directory: shapes from the headers, tensors one at a time on request (so a
    load holds at most the model plus the tensors being converted, never a second copy of the checkpoint)."""

    def __init__(self, path: str | Path):
        self._where = weight_map(path)
        self._stack = ExitStack()
        self._files = {file: self._stack.enter_context(open_safetensors(file)) for file in set(self._where.values())}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: tuple(self._files[file].get_slice(key).get_shape()) for key, file in self._where.items()}

    def get(self, key: str) -> torch.Tensor:
        return self._files[self._where[key]].get_tensor(key)

    def dtype(self, key: str) -> torch.dtype:
        """A tensor's stored dtype, from the header (no data read)."""
        name = self._files[self._where[key]].get_slice(key).get_dtype()
        return SAFETENSORS_DTYPES[name]


def save_safetensors(tensors: dict[str, torch.Tensor], file: str | Path,
                     metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, leaving the file with the mode every other file written here gets (the umask's,
    e.g. 0644): save_file renames a private temporary file (0600) into place."""
    file = Path(file)
    with file.open("ab"):  # created as open() creates files, or an existing file's mode kept
        mode = file.stat().st_mode & 0o777
    save_file(tensors, file, metadata=metadata)
    os.chmod(file, mode)


def write_tensors(path: str | Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None = None) -> None:
    """One `model.safetensors`, or shards of at most max_shard_bytes (a larger tensor gets a shard of its own)."""
    path = Path(path)
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    if len(shards) == 1:
        save_safetensors(shards[0], path / SINGLE_NAME, metadata={"format": "pt"})
        remove_stale_weights(path, {SINGLE_NAME})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    remove_stale_weights(path, {INDEX_NAME, *weight_map.values()})


def remove_stale_weights(path: Path, written: set[str]) -> None:
    """Remove the weight files of an earlier save into `path` that this one did not write (as HF's save_pretrained
    does): a `model.safetensors.index.json` left beside a new single file would be read instead of it, and a
    single file or shards of another count would linger. Only these file names are touched."""
    for file in path.iterdir():
        stale = file.name in (SINGLE_NAME, INDEX_NAME) or SHARD_NAME.fullmatch(file.name)
        if stale and file.name not in written and file.is_file():
            file.unlink()


def check_tensor_set(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], where: str) -> None:
    """One ValueError listing every missing, unexpected and wrongly shaped tensor (expected vs found)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(k for k in set(expected) & set(found) if tuple(expected[k]) != tuple(found[k]))
    if not (missing or unexpected or wrong):
        return
    lines = [f"checkpoint {where} does not match the model its config describes:"]
    if missing:
        lines.append(f"  missing ({len(missing)}): " + ", ".join(missing))
    if unexpected:
        lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(unexpected))
    if wrong:
        lines.append(f"  wrong shape ({len(wrong)}): " + ", ".join(
            f"{k} expected {list(expected[k])} found {list(found[k])}" for k in wrong))
    raise ValueError("\n".join(lines))
