"""Where the benchmarks write their JSON unless told (`--json` / `--out`)."""

from __future__ import annotations

import os
import tempfile

BENCH = os.path.dirname(os.path.abspath(__file__))


def default_json(name: str, smoke: bool = False) -> str:
    """$OUT/NAME where the device tool sets $OUT (what is written there comes back), else bench/NAME beside the
    committed figures; a --smoke run's toy CPU figures in the temp directory instead, never over the GPU's."""
    return os.path.join(os.environ.get("OUT") or (tempfile.gettempdir() if smoke else BENCH), name)
