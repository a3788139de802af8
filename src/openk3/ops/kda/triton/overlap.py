"""Overlapped passes: a chain kernel (the reverse state pass) running beside the token-parallel kernel feeding it.

At batch 1 the state passes have a few dozen (sequence, head) chains: they fill a fraction of the GPU and wait on
latency, while the token-parallel kernel before them has thousands of independent programs. Run one after the
other, their times add; run side by side, the chain starts on the first chunks while later ones are computed.
The backward runs its recomputed prepare kernel and reverse pass this way (2.63 -> 2.36 ms at B1 T8192 H32 on
an H200); the forward does not: its chain slowed down more beside the prepare kernel than the overlap saved
(bench/NOTES-kda.md run 14).

Protocol: the producer takes its chunks in the order the chain consumes them (layout.py schedules) and, after
writing a chunk, sets its flag with a release; the chain polls the flags of its next chunks with an acquire
before reading them (signal_ready in chunk_fwd.py, wait_ready in chunk_bwd.py). The producer is launched first
and never waits, so nothing can deadlock, even where kernels run one at a time (CUDA_DEVICE_MAX_CONNECTIONS=1,
profilers, a kernel module loaded while another kernel runs); the chain follows on a high-priority side stream,
whose programs the GPU dispatches as soon as slots free up. Only chains with at most one program per SM run this
way, so that they leave the producer most of the GPU. `kda(..., overlap=False)` turns it off.
Under the CPU interpreter the two run one after the other with the same flags (every poll finds them set).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index, priority=-1)  # high priority: its programs are dispatched first


def ready_flags(n_chunks: int, H: int, chain_programs: int, device: torch.device) -> torch.Tensor | None:
    """Zeroed per-(chunk, head) flags when the chain may run beside its producer, else None (one after the
    other, no flags)."""
    if n_chunks == 0 or (device.type == "cuda" and chain_programs > _sm_count(device.index or 0)):
        return None
    return torch.zeros(n_chunks * H, dtype=torch.int32, device=device)


def side_by_side(producer, chain, flags: torch.Tensor | None) -> None:
    """Launch `chain` (which polls `flags`) beside `producer` (which sets them); one after the other without
    flags or off the GPU. Outputs must be allocated before the call."""
    if flags is None or flags.device.type != "cuda":
        producer()
        chain()
        return
    main = torch.cuda.current_stream(flags.device)
    side = _side_stream(flags.device.index or 0)
    side.wait_stream(main)
    producer()
    with torch.cuda.stream(side):
        chain()
    main.wait_stream(side)
