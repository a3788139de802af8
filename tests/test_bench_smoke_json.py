"""The GPU benchmarks' --smoke runs (toy sizes on the CPU) write their JSON to the temp directory unless told
where, never over the committed GPU figures in bench/ (train.py gpu --smoke writes none: tests/test_bench_train.py)."""

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # serve_gpu imports bench/serve_load.py
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (dataclasses look their module up while it runs)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["engine_mixed", "serve_gpu", "serve_48b", "spec_gpu", "fsdp_scaling", "parallel"])
def test_every_gpu_benchmark_takes_the_shared_default(monkeypatch, script):
    module = bench_module(script, monkeypatch)
    import common  # bench/common.py, as the scripts import it

    assert module.default_json is common.default_json


def test_a_smoke_run_writes_its_json_outside_bench(monkeypatch):
    """Without $OUT: a --smoke run's JSON in the temp directory, a real run's in bench/; with it, both there."""
    monkeypatch.delenv("OUT", raising=False)
    default_json = bench_module("common", monkeypatch).default_json
    assert Path(default_json("x.json", smoke=True)) == Path(tempfile.gettempdir()) / "x.json"
    assert Path(default_json("x.json")) == BENCH / "x.json"
    monkeypatch.setenv("OUT", "/out")
    assert default_json("x.json", smoke=True) == default_json("x.json") == "/out/x.json"
