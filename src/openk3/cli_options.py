"""Options shared by the commands that build a model, with defaults from the environment, and argparse types.

The CLI is the only place the KDA environment variables are read (model/ and ops/ take explicit arguments):
OPENK3_KDA_BACKEND (auto | recurrent | chunked | triton) is the default of --kda-backend. `cpu_threads` is what
--threads 0 (auto) means for train, draft and generate.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from openk3.ops.kda import BACKENDS


def add_kda_options(parser: argparse.ArgumentParser) -> None:
    backend = os.environ.get("OPENK3_KDA_BACKEND", "auto")
    if backend not in BACKENDS:
        print(f"openk3: error: OPENK3_KDA_BACKEND must be one of {', '.join(BACKENDS)}, got {backend!r}",
              file=sys.stderr)
        raise SystemExit(2)
    parser.add_argument("--kda-backend", default=backend, choices=BACKENDS,
                        help="KDA implementation: auto = Triton kernels on CUDA, the chunked form on CPU (the "
                             "recurrence for single tokens); $OPENK3_KDA_BACKEND sets the default "
                             "(default: %(default)s)")


class ShowDefaults(argparse.HelpFormatter):
    """An argparse formatter: every option's help ends with its default, except flags that are off, options without
    one and help that states its default already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if not unset and action.option_strings and "default" not in text.lower():
            text += " (default: %(default)s)"
        return text


class ShowDefaultsRaw(ShowDefaults, argparse.RawDescriptionHelpFormatter):
    """ShowDefaults with the description printed as written (serve's, with its example commands)."""


def int_at_least(low: int):
    """An argparse `type`: an integer >= low (argparse names the flag in the error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def float_in(low: float, high: float = math.inf, *, open_low: bool = False):
    """An argparse `type`: a finite number in [low, high] ((low, high] when `open_low`)."""
    if high < math.inf:
        allowed = f"in {'(' if open_low else '['}{low:g}, {high:g}]"
    else:
        allowed = f"{'above' if open_low else 'at least'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {allowed}, got {text!r}") from None
        if not (math.isfinite(value) and (value > low if open_low else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    return parse


def parse_device(name: str | None, verb: str = "runs"):
    """--device as a torch.device (None: cuda when available, else cpu); ValueError naming the flag for anything but
    cpu, cuda or cuda:N. `verb`: what openk3 does there, for the message ("runs", "trains")."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: openk3 {verb} on cpu or cuda (cuda:N for one GPU of several)")
    return device


def resolve_device(name: str | None):
    """--device: cpu, cuda or cuda:N; None: cuda when available. ValueError naming the flag for a device that this
    machine or torch build lacks, before any model loads."""
    import torch

    device = parse_device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this machine or torch build has no CUDA GPU; use --device cpu")
    if device.index is not None and device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPUs")
    return device


def check_triton(device, flag: str, value: str) -> None:
    """`flag triton` (--kda-backend, serve's --kernels) needs a CUDA device: Triton has no CPU driver."""
    if value == "triton" and device.type != "cuda":
        raise ValueError(f"{flag} triton needs a CUDA device (Triton has no CPU driver); use {flag} auto on "
                         f"{device.type}")


def cpu_threads(requested: int, processes: int = 1) -> int:
    """Intra-op threads on CPU for --threads `requested`. 0 = auto: the cores divided among the processes sharing
    them (LOCAL_WORLD_SIZE under torchrun, else `processes`), or 1 when other processes already keep the cores busy
    (1-minute load average >= cores - 0.5).

    Why the fallback: with more runnable threads than cores, every parallel region waits for its slowest,
    descheduled thread: on a shared 2-core machine a step with 2 threads took many times as long as with 1.
    """
    if requested > 0:
        return requested
    cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", processes))
    busy = hasattr(os, "getloadavg") and os.getloadavg()[0] >= cores - 0.5
    return 1 if busy else max(1, cores // local)
