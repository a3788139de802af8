"""A training step whose work is queued on the device, read back later (`Trainer.steps`).

Reading a step's loss waits for the device to finish it. Read at once, the GPU then idles while the host fetches
the next batch, builds its document tables and launches its first kernels. So the loop queues step n + 1 before
it reads step n's numbers, which stay device tensors until then. (k3-debug's compiled 8 x 4096 step on an H200 is
bound by the GPU, not the host, and runs at the same speed either way: bench/RESULTS.md, 2026-12-07 eighth
session; steps whose host work outlasts the GPU's gain.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


class DeviceMark:
    """A point in the device's queue of work: a CUDA event, or the wall clock where work runs as it is issued."""

    def __init__(self, device: torch.device):
        self.event = None
        self.wall = time.perf_counter()
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()

    def seconds_until(self, later: DeviceMark) -> float:
        """Device seconds from this mark to `later` (waits for `later`)."""
        if self.event is None:
            return later.wall - self.wall
        later.event.synchronize()
        return self.event.elapsed_time(later.event) / 1e3


@dataclass
class QueuedStep:
    """Step `step`'s numbers as device tensors. The start mark is queued before the step's own work, so on a busy
    GPU it fires when the previous step ends: start -> end is the device time this step added."""

    step: int
    lr: float
    tokens: int  # of the global batch
    losses: torch.Tensor  # [1] the LM loss, or [2] with the MTP loss; averaged over the ranks
    grad_norm: torch.Tensor
    maxvio: dict[str, torch.Tensor]  # per MoE layer, 0-d
    start: DeviceMark
    end: DeviceMark

    def record(self, flops_per_token: float | None = None, peak_flops: float | None = None,
               world_size: int = 1) -> dict:
        """The metrics line of the step (waits for it): loss, lr, grad_norm, tokens_per_s, maxvio per layer, mfu
        when `peak_flops` is known (per GPU: the global batch's tokens over all of them), mtp_loss with MTP."""
        seconds = self.start.seconds_until(self.end)
        losses = self.losses.tolist()
        maxvio = torch.stack(list(self.maxvio.values())).tolist() if self.maxvio else []
        record = {"step": self.step, "loss": losses[0], "lr": self.lr, "grad_norm": float(self.grad_norm),
                  "tokens_per_s": self.tokens / seconds, "maxvio": dict(zip(self.maxvio, maxvio))}
        if peak_flops and flops_per_token:
            record["mfu"] = record["tokens_per_s"] * flops_per_token / (peak_flops * world_size)
        if len(losses) > 1:  # no MTP loss when the model has no MTP layer or --mtp-weight is 0
            record["mtp_loss"] = losses[1]
        return record
