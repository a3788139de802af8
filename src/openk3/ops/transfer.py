"""Small host <-> device copies: host -> device without making the host wait for the GPU, device -> host waiting
without holding Python's GIL.

`torch.tensor(values, device="cuda")` copies from pageable memory and synchronises: the host waits for every kernel
queued before the copy. The prefill built its index tensors that way, so the host could not queue a chunk's
kernels while the GPU still ran the previous chunk's: each chunk cost its host time plus its device time. From
pinned memory with non_blocking=True the copy is queued on the stream like a kernel, and PyTorch's pinned-memory
allocator keeps the host buffer until the copy has run.

`tensor.tolist()` of a CUDA tensor waits for the GPU holding the GIL, so a server's event loop on another thread
cannot run while an engine step waits for its sampled tokens; `host_list` waits on a CUDA event first, which
releases the GIL while it waits. `HostCopy` queues the copy now and reads it later: the serving engine queues the
next decode step before it reads the last one's tokens.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device), queued without a host synchronisation on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def queued(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`: on a GPU copied from pinned memory, queued like a kernel (`t.to(device)` would
    make the host wait for every kernel queued before it)."""
    device = torch.device(device)
    if device.type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A tensor's copy to the host, queued on its device's stream when made (into pinned memory); `tolist` waits
    for it without the GIL. A CPU tensor is its own copy."""

    def __init__(self, tensor: torch.Tensor):
        self.done = None
        if not tensor.is_cuda:
            self.host = tensor
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record(torch.cuda.current_stream(tensor.device))

    def tolist(self) -> list:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def host_list(tensor: torch.Tensor) -> list:
    """tensor.tolist(), the wait for a CUDA tensor's producers done without the GIL."""
    return HostCopy(tensor).tolist()
