"""Shared by the benchmark tests: a bench/ script run end to end as its own process."""

import json
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
