"""`openk3 info`: K3's parameter counts land on the published 2.8T / 104B, and --json parses."""

import json

import pytest

from openk3.accounting import cache_bytes, count_parameters
from openk3.cli import main
from openk3.config import get_preset


def test_k3_counts():
    c = count_parameters(get_preset("k3"))
    assert abs(c["total_params"] / 2.8e12 - 1) < 0.02, c["total_params"]
    assert abs(c["active_params"] / 104e9 - 1) < 0.03, c["active_params"]
    b = c["breakdown"]
    assert sum(b.values()) == c["total_params"]
    # one expert is 3 x 3584 x 3072; 896 of them over 92 MoE layers
    assert b["moe_experts"] == 92 * 896 * 3 * 3584 * 3072
    assert b["embeddings"] == b["lm_head"] == 163840 * 7168
    assert c["mtp_params"] > 0


def test_k3_cache_bytes():
    c = cache_bytes(get_preset("k3"))
    assert c["mla_bytes_per_token"] == 24 * (512 + 64) * 2
    assert c["kda_recurrent_bytes_per_sequence"] == 69 * 96 * 128 * 128 * 4
    assert c["bytes_per_sequence_at_context"] == c["kda_bytes_per_sequence"] + (1 << 20) * c["mla_bytes_per_token"]


def test_cli_json(capsys):
    assert main(["info", "--preset", "k3", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    rep = json.loads(out[-1])
    assert rep["total_params"] == count_parameters(get_preset("k3"))["total_params"]
    assert rep["active_params"] < rep["total_params"]
    assert "total parameters" in out[1]
    # MXFP4 expert bytes = the released shards' per-expert tensors (SPEC §13): w1, w3 packed [3072, 1792] + scale
    # [3072, 112], w2 packed [3584, 1536] + scale [3584, 96], for 896 experts in 92 layers
    per_expert = 2 * (3072 * 1792 + 3072 * 112) + 3584 * 1536 + 3584 * 96
    assert rep["moe_expert_bytes"] == {"mxfp4": 92 * 896 * per_expert, "bf16": 92 * 896 * 3 * 3584 * 3072 * 2}
    assert "in MXFP4" in "\n".join(out)


def test_cli_text_and_unknown_preset(capsys):
    assert main(["info", "--preset", "k3-tiny"]) == 0
    assert "active parameters" in capsys.readouterr().out
    assert main(["info", "--preset", "k9"]) == 2
    assert "unknown preset 'k9'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])


@pytest.mark.parametrize("preset", ["k3-tiny", "k3-tiny-vl"])
def test_the_counts_cover_every_parameter_once_and_train_states_the_same(preset, capsys):
    """Language model + MTP + vision is every parameter of the built model (tied weights once); `openk3 train`
    announces the same numbers as `openk3 info` prints (openk3.accounting is the one definition)."""
    from openk3.accounting import parameter_summary, short_count
    from openk3.model import K3ForCausalLM

    cfg = get_preset(preset)
    counts = count_parameters(cfg)
    built = sum(p.numel() for p in K3ForCausalLM(cfg).parameters())
    assert counts["total_params"] + counts["mtp_params"] + counts["vision_params"] == built
    summary = parameter_summary(counts)
    assert summary.startswith(f"{short_count(counts['total_params'])} parameters + "
                              f"{short_count(counts['mtp_params'])} MTP")
    assert ("vision" in summary) == (counts["vision_params"] > 0)
    assert main(["info", "--preset", preset]) == 0
    assert f"total parameters   {short_count(counts['total_params']):>10}" in capsys.readouterr().out
