"""Settings of a training run (the `openk3 train` options; no heavy imports, so the CLI parser stays fast).

Impossible values fail where they are given: `openk3 train` checks each flag as it parses it (`flag_type`), and
TrainArgs checks every field when it is built in code; both name the flag and use the bounds in BOUNDS.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields

DEFAULT_STEPS = 300
QAT_FORMATS = ("mxfp4",)  # openk3.quant.qat.enable_qat's formats (not imported: this module stays light)
PACKINGS = ("auto", "docs", "concat")


@dataclass
class TrainArgs:
    preset: str = "k3-tiny"
    config: str | None = None  # JSON file of ModelConfig overrides
    overrides: dict = field(default_factory=dict)  # the same, in code (applied after --config)
    data: str | None = None
    tokenizer: str | None = None
    seq_len: int = 128
    batch_size: int | None = None  # global (all data-parallel ranks together); None: the task's default (loop.py)
    max_steps: int | None = None  # None: the resumed checkpoint's schedule, else DEFAULT_STEPS
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_frac: float = 0.05
    decay_frac: float = 0.3
    grad_clip: float = 1.0
    seed: int = 0
    out: str | None = None  # None: runs/<preset>
    overwrite: bool = False  # replace another run's files in `out` (otherwise refused)
    save_every: int = 0  # 0: only at the end
    eval_every: int = 50
    eval_windows: int = 32
    resume: str | None = None
    device: str | None = None
    threads: int = 0  # torch intra-op threads on CPU; 0: auto (openk3.cli_options.cpu_threads)
    dtype: str = "auto"
    compile: bool | None = None  # None: by device (`resolve_fast_path`): on with CUDA, off on CPU
    cuda_graphs: bool | None = None  # forward and backward replayed as one CUDA graph (openk3.train.graphs); None: by
    # device, as compile, and off where shapes vary (`resolve_fast_path`)
    packing: str = "auto"  # "docs" | "concat" | "auto" (docs when the data has more than one document)
    tensorboard: str | None = None  # a directory for TensorBoard event files of the metrics
    activation_checkpointing: bool = False
    optimizer: str = "muon"
    balance: str = "quantile"
    balance_gamma: float = 1e-3
    mtp_weight: float = 0.3
    kda_backend: str = "auto"  # model.kda.configure_kda: "auto" lets ops.kda.resolve_backend choose per call
    qat: str | None = None  # "mxfp4": fake-quantize the routed experts in the forward (openk3.quant.qat)
    sample_tokens: int = 120
    time_limit: float = 0.0  # opt-in wall seconds for the whole run: the step count shrinks to fit; 0: off
    progress: bool = True
    plot: bool = True
    cp: int = 1  # context-parallel ranks per data-parallel index (openk3.parallel; data parallel = processes / cp)
    ep: int = 1  # expert-parallel group size
    ep_planner: str = "balanced"  # "balanced" (MoonEP: S x K rows per rank) or "static" (every row to its home rank)

    def __post_init__(self) -> None:
        if self.out is None:
            self.out = f"runs/{self.preset}"
        for f in fields(self):
            problem = bound_problem(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(f"{flag_name(f.name)} {problem}")
        if self.qat not in (None, *QAT_FORMATS):
            raise ValueError(f"--qat must be one of {QAT_FORMATS}, got {self.qat!r}")
        if self.packing not in PACKINGS:
            raise ValueError(f"--packing must be one of {PACKINGS}, got {self.packing!r}")


@dataclass(frozen=True)
class Bound:
    low: float
    low_inclusive: bool = True
    high: float = math.inf

    def problem(self, value: float) -> str | None:
        if not math.isfinite(value):  # no setting means "unbounded" by inf: 0 is "off" where there is an off
            return f"must be a finite number, got {value!r}"
        if (value >= self.low if self.low_inclusive else value > self.low) and value <= self.high:
            return None
        low = f"at least {self.low:g}" if self.low_inclusive else f"greater than {self.low:g}"
        return f"must be {low}{'' if self.high == math.inf else f' and at most {self.high:g}'}, got {value!r}"


MAX_LR = 100.0  # far past any working rate; 1e300 overflowed fp32 inside the optimizer step

BOUNDS = {
    "seq_len": Bound(1), "batch_size": Bound(1), "max_steps": Bound(1),
    "lr": Bound(0, low_inclusive=False, high=MAX_LR),
    "weight_decay": Bound(0), "warmup_frac": Bound(0, high=1), "decay_frac": Bound(0, high=1),
    "grad_clip": Bound(0, low_inclusive=False), "save_every": Bound(0), "eval_every": Bound(0),
    "eval_windows": Bound(1), "threads": Bound(0), "balance_gamma": Bound(0), "mtp_weight": Bound(0),
    "sample_tokens": Bound(0), "time_limit": Bound(0), "cp": Bound(1), "ep": Bound(1),
}


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def bound_problem(name: str, value) -> str | None:
    """Why `value` is impossible for the setting `name` (None when it is fine or unbounded)."""
    if name not in BOUNDS or value is None:
        return None
    return BOUNDS[name].problem(value)


def flag_type(name: str, kind: type):
    """An argparse `type` that parses a `kind` and rejects values outside BOUNDS[name] (argparse names the flag)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        problem = bound_problem(name, value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    return parse


@dataclass(frozen=True)
class FastPath:
    """What a run compiles and captures (`resolve_fast_path`), and the line that says why graphs are off (or
    None)."""

    compile: bool
    cuda_graphs: bool
    note: str | None = None


def resolve_fast_path(compile: bool | None, cuda_graphs: bool | None, device_type: str, processes: int = 1,
                      varying: str | None = None) -> FastPath:
    """--compile / --cuda-graphs as the run uses them. Unset (None), both follow the device: on with CUDA (the
    fast path; bench/RESULTS.md measures it), off on CPU (eager: compiling costs more than it gains on the short
    CPU runs). Automatic CUDA graphs stay off, with a note, when the run has several processes or when `varying`
    names what changes the step's shapes or layout from batch to batch. Asked for explicitly, --cuda-graphs where
    it cannot work (not CUDA, several processes, `varying`) is refused with the reason."""
    cuda = device_type == "cuda"
    why_not = (f"this run is on {device_type}" if not cuda
               else f"this run has {processes} processes (FSDP2's and the parallel layouts' collectives are not "
                    "captured)" if processes > 1 else varying)
    if cuda_graphs and why_not:
        need = "a CUDA device" if not cuda else "one process and batches of one layout"
        raise ValueError(f"--cuda-graphs needs {need}; {why_not}")
    graphs = cuda and why_not is None if cuda_graphs is None else cuda_graphs
    note = f"CUDA graphs off: {why_not}" if cuda and cuda_graphs is None and why_not else None
    return FastPath(cuda if compile is None else compile, graphs, note)
