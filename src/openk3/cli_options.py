"""Options shared by the commands that build a model, with defaults from the environment, and argparse types.

The CLI is the only place the KDA environment variables are read (model/ and ops/ take explicit arguments):
OPENK3_KDA_BACKEND (auto | recurrent | chunked | triton) is the default of --kda-backend.
"""

from __future__ import annotations

import argparse
import os
import sys

from openk3.ops.kda import BACKENDS


def add_kda_options(parser: argparse.ArgumentParser) -> None:
    backend = os.environ.get("OPENK3_KDA_BACKEND", "auto")
    if backend not in BACKENDS:
        print(f"openk3: error: OPENK3_KDA_BACKEND must be one of {', '.join(BACKENDS)}, got {backend!r}",
              file=sys.stderr)
        raise SystemExit(2)
    parser.add_argument("--kda-backend", default=backend, choices=BACKENDS,
                        help="KDA implementation: auto = Triton kernels on CUDA, the chunked form on CPU (the "
                             "recurrence for single tokens); $OPENK3_KDA_BACKEND sets the default "
                             "(default: %(default)s)")


def int_at_least(low: int):
    """An argparse `type`: an integer >= low (argparse names the flag in the error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse
