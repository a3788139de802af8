"""What the benchmark scripts share: where they write their JSON unless told (`--json` / `--out`), and the check
that a `--device cpu` run has Triton's interpreter."""

from __future__ import annotations

import os
import tempfile

BENCH = os.path.dirname(os.path.abspath(__file__))


def default_json(name: str, smoke: bool = False) -> str:
    """$OUT/NAME where the device tool sets $OUT (what is written there comes back), else bench/NAME beside the
    committed figures; a --smoke run's toy CPU figures in the temp directory instead, never over the GPU's."""
    return os.path.join(os.environ.get("OUT") or (tempfile.gettempdir() if smoke else BENCH), name)


def require_interpreter(parser, device: str, script: str) -> None:
    """`--device cpu` runs the Triton kernels under the interpreter (Triton has no CPU driver): without
    TRITON_INTERPRET=1, the parser's one-line error saying how to run bench/SCRIPT."""
    if device.split(":")[0] == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs the kernels under Triton's interpreter (Triton has no CPU driver): run it as "
                     f"TRITON_INTERPRET=1 python bench/{script} --device cpu --tiny")
