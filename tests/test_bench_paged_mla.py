"""bench/paged_mla.py's CPU smoke run (--device cpu --tiny, the kernel under TRITON_INTERPRET=1): every row runs,
the sequence-row form and the one-row-per-query form agree (the script checks it before timing), the JSON holds
each row with its peer. No timings worth reading on a CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

from bench_run import assert_cpu_run_names_the_interpreter

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_every_row_runs_and_is_checked_against_its_peer(tmp_path):
    out = tmp_path / "paged_mla.json"
    run = subprocess.run([sys.executable, str(BENCH / "paged_mla.py"), "--device", "cpu", "--tiny", "--json",
                          str(out)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["preset"] == "k3-tiny"
    cases = [row["case"].split(",")[0] for row in result["rows"]]
    assert cases == ["decode", "verify T=4", "short prefill T=16 (5 real)"]
    for row in result["rows"]:
        assert row["ms"] > 0 and row["peer_ms"] > 0 and row["speedup"] == row["peer_ms"] / row["ms"]
        assert row["case"] in run.stdout


def test_the_cpu_run_without_the_interpreter_is_one_line_naming_it():
    assert_cpu_run_names_the_interpreter("paged_mla.py")
