"""A training step's forward and backward replayed as one CUDA graph (`openk3 train --cuda-graphs`).

A compiled step issues thousands of kernels, and the host's Python (Dynamo's frames, Inductor's and Triton's
launchers, AOT autograd's wrappers) can take as long to issue the forward as the GPU takes to run it, so the GPU
waits for it (docs/training.md). Captured once, the forward's and backward's launches replay from one
call. The optimizer, gradient clipping and the router balancer stay outside and run eagerly between replays, so
learning-rate schedules, clipping and Quantile Balancing need nothing graph-safe.

What the graph relies on (CUDA graph semantics; `torch.cuda.graph`):
- fixed shapes: each call's batch is copied into one static tensor (another shape is a ValueError);
- gradients: captured with every `.grad` None, the backward writes fresh gradient tensors, which each replay
  refreshes in place; a call re-attaches them, so the caller's `zero_grad(set_to_none=True)` stays as it is;
- state changes in place only (parameters, the router bias, optimizer state), and no host sync inside the step;
- autocast inside `fn` with `cache_enabled=False` (its weight-cast cache would outlive the capture).
The first `warmup` calls run eagerly on a side stream (compilation, Triton's JIT and cuBLAS's lazy set-up happen
there, not under capture); the next call captures and replays. If capture fails, the step stays eager (a warning
says why).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

Outputs = tuple[torch.Tensor | None, ...]


class GraphedForwardBackward:
    """`fn(batch) -> outputs` (a tuple of detached tensors or None; it runs the forward and `loss.backward()`)
    called through a CUDA graph after `warmup` eager calls; `params` are the tensors whose gradients it makes.
    Once captured, every call returns the same output tensors, refreshed: read or clone them before the next."""

    def __init__(self, fn: Callable[[torch.Tensor], Outputs], params: Sequence[torch.Tensor], warmup: int = 2):
        if warmup < 1:
            raise ValueError(f"warmup must be at least 1 (the first call compiles and sets up), got {warmup}")
        self.fn, self.params, self.warmup = fn, list(params), warmup
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed: str | None = None  # why capture failed (the step then stays eager)
        self.batch: torch.Tensor | None = None  # the static input
        self.outputs: Outputs = ()
        self.grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its static gradient)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, batch: torch.Tensor) -> Outputs:
        if self.failed is not None:
            return self.fn(batch)
        if self.batch is None:
            if batch.device.type != "cuda":
                raise ValueError(f"CUDA graphs need the batch on a CUDA device, got {batch.device}")
            self.batch = torch.empty_like(batch)
        if batch.shape != self.batch.shape or batch.dtype != self.batch.dtype:
            raise ValueError(f"a CUDA-graphed step takes batches of one shape: the first was "
                             f"{tuple(self.batch.shape)} {self.batch.dtype}, got {tuple(batch.shape)} {batch.dtype}")
        self.batch.copy_(batch)
        self.calls += 1
        if self.graph is None and self.calls <= self.warmup:
            return self._eager_on_side_stream()
        if self.graph is None:
            try:
                self._capture()
            except Exception as err:  # a sync or an uncapturable op in the step: train on, eagerly
                self._give_up(err)
                return self.fn(self.batch)
        self.graph.replay()
        for p, grad in self.grads:
            p.grad = grad
        return self.outputs

    def _eager_on_side_stream(self) -> Outputs:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outputs = self.fn(self.batch)
        torch.cuda.current_stream().wait_stream(stream)
        return outputs

    def _capture(self) -> None:
        for p in self.params:  # so the captured backward writes its gradients instead of adding to old ones
            p.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.outputs = tuple(self.fn(self.batch))
        self.graph = graph
        self.grads = [(p, p.grad) for p in self.params if p.grad is not None]

    def _give_up(self, err: Exception) -> None:
        self.failed = str(err).splitlines()[0] if str(err) else type(err).__name__
        self.graph, self.outputs, self.grads = None, (), []
        for p in self.params:  # whatever the broken capture attached
            p.grad = None
        torch.cuda.synchronize()
        warnings.warn(f"capturing the training step as a CUDA graph failed, training on eagerly: {self.failed}",
                      RuntimeWarning, stacklevel=3)
