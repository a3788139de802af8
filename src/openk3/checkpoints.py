"""Finding a checkpoint for inference: a checkpoint directory, or a training run's latest complete one.

Shared by `openk3 generate` and `openk3 serve` (below both, so serving never imports a command module).
"""

from __future__ import annotations

from pathlib import Path


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a training --out directory (its latest complete checkpoint)."""
    from openk3.train.checkpoint import latest_checkpoint

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint (no config.json) nor a run directory with step-*/ "
                                "checkpoints")
    return latest
