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


@pytest.mark.parametrize("script, args, name", [
    ("engine_mixed", (), "engine_mixed.json"),
    ("serve_gpu", ("serve_gpu.json",), "serve_gpu.json"),
    ("serve_gpu", ("serve_48b.json",), "serve_48b.json"),  # serve_48b.py's default, from serve_gpu
    ("spec_gpu", (), "spec_gpu.json"),
    ("fsdp_scaling", (), "train_gpu.json"),
    ("parallel", ("parallel.json",), "parallel.json"),
])
def test_a_smoke_run_writes_its_json_outside_bench(monkeypatch, script, args, name):
    monkeypatch.delenv("OUT", raising=False)
    default_json = bench_module(script, monkeypatch).default_json
    smoke, gpu = Path(default_json(*args, True)), Path(default_json(*args, False))
    assert smoke == Path(tempfile.gettempdir()) / name
    assert gpu.name == name and gpu.parent.name == "bench"
