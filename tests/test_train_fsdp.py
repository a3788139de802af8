"""FSDP2 data parallel on CPU: 2 real processes (gloo) follow the 1-process loss trajectory of the same global batch.

Tolerance: both runs see the same tokens and the same initialisation; they differ only in floating-point summation
order (the gradient reduce-scatter averages two half-batch gradients, the single process sums one full batch).
Measured: about 1e-7 relative per step. 1e-5 relative leaves room for other CPUs' summation orders and is still
three orders of magnitude below the step-to-step change of the loss.
"""

import json
import os
import socket
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from openk3.train.command import train
from train_tiny import make_corpus, one_thread, pytorch_muon, tiny_args

STEPS, SAVE_AT = 5, 3
COMPILED_STEPS = 3
EVAL_WINDOWS = 5  # odd: the two ranks get unequal shares of the held-out windows
COMPILED_EVAL_WINDOWS = 4  # even: one batch shape in the compiled run's held-out pass, not a second compile of it
REL_TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world: int, port: int, cache: str) -> None:
    """This spawned process's torch.distributed environment (the loop initialises the group from it), one thread."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OPENK3_CACHE=cache)
    torch.set_num_threads(1)


def _worker(rank: int, world: int, port: int, out: str, data: str, cache: str, resume: str | None) -> None:
    _join(rank, world, port, cache)
    train(tiny_args(Path(out), Path(data), max_steps=STEPS, device="cpu", save_every=SAVE_AT, resume=resume,
                    eval_windows=EVAL_WINDOWS))


def _spawn(out: Path, data: Path, cache: Path, resume: Path | None = None) -> None:
    args = (2, _free_port(), str(out), str(data), str(cache), str(resume) if resume else None)
    mp.spawn(_worker, args=args, nprocs=2, join=True)


def _trajectory(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_process_fsdp_matches_one_process(tmp_path):
    data = make_corpus(tmp_path / "data")
    cache = tmp_path / "cache"
    with pytest.MonkeyPatch.context() as monkey, one_thread():
        monkey.setenv("OPENK3_CACHE", str(cache))
        pytorch_muon(monkey)  # as the sharded processes step (not the Triton kernels, interpreted here)
        single = train(tiny_args(tmp_path / "single", data, max_steps=STEPS, eval_windows=EVAL_WINDOWS))
    _spawn(tmp_path / "fsdp", data, cache)
    one, two = _trajectory(tmp_path / "single"), _trajectory(tmp_path / "fsdp")
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=REL_TOL), (a["step"], a["loss"], b["loss"])
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=REL_TOL)
    assert one[0]["loss"] - one[-1]["loss"] > 10 * REL_TOL * one[0]["loss"]  # the tolerance is meaningful
    summary = json.loads((tmp_path / "fsdp" / "summary.json").read_text())
    assert summary["heldout_loss"] == pytest.approx(single["heldout_loss"], rel=REL_TOL)
    assert (tmp_path / "fsdp" / f"step-{STEPS:06d}" / "model.safetensors").is_file()

    # resume the 2-process run from its step-3 checkpoint (sharded model and optimizer state reloaded)
    _spawn(tmp_path / "resumed", data, cache, resume=tmp_path / "fsdp" / f"step-{SAVE_AT:06d}")
    resumed = _trajectory(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(SAVE_AT + 1, STEPS + 1))
    for a, b in zip(two[SAVE_AT:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=REL_TOL), (a["step"], a["loss"], b["loss"])


def _compiled_worker(rank: int, world: int, port: int, out: str, data: str, cache: str) -> None:
    """A training process with `--compile`, Dynamo tracing every compiled unit and AOTAutograd building its backward
    (the aot_eager backend: Inductor's C++ code generation takes minutes on this CPU)."""
    import openk3.train.loop as loop

    loop.compile_blocks = partial(loop.compile_blocks, backend="aot_eager")
    _join(rank, world, port, cache)
    train(tiny_args(Path(out), Path(data), max_steps=COMPILED_STEPS, device="cpu", compile=True, eval_every=0,
                    eval_windows=COMPILED_EVAL_WINDOWS))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the units did run compiled


def test_compiled_blocks_under_fsdp_follow_one_eager_process(tmp_path):
    """`openk3 train --compile` on 2 FSDP2 processes: the compiled blocks (applied before sharding, as the loop
    does) train on sharded parameters and follow the eager single process's losses to the FSDP tolerance."""
    data = make_corpus(tmp_path / "data")
    cache = tmp_path / "cache"
    with pytest.MonkeyPatch.context() as monkey, one_thread():
        monkey.setenv("OPENK3_CACHE", str(cache))
        pytorch_muon(monkey)  # as the sharded processes step (not the Triton kernels, interpreted here)
        train(tiny_args(tmp_path / "single", data, max_steps=COMPILED_STEPS, eval_every=0,
                        eval_windows=COMPILED_EVAL_WINDOWS))
    mp.spawn(_compiled_worker, args=(2, _free_port(), str(tmp_path / "compiled"), str(data), str(cache)), nprocs=2,
             join=True)
    one, two = _trajectory(tmp_path / "single"), _trajectory(tmp_path / "compiled")
    assert [r["step"] for r in two] == list(range(1, COMPILED_STEPS + 1))
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=REL_TOL), (a["step"], a["loss"], b["loss"])
