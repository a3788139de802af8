"""The `openk3` command line.

Each subcommand lives in its own module and registers itself with one function, `add_<name>_parser(subparsers)`,
which adds its argparse parser and sets `func` (args -> exit code). To add a command, append its
(module, function) to COMMANDS. Keep module-level imports of command modules light; import heavy things inside
the command's function. A bad option (argparse) and a ValueError or FileNotFoundError from a command (an impossible
config, a bad input or path) end it with a one-line error and exit code 2; set OPENK3_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module
from typing import NoReturn

COMMANDS: list[tuple[str, str]] = [
    ("openk3.info", "add_info_parser"),
    ("openk3.train.command", "add_train_parser"),
    ("openk3.generate", "add_generate_parser"),
    ("openk3.export", "add_export_parser"),
    ("openk3.serve.command", "add_serve_parser"),
    ("openk3.train.draft_command", "add_draft_parser"),
]


class CommandParser(argparse.ArgumentParser):
    """A command's parser: a bad or missing option is one line naming it (the usage block is what --help shows)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openk3", description="The Kimi K3 system in Python.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=CommandParser)
    for module, register in COMMANDS:
        getattr(import_module(module), register)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:  # bad configs, inputs and paths: the message names the field
        if os.environ.get("OPENK3_DEBUG"):
            raise
        print(f"openk3 {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
