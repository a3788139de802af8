"""Kimi Linear hub checkpoints: openk3 against HF transformers' KimiLinearForCausalLM (the external reference).

Each test builds a tiny transformers model with random weights (every parameter and the routing bias, at
magnitudes that make all paths matter), lets transformers write the checkpoint, loads it with openk3 and
compares logits on fresh random tokens in fp32 on CPU.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from openk3.config import get_preset
from openk3.interop import config_from_hub, load_pretrained, save_pretrained
from openk3.model import K3ForCausalLM
from random_weights import randomise

TOL = 1e-4


def hf_config(**overrides):
    """A tiny Kimi Linear config (hidden 64, vocab 256); overrides replace keys, linear_attn_config included."""
    kw = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 4], "full_attn_layers": [3]},
    )
    kw.update(overrides)
    return transformers.KimiLinearConfig(**kw)


def hf_checkpoint(tmp_path, seed: int, max_shard_size=None, **overrides):
    torch.manual_seed(seed)
    hf = transformers.KimiLinearForCausalLM(hf_config(**overrides)).eval()
    randomise(hf, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(tmp_path / "hf", **kwargs)
    return hf, tmp_path / "hf"


def assert_same_logits(hf, ours, vocab: int, seed: int, shape=(2, 19)) -> None:
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours(ids).logits
    assert got.shape == (*shape, vocab)
    assert want.abs().max() > 1.0  # the comparison is not between near-zero tensors
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"max |logits diff| {diff:.3g} > {TOL}"


CASES = {
    # dense first layer, MoE after it, MLA inside the stack, full-rank q, a T crossing transformers' 64-chunk
    "dense-first-mla-middle": dict(shape=(2, 70)),
    # MLA first and last, low-rank q, odd head dims, two dense layers, unnormalised routing, grouped top-k that
    # keeps every group (equivalent to plain top-k), 2 shared experts, conv kernel 3, other eps
    "mla-first-last-lowrank-q": dict(
        num_hidden_layers=5, q_lora_rank=24, num_attention_heads=3, num_key_value_heads=3, qk_nope_head_dim=12,
        qk_rope_head_dim=4, v_head_dim=20, kv_lora_rank=20, first_k_dense_replace=2, n_shared_experts=2,
        norm_topk_prob=False, routed_scaling_factor=1.5, n_group=2, topk_group=2, rms_norm_eps=1e-6,
        num_experts_per_tok=3,
        linear_attn_config={"head_dim": 24, "num_heads": 2, "short_conv_kernel_size": 3,
                            "kda_layers": [2, 3, 4], "full_attn_layers": [1, 5]},
    ),
    # every layer MoE, two MLA layers, more KDA heads than MLA heads, top-1 routing
    "all-moe": dict(
        first_k_dense_replace=0, num_local_experts=6, num_experts_per_tok=1, moe_intermediate_size=24,
        linear_attn_config={"head_dim": 8, "num_heads": 6, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 3], "full_attn_layers": [2, 4]},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    overrides = dict(CASES[case])
    shape = overrides.pop("shape", (2, 19))
    seed = sorted(CASES).index(case)
    hf, path = hf_checkpoint(tmp_path, seed, **overrides)
    ours = load_pretrained(path)
    assert ours.config.mla_layers == tuple(i for i, t in enumerate(hf.config.layer_types) if t == "full_attention")
    assert_same_logits(hf, ours, hf.config.vocab_size, seed, shape)


def test_incremental_decoding_matches_transformers_full_forward(tmp_path):
    """Prefill then single-token steps through openk3's cache give transformers' full-forward logits."""
    hf, path = hf_checkpoint(tmp_path, seed=5, **CASES["mla-first-last-lowrank-q"])
    ours = load_pretrained(path)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        cache = ours.new_cache(batch_size=2)
        steps = [ours(ids[:, :8], cache=cache).logits]
        steps += [ours(ids[:, t: t + 1], cache=cache).logits for t in range(8, 12)]
    diff = (torch.cat(steps, dim=1) - want).abs().max().item()
    assert diff <= TOL, f"max |logits diff| {diff:.3g} > {TOL}"


def test_sharded_checkpoint_and_original_spellings(tmp_path):
    """A sharded save (index json) loads; so do Moonshot's original spellings: `mlp.` for the dense FFN and a
    config.json without transformers' layer_types / mlp_layer_types."""
    hf, path = hf_checkpoint(tmp_path, seed=7, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert_same_logits(hf, load_pretrained(path), 256, seed=7)

    merged = {}
    for shard in sorted(path.glob("*.safetensors")):
        merged.update(load_file(shard))
    original = tmp_path / "original"
    original.mkdir()
    renamed = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in merged.items()}
    assert any(".layers.0.mlp.gate_proj." in k for k in renamed)
    save_file(renamed, original / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config.pop("layer_types")
    config.pop("mlp_layer_types")
    (original / "config.json").write_text(json.dumps(config))
    assert_same_logits(hf, load_pretrained(original), 256, seed=7)


@pytest.mark.parametrize("moe", [{"num_experts": 6, "top_k": 2, "expert_hidden": 32}, None], ids=["moe", "dense"])
def test_openk3_hub_save_loads_in_transformers(tmp_path, moe):
    """openk3 -> hub layout -> transformers: the same logits, and the same tensor names transformers writes."""
    cfg = get_preset("kimi-linear-48b").with_overrides(dict(
        vocab_size=256, hidden_size=64, num_layers=4, mla_layers=[0, 3], dense_hidden=80, max_seq_len=512,
        kda={"num_heads": 4, "head_dim": 16}, moe=moe,
        mla={"num_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16},
    ))
    torch.manual_seed(3)
    ours = K3ForCausalLM(cfg).eval()
    randomise(ours, seed=3)
    save_pretrained(ours, tmp_path / "ours", layout="hub")
    hf = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert_same_logits(hf, ours, cfg.vocab_size, seed=3)

    hf.save_pretrained(tmp_path / "theirs")
    assert set(load_file(tmp_path / "ours" / "model.safetensors")) == set(
        load_file(tmp_path / "theirs" / "model.safetensors"))
    back = load_pretrained(tmp_path / "ours")
    # the name is the hub's model_type; without MoE, "every layer dense" is written as first_k_dense = num_layers
    same = cfg.with_overrides({"name": "kimi_linear", "first_k_dense": cfg.first_k_dense if moe else 4})
    assert back.config == same


@pytest.mark.parametrize("overrides, field", [
    (dict(num_expert_group=4, topk_group=2), "num_expert_group"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mla_use_nope=False), "mla_use_nope"),
])
def test_unsupported_hub_options_name_the_field(overrides, field):
    config = {**hf_config().to_dict(), **overrides}
    with pytest.raises(ValueError, match=field):
        config_from_hub(config)


def test_k3_only_config_cannot_be_saved_as_hub(tmp_path):
    cfg = get_preset("k3-tiny")
    with pytest.raises(ValueError) as err:
        save_pretrained(K3ForCausalLM(cfg), tmp_path, layout="hub")
    for field in ("activation", "kda.gate", "kda.output_gate", "mla.output_gate", "moe.latent_dim",
                  "attn_res_block_size", "mtp_layers"):
        assert field in str(err.value)
