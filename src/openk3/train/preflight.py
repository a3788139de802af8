"""Checks of `openk3 train` and `openk3 draft` settings that need torch but nothing built: the device, the KDA
backend on it, and whether the host has the memory to train a model on the CPU. Each raises a ValueError naming
the flag, before anything is allocated or written."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from openk3.accounting import count_parameters
from openk3.cli_options import parse_device
from openk3.config import ModelConfig

TRAIN_BYTES_PER_PARAMETER = 16  # fp32 weight, gradient and two optimizer-state tensors (AdamW's moments)
GIB = 1 << 30


def checked_device(name: str | None) -> torch.device:
    """--device as a torch.device (unset: cuda when a device is visible, else cpu), with the reason a CUDA one is
    unusable: no CUDA in the build, no device visible, an index past them."""
    device = parse_device(name, "trains")
    if device.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise ValueError(f"--device {name}: this torch build has no CUDA; use --device cpu or install a CUDA "
                             "build of torch")
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError(f"--device {name}: no CUDA device is visible (check the driver and "
                             "CUDA_VISIBLE_DEVICES), or use --device cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: only {count} CUDA device(s) are visible (cuda:0 to cuda:{count - 1})")
    return device


def check_kda_backend(backend: str, device: torch.device) -> None:
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"--kda-backend triton needs a CUDA device, this run is on {device.type}; use auto, "
                         "chunked or recurrent")


def available_memory() -> int | None:
    """Bytes the host can give without swapping (MemAvailable; free pages where there is no /proc/meminfo)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_host_memory(cfg: ModelConfig, preset: str) -> None:
    """Refuse to train on the CPU a model whose weights, gradients and optimizer state alone exceed the memory
    available (activations come on top)."""
    counts = count_parameters(cfg)
    parameters = counts["total_params"] + counts["mtp_params"] + counts["vision_params"]
    need, have = parameters * TRAIN_BYTES_PER_PARAMETER, available_memory()
    if have is not None and need > have:
        raise ValueError(f"--preset {preset}: training its {parameters / 1e9:.2f}B parameters on the CPU needs at "
                         f"least {need / GIB:.1f} GiB (weights, gradients, optimizer state), {have / GIB:.1f} GiB "
                         "is available; train on GPUs (torchrun, FSDP2) or a smaller preset or --config")
