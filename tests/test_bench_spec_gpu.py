"""bench/spec_gpu.py: --smoke trains k3-tiny and two drafts on the CPU and measures them end to end (the recipe's
subprocesses, the in-place draft swap, K fixed and auto, acceptance by context with the prefix cache on and off);
without CUDA and without --smoke it stops with one line."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "spec_gpu.py"
ROW_KEYS = {"clients", "temperature", "loss", "k", "tok_per_s", "spec_tok_per_s", "speedup", "accepted_per_verify"}


def run_script(*args, timeout=120):
    # as CI's command runs: torch paths (under TRITON_INTERPRET=1 the target's Muon steps run interpreted Triton)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT / "src"), os.environ.get("PYTHONPATH"))))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec_gpu")
    out = tmp / "spec.json"
    proc = run_script("--smoke", "--losses", "lk", "kl", "--clients", "2", "--workdir", str(tmp / "runs"),
                      "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.stdout, tmp


def test_smoke_rows(smoke):
    result, stdout, _ = smoke
    rows = result["rows"]
    assert {(r["loss"], r["k"], r["temperature"]) for r in rows} == {
        (loss, k, t) for loss in ("lk", "kl") for k in (3, "auto") for t in (0.0, 1.0)}
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["clients"] == 2 and r["tok_per_s"] > 0 and r["spec_tok_per_s"] > 0
        assert math.isclose(r["speedup"], r["spec_tok_per_s"] / r["tok_per_s"])
        if r["k"] == 3:  # every step a round: verifications happened, each accepting 0 to K drafts
            assert 0.0 <= r["accepted_per_verify"] <= 3.0
    assert len(result["auto_steps"]) == 4  # the auto rows: each step a round of K = 3 or a plain step
    for choice in result["auto_steps"]:
        assert set(choice["steps_by_k"]) <= {"0", "3"} and sum(choice["steps_by_k"].values()) > 0
    assert "| loss | k | clients |" in stdout


def test_smoke_recipe_and_context(smoke):
    result, stdout, tmp = smoke
    recipe = result["recipe"]
    assert math.isfinite(recipe["target"]["heldout_loss"])
    assert set(recipe["drafts"]) == {"lk", "kl"}
    assert all(math.isfinite(d["train_loss"]) for d in recipe["drafts"].values())
    logs = [(tmp / "runs" / name).read_text().splitlines() for name in ("recipe.log", "draft-lk.log", "draft-kl.log")]
    assert [sum(line.startswith("$ ") for line in log) for log in logs] == [1, 1, 1]  # one train, two drafts
    ctx = result["acceptance_by_context"]
    assert ctx["loss"] == "lk"
    assert ctx["cache_on"]["hit_tokens"] > 0 and ctx["cache_off"]["hit_tokens"] == 0  # later turns hit earlier ones
    for side in ("cache_on", "cache_off"):
        short = ctx[side]["buckets"]["0-16k"]
        assert short["verifications"] > 0 and 0.0 <= short["accepted_per_verify"] <= 3.0
    assert ctx["turns"] > 1 and 0.0 <= ctx["same_replies"] <= 1.0
    assert "acceptance by context" in stdout


def test_reuses_given_runs(smoke, tmp_path):
    """--target / --drafts skip the recipe (no new log), --train-only measures nothing, and --update keeps what an
    earlier run wrote."""
    first, _, tmp = smoke
    runs = tmp / "runs"
    out = tmp_path / "again.json"
    out.write_text(json.dumps({"rows": first["rows"], "recipe": None}))
    proc = run_script("--smoke", "--train-only", "--update", "--drafts", str(runs / "draft-kl"),
                      "--workdir", str(tmp_path / "w"), "--json", str(out))  # the target: the drafts' own
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["recipe"]["drafts"]) == {"kl"} and result["rows"] == first["rows"]
    assert result["recipe"]["target"] == first["recipe"]["target"]
    assert "acceptance_by_context" not in result
    assert not (tmp_path / "w" / "recipe.log").exists()


def test_needs_cuda_without_smoke():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = run_script("--json", os.devnull, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "bench/spec_gpu.py: needs a CUDA GPU (torch sees none); --smoke runs it on the CPU"]
