"""bench/sass_loops.py compiles the MXFP4 expert kernels for sm_90 on a machine without a GPU (ptxas and cuobjdump
ship with Triton) and counts their main loops: every tile (PTX decode, its Triton twin, tl.dot_scaled) and the row
kernel (PTX, Triton), and the PTX decode takes fewer instructions a weight than its Triton twin."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_sass_loops_counts_every_kernel_and_the_ptx_decode_is_shorter(tmp_path):
    out = tmp_path / "sass_loops.json"
    run = subprocess.run([sys.executable, str(BENCH / "sass_loops.py"), "--out", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {(r["kernel"], r["tile"], r["decode"]): r for r in result["rows"]}
    assert result["target"] == "sm_90" and len(rows) == len(result["rows"]) == 14
    assert {tile for kernel, tile, _ in rows if kernel == "mxfp4 tiles"} == {"16 rows", "32 rows", "64 rows",
                                                                             "128 rows"}
    decodes = {kernel: {d for k, _, d in rows if k == kernel} for kernel, _, _ in rows}
    assert decodes == {"mxfp4 tiles": {"PTX", "Triton", "tl.dot_scaled"}, "mxfp4 rows": {"PTX", "Triton"}}
    for (kernel, tile, decode), row in rows.items():
        assert row["registers"] > 0 and row["loop_instructions"] > 0 and f"| {kernel} | {tile} | {decode} |" in \
            run.stdout
        if decode == "PTX":
            assert row["per_weight"] < rows[kernel, tile, "Triton"]["per_weight"], (kernel, tile)
