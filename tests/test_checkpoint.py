"""Training checkpoints: exact resume, a real SIGKILL during a save, and clear errors for bad checkpoints."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from openk3.checkpoints import CheckpointError, latest_checkpoint, sha256_file, verify_checkpoint
from openk3.config import get_preset
from openk3.train.checkpoint import load_checkpoint, remove_abandoned, save_checkpoint
from openk3.train.command import train
from openk3.train.loop import Trainer
from train_tiny import TINY, make_corpus, one_thread, tiny_args

STEPS, SAVE_AT = 6, 3
CFG = get_preset("k3-tiny").with_overrides(TINY)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One run of STEPS steps that also saves at SAVE_AT: the reference trajectory and its checkpoint."""
    root = tmp_path_factory.mktemp("ckpt")
    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.setenv("OPENK3_CACHE", str(root / "cache"))  # trained tokenizers stay inside the test's directory
        data = make_corpus(root / "data")
        out = root / "full"
        train(tiny_args(out, data, max_steps=STEPS, save_every=SAVE_AT))
        yield root, data, out


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_resume_reproduces_the_uninterrupted_run_exactly(uninterrupted):
    root, data, full = uninterrupted
    resumed = root / "resumed"
    trainer = Trainer(tiny_args(resumed, data, max_steps=STEPS, resume=str(full / f"step-{SAVE_AT:06d}")))
    assert trainer.step == SAVE_AT
    trainer.run()
    ref, got = _losses(full), _losses(resumed)
    assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1))
    for step in got:
        assert got[step] == ref[step], (step, got[step], ref[step])  # bit-exact on CPU
    a = load_checkpoint(full / f"step-{STEPS:06d}", CFG)
    b = load_checkpoint(resumed / f"step-{STEPS:06d}", CFG)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["trainer"]["balance_bias"].keys() == b["trainer"]["balance_bias"].keys()
    for layer, bias in a["trainer"]["balance_bias"].items():
        assert torch.equal(bias, b["trainer"]["balance_bias"][layer])


def test_checkpoint_holds_every_piece_of_state(uninterrupted):
    _, _, full = uninterrupted
    state = load_checkpoint(full / f"step-{SAVE_AT:06d}", CFG)
    trainer = state["trainer"]
    assert trainer["step"] == SAVE_AT
    assert {"data", "balance_bias", "schedule", "rng", "world_size", "args"} <= set(trainer)
    assert {"python", "numpy", "torch"} <= set(trainer["rng"][0])
    assert trainer["data"]["cursor"] == SAVE_AT * tiny_args(full, full).batch_size
    assert any(name.endswith("momentum_buffer") or "momentum_buffer" in v
               for name, v in state["optimizer"]["state"].items())
    biases = [b for b in trainer["balance_bias"].values()]
    assert biases and all(b.abs().sum() > 0 for b in biases)  # Quantile Balancing has moved them


def test_optimizer_and_trainer_state_hold_only_tensors_and_plain_types(uninterrupted):
    _, _, full = uninterrupted
    for name in ("optimizer.pt", "trainer.pt"):  # torch.load(weights_only=True) needs no allow-list for them
        assert torch.serialization.get_unsafe_globals_in_checkpoint(full / f"step-{SAVE_AT:06d}" / name) == []


def _rewrite_trainer_state(directory: Path, state: dict, format_version: int) -> None:
    """Replace trainer.pt and re-sign it in the manifest (as a writer of that format would have)."""
    torch.save(state, directory / "trainer.pt")
    manifest = json.loads((directory / "manifest.json").read_text())
    path = directory / "trainer.pt"
    manifest["files"]["trainer.pt"] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest["format_version"] = format_version
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _format_1_rng(rng: dict) -> dict:
    """An RNG entry as format 1 stored it: random.getstate() and np.random.get_state() as returned."""
    py, npy = rng["python"], rng["numpy"]
    return {**rng, "python": (py["version"], tuple(py["words"].tolist()), py["gauss"]),
            "numpy": (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                      npy["cached_gaussian"])}


def test_a_format_1_checkpoint_still_resumes_exactly(uninterrupted):
    root, data, full = uninterrupted
    old = root / "format-1"
    shutil.copytree(full / f"step-{SAVE_AT:06d}", old)
    trainer = torch.load(old / "trainer.pt", weights_only=True)
    _rewrite_trainer_state(old, {**trainer, "format_version": 1, "rng": [_format_1_rng(r) for r in trainer["rng"]]},
                           format_version=1)
    assert "numpy.ndarray" in torch.serialization.get_unsafe_globals_in_checkpoint(old / "trainer.pt")
    resumed = root / "resumed-from-format-1"
    Trainer(tiny_args(resumed, data, max_steps=STEPS, resume=str(old))).run()
    ref, got = _losses(full), _losses(resumed)
    assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1)) and all(got[s] == ref[s] for s in got)


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_trainer_state_with_pickled_code_is_refused_unrun(uninterrupted, tmp_path):
    _, _, full = uninterrupted
    bad, marker = tmp_path / "bad", tmp_path / "code-ran"
    shutil.copytree(full / f"step-{SAVE_AT:06d}", bad)
    trainer = torch.load(bad / "trainer.pt", weights_only=True)
    for version in (1, 2):
        _rewrite_trainer_state(bad, {**trainer, "data": _RunsCodeWhenUnpickled(marker)}, format_version=version)
        with pytest.raises(CheckpointError, match="trainer.pt holds objects that a safe load .* refuses"):
            load_checkpoint(bad, CFG)
        assert not marker.exists()


def test_corrupted_checkpoint_fails_with_a_clear_message(uninterrupted, tmp_path):
    _, _, full = uninterrupted
    bad = tmp_path / "bad"
    shutil.copytree(full / f"step-{SAVE_AT:06d}", bad)
    blob = bytearray((bad / "model.safetensors").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (bad / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="corrupted: model.safetensors does not match its sha256"):
        load_checkpoint(bad, CFG)
    (bad / "optimizer.pt").write_bytes(b"truncated")
    with pytest.raises(CheckpointError, match="corrupted: "):
        verify_checkpoint(bad)
    (bad / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete: no manifest.json"):
        load_checkpoint(bad, CFG)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing", CFG)


def test_mismatched_checkpoint_names_the_differing_fields(uninterrupted):
    _, _, full = uninterrupted
    other = CFG.with_overrides({"hidden_size": 48})
    with pytest.raises(CheckpointError, match="different model:\n  hidden_size: checkpoint 32, this run 48"):
        load_checkpoint(full / f"step-{SAVE_AT:06d}", other)


def test_resume_with_a_different_batch_size_is_refused(uninterrupted, tmp_path):
    _, data, full = uninterrupted
    with pytest.raises(ValueError, match="batch_size=4, this run has 2"):
        Trainer(tiny_args(tmp_path / "r", data, batch_size=2, resume=str(full / f"step-{SAVE_AT:06d}")))


KILL_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from openk3.config import get_preset
    from openk3.model import K3ForCausalLM
    from openk3.train import checkpoint as ckpt

    out, cfg_json = Path(sys.argv[1]), sys.argv[2]
    import json
    cfg = get_preset("k3-tiny").with_overrides(json.loads(cfg_json))
    model = K3ForCausalLM(cfg)
    tok = out / "tok.json"
    tok.write_text("{}")
    ckpt.save_checkpoint(out, 1, cfg, model.state_dict(), {"state": {}}, {"world_size": 1}, tok)
    real_fsync = ckpt.fsync_file

    def slow_fsync(path):  # the second save announces itself mid-write, then stalls until it is killed
        real_fsync(path)
        (out / "saving").write_text(str(path))
        time.sleep(60)

    ckpt.fsync_file = slow_fsync
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ckpt.save_checkpoint(out, 2, cfg, model.state_dict(), {"state": {}}, {"world_size": 1}, tok)
""")


def test_sigkill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(tmp_path), json.dumps(TINY)])
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "saving").exists():
            assert child.poll() is None, "the child exited before it began the second save"
            assert time.monotonic() < deadline, "the child never reached the second save"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not (tmp_path / "step-000002").exists()
    assert any(p.name.startswith(".step-000002.tmp") for p in tmp_path.iterdir())  # the abandoned write
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"
    state = load_checkpoint(tmp_path / "step-000001", CFG)
    assert state["trainer"]["step"] == 1 and "model.embed_tokens.weight" in state["model"]
    # the next save (here: the resumed run's) removes the dead process's temporary directory, a model's worth
    save_checkpoint(tmp_path, 2, CFG, state["model"], state["optimizer"], state["trainer"], tmp_path / "tok.json")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".step-")]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000002"


def test_a_step_moved_aside_stays_until_its_step_is_in_place_again(tmp_path):
    """Killed between publish's two renames, a step saved again exists only as its .old directory: the next save's
    clean-up keeps it; once the step is in place again, the .old copy goes."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited
    aside = tmp_path / f".step-000003.old-{pid}"
    (aside / "model").mkdir(parents=True)
    remove_abandoned(tmp_path)
    assert aside.is_dir()
    (tmp_path / "step-000003").mkdir()
    remove_abandoned(tmp_path)
    assert not aside.exists()
