"""`openk3`'s entry point: what a user sees for an unknown flag, a command's bad input and Ctrl-C."""

import pytest

from openk3 import cli
from openk3.checkpoints import CheckpointError


def test_an_unknown_flag_is_named_with_its_command_and_the_nearest_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--steps", "5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("openk3 train: error: unrecognized arguments: --steps (did you mean --max-steps?) 5")
    with pytest.raises(SystemExit):
        cli.main(["info", "--preset", "k3-tiny", "stray"])
    assert "openk3 info: error: unrecognized arguments: stray (see openk3 info --help)" in capsys.readouterr().err


@pytest.mark.parametrize("error, code", [
    (ValueError("--lr must be finite"), 2), (FileNotFoundError("no such run: runs/x"), 2),
    (PermissionError("runs/x is not writable"), 2), (CheckpointError("step-000003 is incomplete"), 2),
    (FloatingPointError("loss became nan at step 2; lower --lr"), 2), (KeyboardInterrupt(), 130),
])
def test_a_commands_bad_input_is_one_line_and_an_exit_code(error, code, monkeypatch, capsys):
    def failing(args):
        raise error

    real = cli.build_parser

    def parser_with_failing_info():
        parser = real()
        parser._subparsers._group_actions[0].choices["info"].set_defaults(func=failing)
        return parser

    monkeypatch.setattr(cli, "build_parser", parser_with_failing_info)
    monkeypatch.delenv("OPENK3_DEBUG", raising=False)
    assert cli.main(["info"]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err == (f"openk3 info: error: {error}\n" if code == 2 else "openk3 info: interrupted\n")
    monkeypatch.setenv("OPENK3_DEBUG", "1")
    with pytest.raises(type(error)):
        cli.main(["info"])
