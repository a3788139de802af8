"""bench/mxfp4_experts.py's CPU smoke run (--device cpu --tiny, the kernels under TRITON_INTERPRET=1): every
format runs the batch, the PTX-decode rows and their Triton-twin peers among them, each within 2e-2 (relative
norm) of the bf16 experts holding the dequantized values: both round intermediates to bf16, at different points
(1.0e-2 measured, as before the pair decode). No timings worth reading on a CPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

from bench_run import assert_cpu_run_names_the_interpreter

BENCH = Path(__file__).resolve().parents[1] / "bench"
FORMATS = {"bf16", "mxfp4", "mxfp4-rows", "mxfp4-tiles", "mxfp4-scaled", "mxfp4-expand", "mxfp4-rows-triton",
           "mxfp4-tiles-triton", "mxfp4-tiles-no-gluon"}


def test_every_format_runs_and_matches_the_bf16_experts():
    run = subprocess.run([sys.executable, str(BENCH / "mxfp4_experts.py"), "--device", "cpu", "--tiny", "--batches",
                          "5"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = re.findall(r"^(\S+)\s+tokens\s+5\s.*rel err (\S+)$", run.stdout, flags=re.M)
    assert {name for name, _ in rows} == FORMATS and len(rows) == len(FORMATS), run.stdout
    assert all(float(err) < 2e-2 for _, err in rows), rows


def test_the_cpu_run_without_the_interpreter_is_one_line_naming_it():
    assert_cpu_run_names_the_interpreter("mxfp4_experts.py")
