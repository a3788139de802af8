"""`openk3 train --compile`: a compiler failure at a step falls back to eager training with one line, and the run
trains exactly as an eager one (the failed call leaves nothing behind)."""

import json

import pytest
import torch

import openk3.train.loop as loop
from openk3.cli import main
from openk3.model.compile import compile_blocks
from train_tiny import TINY, make_corpus, one_thread


def refusing_backend(graph_module, example_inputs):
    raise RuntimeError("this backend refuses every graph")


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.fixture
def train_tiny_twice(tmp_path, monkeypatch):
    """A call running `openk3 train` on the tiny config and corpus eagerly, then compiled with `backend`, each for
    `steps` steps with a sample of `sample_tokens`, yielding (name, its --out directory) after each run."""
    data = make_corpus(tmp_path / "data")
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))

    def runs(backend, steps: int, sample_tokens: int):
        monkeypatch.setattr(loop, "compile_blocks", lambda model: compile_blocks(model, backend=backend))
        for name, flag in (("eager", "--no-compile"), ("compiled", "--compile")):
            out = tmp_path / name
            argv = ["train", "--config", str(config), "--data", str(data), "--max-steps", str(steps), "--seq-len",
                    "32", "--batch-size", "2", "--out", str(out), "--eval-every", "0", "--no-progress",
                    "--sample-tokens", str(sample_tokens), flag]
            torch._dynamo.reset()
            with one_thread():
                assert main(argv) == 0
            yield name, out

    return runs


def test_a_failed_compile_trains_on_eagerly_with_the_eager_losses(train_tiny_twice, capsys):
    runs = {}
    for name, out in train_tiny_twice(refusing_backend, steps=3, sample_tokens=0):
        runs[name] = out
        said = capsys.readouterr().out
        assert ("compiling the training step failed, training eagerly" in said) == (name == "compiled")
    assert "this backend refuses every graph" in said
    eager, compiled = losses(runs["eager"]), losses(runs["compiled"])
    assert len(eager) == 3
    assert compiled == eager


def test_the_closing_sample_decodes_through_the_uncompiled_blocks(train_tiny_twice, monkeypatch):
    """The text sample after training decodes token by token with a cache: through the blocks compiled for
    training it would recompile them at every new cache shape, so the compiled run uncompiles them first (once,
    not on failure) and writes the eager run's sample."""
    uncompiled = []
    monkeypatch.setattr(loop, "uncompile_blocks", lambda model: uncompiled.append(model) or model)
    samples = {}
    for name, out in train_tiny_twice("eager", steps=2, sample_tokens=6):
        samples[name] = (out / "sample.txt").read_text()
        assert len(uncompiled) == (name == "compiled")
    assert samples["compiled"] == samples["eager"]
