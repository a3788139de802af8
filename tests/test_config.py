"""Config validation errors name the field and the allowed values; presets follow SPEC §1."""

import pytest

from openk3.config import ModelConfig, get_preset


def check(match, **fields):
    base = get_preset("k3-tiny").to_dict()
    for key, value in fields.items():
        if "__" in key:
            sec, sub = key.split("__")
            base[sec] = {**base[sec], sub: value}
        else:
            base[key] = value
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(base)


def test_heads_must_divide_hidden():
    base = get_preset("k3-tiny").to_dict()
    with pytest.raises(ValueError, match=r"'kda.num_heads'.*divisor of hidden_size=128"):
        ModelConfig.from_dict({**base, "kda": {**base["kda"], "num_heads": 3, "head_dim": None}})
    ModelConfig.from_dict({**base, "kda": {**base["kda"], "num_heads": 3, "head_dim": 32}})  # explicit head_dim


def test_top_k_not_above_experts():
    check(r"'moe.top_k'.*\[1, num_experts=8\]", moe__top_k=9)
    check(r"'moe.top_k'", moe__top_k=0)


@pytest.mark.parametrize("bound", [-5.5, 0.0, 0.5])
def test_lower_bound_range(bound):
    check(r"'kda.gate_lower_bound'.*\[-5, 0\)", kda__gate_lower_bound=bound)


def test_lower_bound_edges_ok():
    for ok in (-5.0, -1e-3):
        ModelConfig.from_dict({**get_preset("k3-tiny").to_dict(), "kda": {"gate_lower_bound": ok}})


def test_mla_layer_out_of_range():
    check(r"'mla_layers'.*\[0, 7\]", mla_layers=[3, 8])
    check(r"'mla_layers'", mla_layers=[-1])
    check(r"'mla_layers'.*distinct", mla_layers=[3, 3])


def test_other_fields():
    check(r"'kda.gate'.*one of", kda__gate="nope")
    check(r"'activation'", activation="gelu")
    check(r"'moe.latent_dim'", moe__latent_dim=1000)
    check(r"'mla.norm_eps'", mla__norm_eps=0.0)
    check(r"'first_k_dense'", first_k_dense=99)


def test_unknown_preset_and_fields():
    with pytest.raises(ValueError, match=r"unknown preset 'k4'.*k3-tiny"):
        get_preset("k4")
    with pytest.raises(ValueError, match="unknown config field"):
        ModelConfig.from_dict({"hidden_sise": 3})
    with pytest.raises(ValueError, match=r"kda\.heads"):
        ModelConfig.from_dict({"kda": {"heads": 3}})


def test_roundtrip_and_k3_topology():
    for name in ("k3", "k3-debug", "k3-tiny", "kimi-linear-48b"):
        cfg = get_preset(name)
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    k3 = get_preset("k3")
    assert k3.num_layers == 93 and len(k3.mla_layers) == 24 and len(k3.kda_layers) == 69
    assert k3.layer_kind(3) == "mla" and k3.layer_kind(91) == "mla" and k3.layer_kind(92) == "mla"
    assert k3.layer_kind(90) == "kda" and k3.ffn_kind(0) == "dense" and k3.ffn_kind(1) == "moe"


def test_cli_reports_an_impossible_config_in_one_line(tmp_path, capsys):
    """A bad --config ends `openk3 train` with exit code 2 and a message naming the field, before any work."""
    from openk3.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text('{"moe": {"top_k": 99}}')
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "openk3 train: error:" in err and "moe.top_k" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("step-*"))
