"""The KDA options every model-building command takes, and the environment variables that set their defaults."""

import pytest

from openk3.cli import build_parser


@pytest.mark.parametrize("command", [["train"], ["generate", "--ckpt", "x", "--prompt", "p"], ["serve"]])
def test_kda_options_default_from_the_environment(command, monkeypatch):
    monkeypatch.delenv("OPENK3_KDA_BACKEND", raising=False)
    assert build_parser().parse_args(command).kda_backend == "auto"
    assert build_parser().parse_args([*command, "--kda-backend", "chunked"]).kda_backend == "chunked"
    monkeypatch.setenv("OPENK3_KDA_BACKEND", "recurrent")
    assert build_parser().parse_args(command).kda_backend == "recurrent"


def test_bad_backend_in_the_environment_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("OPENK3_KDA_BACKEND", "cuda")
    with pytest.raises(SystemExit) as exit_info:
        build_parser()
    assert exit_info.value.code == 2
    assert "OPENK3_KDA_BACKEND must be one of" in capsys.readouterr().err
