"""bench/sampling.py's CPU smoke run (--device cpu --tiny, the kernels under TRITON_INTERPRET=1): every case runs
at each batch and the radix-selection kernel draws the sort's tokens. No timings worth reading on a CPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

from bench_run import assert_cpu_run_names_the_interpreter

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_every_case_runs_and_the_kernel_draws_the_sorts_tokens():
    run = subprocess.run([sys.executable, str(BENCH / "sampling.py"), "--device", "cpu", "--tiny"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = re.findall(r"^\| 300 \| (\d+) \|(?: [\d,.]+ \|){4} (\d+)/(\d+) \|$", run.stdout, flags=re.M)
    assert [batch for batch, _, _ in rows] == ["1", "3"], run.stdout
    assert all(same == total for _, same, total in rows), run.stdout


def test_the_cpu_run_without_the_interpreter_is_one_line_naming_it():
    assert_cpu_run_names_the_interpreter("sampling.py")
