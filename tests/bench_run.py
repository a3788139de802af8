"""Shared by the benchmark tests: a bench/ script run end to end as its own process."""

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def run_bench(script: str, *args: str, out: Path, env: dict | None = None) -> tuple[dict, str]:
    """`python bench/SCRIPT ARGS --json OUT`, which must succeed: (the JSON it wrote, its stdout)."""
    run = subprocess.run([sys.executable, str(BENCH_DIR / script), *args, "--json", str(out)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


def assert_cpu_run_names_the_interpreter(script: str) -> None:
    """`python bench/SCRIPT --device cpu --tiny` without TRITON_INTERPRET=1: exit 2, one line saying how to run it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(BENCH_DIR / script), "--device", "cpu", "--tiny"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert f"run it as TRITON_INTERPRET=1 python bench/{script} --device cpu --tiny" in run.stderr
