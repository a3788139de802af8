"""Edges of `openk3 train` and `openk3 draft`: bad settings fail early naming the flag, before --out changes; a run
that failed before its first step leaves nothing that blocks the next; --resume takes a run directory and refuses
what it cannot continue; Ctrl-C ends a run with one line and its checkpoints intact; `openk3 draft` never deletes
a training run."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from openk3.checkpoints import latest_checkpoint, verify_checkpoint
from openk3.cli import main
from openk3.train import preflight
from openk3.train.args import TrainArgs
from openk3.train.checkpoint import publish
from openk3.train.command import train
from openk3.train.data import BatchStream, load_documents
from openk3.train.draft import DraftArgs, claim_out, train_draft
from openk3.train.loop import Trainer, claim_out_dir, run_files
from train_tiny import TINY, make_corpus, one_thread, tiny_args

STEPS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 2-step tiny run with a checkpoint at each step; its corpus beside it."""
    root = tmp_path_factory.mktemp("edges")
    data = make_corpus(root / "data")
    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.setenv("OPENK3_CACHE", str(root / "cache"))
        train(tiny_args(root / "run", data, max_steps=STEPS, save_every=1, eval_every=0, sample_tokens=0))
        yield root / "run"


def snapshot(directory):
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in sorted(directory.rglob("*"))}


def draft_args(ckpt, out, **changes) -> DraftArgs:
    data = ckpt if ckpt.name == "run" else ckpt.parent
    settings = dict(ckpt=str(ckpt), out=str(out), max_steps=1, seq_len=16, batch_size=2,
                    data=str(data.parent / "data"), eval_prompts=1, eval_prompt_len=8, eval_tokens=4, threads=1,
                    progress=False)
    return DraftArgs(**{**settings, **changes})


# ---- 1. `openk3 draft` never deletes a training run ------------------------------------------------------------

@pytest.mark.parametrize("ckpt, out", [(".", "."), ("step-000002", "."), (".", "draft"),
                                       ("step-000002", "step-000002"), ("step-000002", "step-000002/draft")])
def test_draft_refuses_an_out_that_overlaps_its_checkpoint(run, ckpt, out):
    before = snapshot(run)
    with pytest.raises(ValueError, match="overlaps --ckpt .* write the draft to a directory of its own"):
        train_draft(draft_args(run / ckpt, run / out, overwrite=True))
    assert snapshot(run) == before


def test_draft_names_a_training_run_in_its_out_and_never_deletes_it(run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    before = snapshot(other)
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"holds a training run .*\(metrics.jsonl, step-000001/, step-000002/\)"):
            claim_out(other, overwrite)
    assert snapshot(other) == before


def test_draft_overwrite_replaces_only_an_earlier_draft(run, tmp_path):
    out = tmp_path / "draft"
    with one_thread():
        train_draft(draft_args(run, out))
        with pytest.raises(ValueError, match="already holds a draft run"):
            train_draft(draft_args(run, out))
        (out / "notes.txt").write_text("mine")
        train_draft(draft_args(run, out, overwrite=True, max_steps=2))
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "notes.txt", "step-000002", "summary.json"]


# ---- 2. a run that failed before its first step blocks nothing ---------------------------------------------------

def test_a_run_that_fails_before_its_first_step_leaves_no_metrics(run, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENK3_CACHE", str(run.parent / "cache"))
    out = tmp_path / "failed"
    with pytest.raises(OSError, match="--tensorboard "), one_thread():
        Trainer(tiny_args(out, run.parent / "data", tensorboard=str(run / "metrics.jsonl" / "tb"))).run()
    assert run_files(out) == []
    claim_out_dir(out, None, overwrite=False, delete=True)


def test_an_empty_metrics_file_is_no_run(tmp_path):
    (tmp_path / "metrics.jsonl").touch()
    claim_out_dir(tmp_path, None, overwrite=False, delete=True)
    claim_out(tmp_path, overwrite=False)
    assert (tmp_path / "metrics.jsonl").exists()


# ---- 3. non-finite numbers --------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--lr", "--weight-decay", "--mtp-weight", "--grad-clip", "--time-limit",
                                  "--balance-gamma"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_non_finite_numbers_are_refused_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", f"{flag}={value}"])
    assert exit_.value.code == 2
    assert f"argument {flag}: must be a finite number, got {float(value)!r}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"{flag} must be a finite number"):
        TrainArgs(**{flag[2:].replace("-", "_"): math.inf})


def test_draft_refuses_non_finite_numbers():
    for name in ("lr", "eta", "eval_temperature"):
        with pytest.raises(ValueError, match="all finite"):
            DraftArgs(ckpt="x", **{name: math.inf})


def test_a_learning_rate_past_any_working_one_is_refused(capsys):
    """1e300 is finite but overflowed fp32 inside the optimizer step (a traceback at step 1)."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--lr", "1e300"])
    assert exit_.value.code == 2
    assert "argument --lr: must be greater than 0 and at most 100, got 1e+300" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--lr must be in \(0, 100\]"):
        DraftArgs(ckpt="x", lr=1e300)


# ---- 4. --resume ------------------------------------------------------------------------------------------------

def test_resume_takes_a_run_directory_as_its_latest_checkpoint(run, monkeypatch):
    monkeypatch.setenv("OPENK3_CACHE", str(run.parent / "cache"))
    with one_thread():
        trainer = Trainer(tiny_args(run, run.parent / "data", resume=str(run), max_steps=STEPS + 1))
    assert trainer.args.resume == str(run / f"step-{STEPS:06d}") and trainer.step == STEPS


@pytest.mark.parametrize("resume, changes, refusal", [
    ("metrics.jsonl", {}, "--resume .*metrics.jsonl is a file, not a checkpoint or run directory"),
    ("missing", {}, "--resume .*missing does not exist"),
    ("step-000001", {"optimizer": "adamw"}, "--optimizer adamw: checkpoint .* was trained with --optimizer muon"),
    ("step-000002", {"max_steps": 2}, "--max-steps 2 is not past the checkpoint's step 2"),
    ("step-000002", {"max_steps": None}, "its run ended at step 2; pass --max-steps above 2"),
])
def test_resume_refuses_what_it_cannot_continue_before_touching_out(run, resume, changes, refusal):
    before = snapshot(run)
    with pytest.raises((ValueError, OSError), match=refusal):
        Trainer(tiny_args(run, run.parent / "data", resume=str(run / resume), **{"max_steps": 3, **changes}))
    assert snapshot(run) == before


# ---- 5. Ctrl-C --------------------------------------------------------------------------------------------------

def test_ctrl_c_ends_a_run_with_one_line_naming_its_last_checkpoint(run, tmp_path):
    out = tmp_path / "stopped"
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from openk3.cli import main; sys.exit(main(sys.argv[1:]))")
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    argv = ["train", "--config", str(config), "--data", str(run.parent / "data"), "--out", str(out), "--seq-len",
            "32", "--batch-size", "2", "--max-steps", "100000", "--save-every", "1", "--eval-every", "0",
            "--threads", "1", "--no-progress"]
    env = {**os.environ, "OPENK3_CACHE": str(run.parent / "cache")}
    process = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    deadline = time.monotonic() + 60
    while not (out / "step-000001" / "manifest.json").exists() and process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    last = latest_checkpoint(out)
    assert process.returncode == 130, err
    assert "Traceback" not in err and re.fullmatch(
        rf"openk3 train: interrupted at step \d+; the last checkpoint is {re.escape(str(last))} \(resume with "
        rf"--resume {re.escape(str(last))}\)", err.strip().splitlines()[-1])
    verify_checkpoint(last)


def test_ctrl_c_waits_for_a_checkpoint_to_be_renamed_into_place(tmp_path, monkeypatch):
    """An interrupt between the renames that swap a re-saved step in would leave no step there: it is held."""
    final, tmp = tmp_path / "step-000001", tmp_path / ".step-000001.tmp"
    for directory, name in ((final, "old"), (tmp, "new")):
        directory.mkdir()
        (directory / name).write_text(name)
    replace = os.replace

    def replace_then_interrupt(src, dst):
        replace(src, dst)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            publish(tmp, final)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000001"] and (final / "new").is_file()


# ---- 6, 7. draft windows and empty data -------------------------------------------------------------------------

def test_draft_seq_len_has_a_working_minimum_and_the_models_maximum(run, tmp_path):
    with pytest.raises(ValueError, match="--seq-len must be at least 2, got 1"):
        DraftArgs(ckpt="x", seq_len=1)
    with pytest.raises(ValueError, match="--seq-len 2 must be at least --draft-tokens 3"):
        DraftArgs(ckpt="x", seq_len=2)
    with pytest.raises(ValueError, match="--seq-len 99999 exceeds the model's max_seq_len"):
        train_draft(draft_args(run, tmp_path / "d", seq_len=99999))
    small = tmp_path / "small.txt"
    small.write_text("def f():\n    return 1\n")
    with pytest.raises(ValueError, match="windows at --seq-len 32, fewer than --batch-size 2"):
        train_draft(draft_args(run, tmp_path / "d", seq_len=32, data=str(small)))
    assert not (tmp_path / "d").exists()


def test_data_without_text_is_named_as_such(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_text("\n")
    for name in ("empty.txt", "blank.jsonl", "dir"):
        with pytest.raises(ValueError, match=f"--data .*{name} holds no text"):
            load_documents(tmp_path / name)
    with pytest.raises(ValueError, match="2 training tokens give 0 windows at --seq-len 32"):
        BatchStream(torch.zeros(2, dtype=torch.long), 32, 2, 0)


# ---- 8, 9. device, KDA backend, host memory ---------------------------------------------------------------------

def test_devices_this_run_cannot_use_are_refused_naming_the_flag(monkeypatch):
    with pytest.raises(ValueError, match="--device tpu: openk3 trains on cpu or cuda"):
        preflight.checked_device("tpu")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.raises(ValueError, match="--device cuda: this torch build has no CUDA"):
        preflight.checked_device("cuda")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="--device cuda:1: no CUDA device is visible"):
        preflight.checked_device("cuda:1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--kda-backend triton needs a CUDA device"):
        preflight.check_kda_backend("triton", torch.device("cpu"))


def test_train_refuses_a_bad_device_and_a_model_too_big_for_the_host_before_writing(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--device tpu"):
        Trainer(TrainArgs(out=str(tmp_path / "a"), device="tpu"))
    monkeypatch.setattr(preflight, "available_memory", lambda: 64 << 30)
    with pytest.raises(ValueError, match=r"--preset kimi-linear-48b: training its .*B parameters on the CPU needs "
                                         r"at least .* GiB .*, 64.0 GiB is available"):
        Trainer(TrainArgs(preset="kimi-linear-48b", out=str(tmp_path / "b"), device="cpu"))
    assert list(tmp_path.iterdir()) == []
