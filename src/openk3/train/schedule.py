"""Warmup-Stable-Decay learning-rate schedule (SPEC §6).

Linear warmup from 0 to the peak over `warmup` steps, constant at the peak, then a linear decay over the last
`decay` steps down to `min_ratio` times the peak. A pure function of the step, so resuming needs only the step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class WSDSchedule:
    peak_lr: float
    total_steps: int
    warmup: int
    decay: int
    min_ratio: float = 0.1

    @classmethod
    def for_run(cls, peak_lr: float, total_steps: int, warmup_frac: float = 0.05, decay_frac: float = 0.3,
                min_ratio: float = 0.1) -> WSDSchedule:
        warmup = max(1, round(total_steps * warmup_frac))
        decay = min(total_steps - warmup, round(total_steps * decay_frac))
        return cls(peak_lr, total_steps, warmup, max(decay, 0), min_ratio)

    def __call__(self, step: int) -> float:
        """lr for the optimizer step with zero-based index `step`."""
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        decay_start = self.total_steps - self.decay
        if step < decay_start or self.decay == 0:
            return self.peak_lr
        frac = min(1.0, (step - decay_start + 1) / self.decay)
        return self.peak_lr * (1.0 - frac * (1.0 - self.min_ratio))

    def state_dict(self) -> dict:
        return asdict(self)
