"""`openk3 train` under torchrun where a run goes wrong: what each rank says.

- Ctrl-C after a save: every rank's message names the checkpoint to resume from (rank 1 said "no checkpoint was
  saved": only rank 0, which writes it, remembered the path).
- --cp with fewer tokens per data-parallel index than context-parallel ranks fails at start naming --cp (it
  failed at the first step: "1 tokens cannot be split over 2 context-parallel ranks").
- Settings that no rank can run with fail at start on every rank with the same one line, not on rank 0 alone
  with the others dying in their next collective ("Connection closed by peer", a traceback burying the line):
  a --tokenizer that is no tokenizer.json (read by rank 0 alone), an --out that is a file (found by rank 0
  alone, at its first write, after the model was built, as "[Errno 17] File exists"), a tokenizer cache that
  cannot be written (rank 0 trains the tokenizer while the others wait).
- Rank 0 failing to write a checkpoint (a full disk) stops every rank with its error (the others went on into
  their next collective).
"""

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distributed_spawn import run_ranks
from openk3.parallel import ParallelDims
from openk3.train import checkpoint
from openk3.train.interrupt import Interrupted
from openk3.train.loop import Trainer
from train_tiny import make_corpus, tiny_args

DEADLINE_S = 120


def _interrupted(rank, world, out, data, cache):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), OPENK3_CACHE=cache)
    trainer = Trainer(tiny_args(Path(out), Path(data), max_steps=4, save_every=2, eval_every=0))
    queue = trainer.queue_step

    def ctrl_c_at_step_3():
        if trainer.step == 2:
            raise KeyboardInterrupt
        return queue()

    trainer.queue_step = ctrl_c_at_step_3
    with pytest.raises(Interrupted) as stop:
        trainer.run()
    checkpoint = Path(out) / "step-000002"
    assert str(stop.value) == (f"interrupted at step 2; the last checkpoint is {checkpoint} (resume with --resume "
                               f"{checkpoint})"), f"rank {rank}"


def test_ctrl_c_names_the_saved_checkpoint_on_every_rank(tmp_path):
    data = make_corpus(tmp_path / "data")
    run_ranks(_interrupted, 2, str(tmp_path / "out"), str(data), str(tmp_path / "cache"))


def _disk_full(rank, world, out, data, cache):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), OPENK3_CACHE=cache)
    trainer = Trainer(tiny_args(Path(out), Path(data), max_steps=4, save_every=2, eval_every=0))

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), out)

    if rank == 0:
        checkpoint.save_checkpoint = no_space
    with pytest.raises(OSError, match=f"No space left on device: '{out}'"):
        trainer.run()


def test_a_failed_save_stops_every_rank_with_its_error(tmp_path):
    data = make_corpus(tmp_path / "data")
    run_ranks(_disk_full, 2, str(tmp_path / "out"), str(data), str(tmp_path / "cache"), collective_s=20)


def test_cp_needs_a_token_on_every_rank():
    with pytest.raises(ValueError, match=r"--cp 2: .* 1 token\(s\), fewer than its 2 context-parallel ranks"):
        ParallelDims(2, cp=2).check_batch(1, seq_len=1)
    ParallelDims(2, cp=2).check_batch(1, seq_len=2)
    ParallelDims(4, cp=2).check_batch(4, seq_len=1)  # 2 windows of one token per data-parallel index


@pytest.mark.parametrize("setting", ["tokenizer", "out", "cache"])
def test_a_bad_file_fails_with_one_line_on_every_rank(tmp_path, setting):
    bad = tmp_path / "bad.json"
    bad.write_text("garbage{")
    data = make_corpus(tmp_path / "data")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OPENK3_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    paths = {"tokenizer": ["--tokenizer", str(bad), "--out", str(tmp_path / "run")], "out": ["--out", str(bad)],
             "cache": ["--out", str(tmp_path / "run")]}
    if setting == "cache":  # $OPENK3_CACHE a file: training the tokenizer on rank 0 cannot store it
        env["OPENK3_CACHE"] = str(bad)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "openk3",
           "train", "--data", str(data), "--max-steps", "1", "--seq-len", "16", "--batch-size", "2", "--threads", "1",
           "--no-progress", *paths[setting]]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("openk3 train: error:")]
    assert len(errors) == 2 and errors[0] == errors[1] and str(bad) in errors[0], done.stderr[-3000:]
    assert "[rank" not in done.stderr, done.stderr[-3000:]  # no rank's traceback
