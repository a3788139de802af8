"""`openk3 train` under torchrun where a run goes wrong: what each rank says.

- Ctrl-C after a save: every rank's message names the checkpoint to resume from (rank 1 said "no checkpoint was
  saved": only rank 0, which writes it, remembered the path).
- --cp with fewer tokens per data-parallel index than context-parallel ranks fails at start naming --cp (it
  failed at the first step: "1 tokens cannot be split over 2 context-parallel ranks").
"""

import os
from pathlib import Path

import pytest

from distributed_spawn import run_ranks
from openk3.parallel import ParallelDims
from openk3.train.interrupt import Interrupted
from openk3.train.loop import Trainer
from train_tiny import make_corpus, tiny_args


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


def test_cp_needs_a_token_on_every_rank():
    with pytest.raises(ValueError, match=r"--cp 2: .* 1 token\(s\), fewer than its 2 context-parallel ranks"):
        ParallelDims(2, cp=2).check_batch(1, seq_len=1)
    ParallelDims(2, cp=2).check_batch(1, seq_len=2)
    ParallelDims(4, cp=2).check_batch(4, seq_len=1)  # 2 windows of one token per data-parallel index
