"""The KDA options every model-building command takes, and the environment variables that set their defaults."""

import pytest

from openk3.cli import build_parser


@pytest.mark.parametrize("command", [["train"], ["generate", "--ckpt", "x", "--prompt", "p"], ["serve"]])
def test_kda_options_default_from_the_environment(command, monkeypatch):
    monkeypatch.delenv("OPENK3_KDA_BACKEND", raising=False)
    monkeypatch.delenv("OPENK3_KDA_OVERLAP", raising=False)
    args = build_parser().parse_args(command)
    assert (args.kda_backend, args.kda_overlap) == ("auto", True)
    args = build_parser().parse_args([*command, "--kda-backend", "chunked", "--no-kda-overlap"])
    assert (args.kda_backend, args.kda_overlap) == ("chunked", False)
    monkeypatch.setenv("OPENK3_KDA_BACKEND", "recurrent")
    monkeypatch.setenv("OPENK3_KDA_OVERLAP", "0")
    args = build_parser().parse_args(command)
    assert (args.kda_backend, args.kda_overlap) == ("recurrent", False)


def test_bad_backend_in_the_environment_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("OPENK3_KDA_BACKEND", "cuda")
    with pytest.raises(SystemExit) as exit_info:
        build_parser()
    assert exit_info.value.code == 2
    assert "OPENK3_KDA_BACKEND must be one of" in capsys.readouterr().err
