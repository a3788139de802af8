"""Shared by the multi-process tests: run a function in N real processes joined by a gloo group, with deadlines.

A hang (a collective that some rank never joins) fails within a minute: the group's timeout is COLLECTIVE_S, so
the waiting ranks raise and the test fails with their error. RUN_S bounds the whole run as a backstop (a hang
outside a collective); the processes this helper started are then terminated. It is generous because a 4-process
run on 2 shared cores can take 40 s without hanging.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_S = 60.0
RUN_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, collective_s: float, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=collective_s))
    try:
        fn(rank, world, *args)
        dist.barrier()  # no rank tears its connections down while a peer may still be reading from them
    finally:
        dist.destroy_process_group()
    # A passing rank leaves without the interpreter's finalisation: there, gloo's worker threads have aborted a
    # process whose every check had passed (SIGABRT, "terminate called without an active exception"; once in a
    # CI run of the 4-process EP test). A failing rank raises above and reports its error as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, *args, deadline: float = RUN_S, collective_s: float = COLLECTIVE_S) -> None:
    """fn(rank, world, *args) in `world` spawned processes (fn must be importable: defined at module level)."""
    context = mp.start_processes(_entry, args=(fn, world, free_port(), collective_s, args), nprocs=world,
                                 join=False, start_method="spawn")
    stop = time.monotonic() + deadline
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > stop:
                raise TimeoutError(f"{world} processes still running after {deadline:.0f} s (a hang?)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """Relative RMS error ||actual - expected|| / ||expected|| <= tol, both finite."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all() and torch.isfinite(expected).all(), what
    err = (actual - expected).double().norm() / expected.double().norm().clamp_min(1e-30)
    assert err <= tol, f"{what}: relative error {err.item():.3g} > {tol}"
