"""The `openk3` command line.

Each subcommand lives in its own module and registers itself with one function, `add_<name>_parser(subparsers)`,
which adds its argparse parser and sets `func` (args -> exit code). To add a command, append its
(module, function) to COMMANDS. Keep module-level imports of command modules light; import heavy things inside
the command's function. A bad or unknown option (argparse, named with the command and the nearest real flag) and
what a command raises for bad input end it with a one-line error and exit code 2: a ValueError (an impossible
config, a bad input), an OSError (a path that is missing, not writable or of the wrong kind), a CheckpointError (a
checkpoint that is incomplete or does not match) or a FloatingPointError (a run that diverged); Ctrl-C ends it with
exit code 130. Set OPENK3_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import argparse
import difflib
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


    def refuse_unknown(self, extras: list[str]) -> NoReturn:
        """Options this command does not have, each with the nearest flag it does have, if one is close."""
        flags = [flag for action in self._actions for flag in action.option_strings]
        named = []
        for extra in extras:
            near = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=1, cutoff=0.6)
            named.append(f"{extra} (did you mean {near[0]}?)" if near and extra.startswith("-") else extra)
        self.error(f"unrecognized arguments: {' '.join(named)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openk3", description="The Kimi K3 system in Python.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=CommandParser)
    for module, register in COMMANDS:
        getattr(import_module(module), register)(sub)
    for command_parser in sub.choices.values():
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, extras = build_parser().parse_known_args(argv)
    command_parser = vars(args).pop("command_parser")  # not an option: the args go on (pickled, to `serve`'s engine)
    if extras:  # named by the command's parser, not the top-level one (whose usage lists only the commands)
        command_parser.refuse_unknown(extras)
    from openk3.checkpoints import INPUT_ERRORS

    try:
        return int(args.func(args) or 0)
    except INPUT_ERRORS as err:  # the message names the field
        if os.environ.get("OPENK3_DEBUG"):
            raise
        print(f"openk3 {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if os.environ.get("OPENK3_DEBUG"):
            raise
        print(f"openk3 {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
