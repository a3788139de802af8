"""Settings of a training run (the `openk3 train` options; no heavy imports, so the CLI parser stays fast)."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_STEPS = 300


@dataclass
class TrainArgs:
    preset: str = "k3-tiny"
    config: str | None = None  # JSON file of ModelConfig overrides
    overrides: dict = field(default_factory=dict)  # the same, in code (applied after --config)
    data: str | None = None
    tokenizer: str | None = None
    seq_len: int = 128
    batch_size: int = 8  # global (all data-parallel ranks together)
    max_steps: int | None = None  # None: the resumed checkpoint's schedule, else DEFAULT_STEPS
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_frac: float = 0.05
    decay_frac: float = 0.3
    grad_clip: float = 1.0
    seed: int = 0
    out: str = "runs/k3-tiny"
    save_every: int = 0  # 0: only at the end
    eval_every: int = 50
    eval_windows: int = 32
    resume: str | None = None
    device: str | None = None
    threads: int = 0  # torch intra-op threads on CPU; 0: auto (see loop.cpu_threads)
    dtype: str = "auto"
    compile: bool = False
    activation_checkpointing: bool = False
    optimizer: str = "muon"
    balance: str = "quantile"
    balance_gamma: float = 1e-3
    mtp_weight: float = 0.3
    sample_tokens: int = 120
    time_limit: float = 540.0  # wall seconds for the whole run; the step count shrinks to fit (0: no limit)
    progress: bool = True
    plot: bool = True
    cp: int = 1  # context-parallel ranks per data-parallel index (openk3.parallel; data parallel = processes / cp)
    ep: int = 1  # expert-parallel group size
    ep_planner: str = "balanced"  # "balanced" (MoonEP: S x K rows per rank) or "static" (every row to its home rank)
