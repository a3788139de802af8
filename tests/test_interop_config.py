"""config.json <-> ModelConfig: the presets survive both families, the published configs land on the presets."""

from __future__ import annotations

import json

import pytest

from openk3.config import PRESETS, get_preset
from openk3.interop import config_from_hub, config_from_json, config_from_k3, config_to_hub, config_to_k3


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_k3_config(name):
    cfg = get_preset(name)
    written = json.loads(json.dumps(config_to_k3(cfg)))  # through JSON, as on disk
    assert config_from_json(written) == (cfg, "k3")


def test_kimi_linear_preset_round_trips_through_hub_config():
    cfg = get_preset("kimi-linear-48b")
    back, layout = config_from_json(json.loads(json.dumps(config_to_hub(cfg))))
    assert layout == "hub" and back == cfg.with_overrides({"name": "kimi_linear"})


def moonshot_kimi_linear_config() -> dict:
    """Kimi-Linear-48B-A3B's config.json as Moonshot published it (1-based layer lists, no layer_types)."""
    full = [4, 8, 12, 16, 20, 24, 27]
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
        "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "hidden_act": "silu", "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446, "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-5,
        "model_max_length": 1048576, "tie_word_embeddings": False, "initializer_range": 0.02,
        "rope_theta": 10000.0, "rope_scaling": None, "bos_token_id": 163584, "eos_token_id": 163586,
        "pad_token_id": 163839, "dtype": "bfloat16",
        "linear_attn_config": {"full_attn_layers": full, "kda_layers": [i for i in range(1, 28) if i not in full],
                               "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
    }


def test_moonshot_kimi_linear_config_is_the_preset():
    cfg, layout = config_from_json(moonshot_kimi_linear_config())
    assert layout == "hub"
    assert cfg == get_preset("kimi-linear-48b").with_overrides({"name": cfg.name})


def test_released_k3_config_is_the_preset():
    """The keys SPEC §1 lists for the released config (text model under text_config) give the k3 preset; the
    released config says nothing about openk3-only settings, and MTP depth is left as read."""
    mla = [*range(3, 93, 4), 92]
    text = {
        "hidden_size": 7168, "num_hidden_layers": 93, "num_attention_heads": 96, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "mla_use_output_gate": True, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "num_experts": 896, "num_experts_per_token": 16,
        "num_shared_experts": 2, "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True, "first_k_dense_replace": 1, "attn_res_block_size": 12, "rms_norm_eps": 1e-5,
        "vocab_size": 163840, "intermediate_size": 33792, "max_position_embeddings": 1_048_576,
        "linear_attn_config": {"kda_layers": [i + 1 for i in range(93) if i not in mla],
                               "full_attn_layers": [i + 1 for i in mla], "head_dim": 128, "num_heads": 96,
                               "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
    }
    cfg, layout = config_from_json({"model_type": "kimi_k3", "text_config": text})
    assert layout == "k3"
    # no vision_config here: the text model alone (test_vision.py reads a released-style vision_config)
    assert cfg == get_preset("k3").with_overrides({"name": cfg.name, "mtp_layers": cfg.mtp_layers, "vision": None})


def test_layer_schedule_sources_agree_and_are_checked():
    d = moonshot_kimi_linear_config()
    types = ["full_attention" if i + 1 in d["linear_attn_config"]["full_attn_layers"] else "linear_attention"
             for i in range(27)]
    assert config_from_hub({**d, "layer_types": types}) == config_from_hub(d)
    assert config_from_hub({**d, "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 24}).first_k_dense == 3
    with pytest.raises(ValueError, match="mlp_layer_types"):
        config_from_hub({**d, "mlp_layer_types": ["sparse", "dense"] + ["sparse"] * 25})
    broken = {**d["linear_attn_config"], "kda_layers": [1, 2]}
    with pytest.raises(ValueError, match="full_attn_layers/kda_layers"):
        config_from_hub({**d, "linear_attn_config": broken})
    with pytest.raises(ValueError, match="'num_experts_per_token'"):
        config_from_hub({k: v for k, v in d.items() if k != "num_experts_per_token"})


def test_no_moe_and_kda_fields_round_trip():
    cfg = get_preset("k3-tiny").with_overrides({"moe": None, "kda": {"gate": "kimi", "gate_lower_bound": -2.0}})
    assert config_from_k3(config_to_k3(cfg)) == cfg
