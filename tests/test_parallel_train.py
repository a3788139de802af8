"""`openk3 train` under torchrun with context and expert parallelism follows the single-process run.

`openk3 train --preset k3-tiny --max-steps 4 --seed 7 --seq-len 64 --batch-size 4` in one process, then under
`torchrun --nproc-per-node 2` with `--cp 2` (one data-parallel index: the 4 windows are one packed stream of 256
tokens, 128 per rank) and with `--ep 2` (2 data-parallel ranks, 4 experts each, balanced planner). Same losses and
gradient norms per step to 1e-4 (measured: ~1e-7; the gradient norm catches a mis-scaled gradient that Muon's
scale invariance would hide from the losses). The --ep run saves at step 2 and a --cp run resumes from it: the
checkpoint does not depend on the layout. Every run has a deadline, so a hang fails the test.
"""

import json
import os
import subprocess
import sys

import pytest

from openk3.cli import main
from train_tiny import make_corpus, one_thread, pytorch_muon

TOL = 1e-4
DEADLINE_S = 120  # per run; each takes 10-25 s on 2 shared cores
COMMON = ["--preset", "k3-tiny", "--max-steps", "4", "--seed", "7", "--seq-len", "64", "--batch-size", "4",
          "--no-progress", "--time-limit", "0", "--sample-tokens", "4", "--threads", "1"]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _run(cmd, env, out):
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return _metrics(out)


def _same(run, reference, where):
    assert [r["step"] for r in run] == [r["step"] for r in reference[-len(run):]], where
    for a, b in zip(reference[-len(run):], run):
        for key in ("loss", "mtp_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=TOL), (where, a["step"], key, a[key], b[key])


def test_train_cp2_and_ep2_follow_one_process(tmp_path, monkeypatch):
    data = make_corpus(tmp_path / "data")
    # Muon's PyTorch passes in every run: TRITON_INTERPRET=1 would run its Triton kernels interpreted (10-15x the
    # step) in the processes that hold whole parameters; the sharded ones take the PyTorch passes anyway
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OPENK3_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    args = [*COMMON, "--data", str(data)]
    monkeypatch.setenv("OPENK3_CACHE", env["OPENK3_CACHE"])
    pytorch_muon(monkeypatch)
    with one_thread():
        assert main(["train", *args, "--out", str(tmp_path / "single")]) == 0
    single = _metrics(tmp_path / "single")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "openk3", "train"]
    assert single[0]["loss"] - single[-1]["loss"] > 10 * TOL * single[0]["loss"]  # the tolerance is meaningful
    ep = _run([*torchrun, *args, "--ep", "2", "--save-every", "2", "--out", str(tmp_path / "ep")], env, tmp_path / "ep")
    _same(ep, single, "--ep 2")
    cp = _run([*torchrun, *args, "--cp", "2", "--out", str(tmp_path / "cp")], env, tmp_path / "cp")
    _same(cp, single, "--cp 2")
    resumed = _run([*torchrun, *args, "--cp", "2", "--resume", str(tmp_path / "ep" / "step-000002"),
                    "--out", str(tmp_path / "resumed")], env, tmp_path / "resumed")
    _same(resumed, single, "--cp 2 resumed from --ep 2")
