"""The released K3 key layout and openk3's own checkpoints (K3 layout): names, bit-exact round trips, and the
errors for checkpoints that do not match their config; MXFP4-packed routed experts, with compressed-tensors (the
`mxfp4-pack-quantized` format's package) as the oracle for the files and the config."""

from __future__ import annotations

import json
import re

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP4A16
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales
from safetensors.torch import load_file, save_file

from openk3.config import get_preset
from openk3.interop import load_pretrained, save_pretrained
from openk3.interop.layouts import external_plan, to_external
from openk3.model import K3ForCausalLM
from openk3.quant import fake_quant_mxfp4, pack_mxfp4
from random_weights import randomise


def tiny_k3(**overrides):
    """k3-tiny, smaller: 5 layers with MLA at 2 and 4 (the last), dense layer 0, LatentMoE, AttnRes blocks of 2,
    one MTP layer."""
    return get_preset("k3-tiny").with_overrides({
        "vocab_size": 256, "hidden_size": 64, "num_layers": 5, "mla_layers": [2, 4], "dense_hidden": 96,
        "kda": {"num_heads": 2, "head_dim": 32},
        "mla": {"num_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8, "v_head_dim": 16},
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "latent_dim": 32},
        **overrides})


def random_model(cfg, seed: int) -> K3ForCausalLM:
    """Every parameter and buffer random (the AttnRes pseudo-queries and routing bias start at 0 otherwise)."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(cfg).eval()
    randomise(model, seed)
    return model


def assert_identical(a: K3ForCausalLM, b: K3ForCausalLM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key


def logits(model, vocab: int, seed: int = 0):
    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(ids)
    return out.logits, out.mtp_logits


def test_k3_round_trip_is_bit_exact(tmp_path):
    cfg = tiny_k3()
    model = random_model(cfg, seed=0)
    save_pretrained(model, tmp_path)
    back = load_pretrained(tmp_path)
    assert back.config == cfg
    assert_identical(model, back)
    (want, want_mtp), (got, got_mtp) = logits(model, cfg.vocab_size), logits(back, cfg.vocab_size)
    assert torch.equal(want, got) and torch.equal(want_mtp, got_mtp)

    save_pretrained(back, tmp_path / "again")  # and the files themselves reproduce
    first, second = load_file(tmp_path / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first)
    assert (tmp_path / "config.json").read_text() == (tmp_path / "again" / "config.json").read_text()


def test_k3_layout_names_and_config_keys(tmp_path):
    cfg = tiny_k3()
    model = random_model(cfg, seed=1)
    save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    text = config["text_config"]
    assert text["hidden_act"] == "situ" and text["activation_situ_beta"] == 4.0
    assert text["activation_situ_linear_beta"] == 25.0 and text["mla_use_output_gate"] is True
    assert text["routed_expert_hidden_size"] == cfg.moe.latent_dim and text["latent_moe_use_norm"] is True
    assert text["attn_res_block_size"] == 2 and text["num_nextn_predict_layers"] == 1
    lac = text["linear_attn_config"]
    assert lac["full_attn_layers"] == [3, 5] and lac["kda_layers"] == [1, 2, 4]
    assert lac["gate_lower_bound"] == -5.0 and lac["use_full_rank_gate"] is True

    D, L, E = cfg.hidden_size, cfg.num_layers, cfg.moe.num_experts
    latent, inter, H, K = cfg.moe.latent_dim, cfg.moe.expert_hidden, cfg.kda.num_heads, cfg.kda_head_dim
    kv_rows = cfg.mla.num_heads * (cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim)
    p = "language_model.model."
    want = {
        "language_model.lm_head.weight": (cfg.vocab_size, D),
        p + "embed_tokens.weight": (cfg.vocab_size, D),
        p + "output_attn_res_proj.weight": (1, D),
        p + "output_attn_res_norm.weight": (D,),
        p + "layers.0.mlp.gate_proj.weight": (cfg.dense_hidden, D),
        p + "layers.0.mlp_res_proj.weight": (1, D),
        p + "layers.1.self_attention_res_proj.weight": (1, D),
        p + "layers.1.self_attention_res_norm.weight": (D,),
        p + "layers.1.self_attn.q_conv1d.weight": (H * K, 1, cfg.kda.conv_kernel),
        p + "layers.1.self_attn.A_log": (H,),  # one entry per KDA head (SPEC §9)
        p + "layers.1.self_attn.dt_bias": (H * K,),
        p + "layers.1.self_attn.g_proj.weight": (H * K, D),
        p + "layers.1.block_sparse_moe.routed_expert_down_proj.weight": (latent, D),
        p + "layers.1.block_sparse_moe.routed_expert_norm.weight": (latent,),
        p + "layers.1.block_sparse_moe.routed_expert_up_proj.weight": (D, latent),
        p + f"layers.1.block_sparse_moe.experts.{E - 1}.w1.weight": (inter, latent),
        p + f"layers.1.block_sparse_moe.experts.{E - 1}.w2.weight": (latent, inter),
        p + "layers.1.block_sparse_moe.gate.e_score_correction_bias": (E,),
        p + "layers.2.self_attn.g_proj.weight": (cfg.mla.num_heads * cfg.mla.v_head_dim, D),
        p + f"layers.{L}.eh_proj.weight": (D, 2 * D),
        p + f"layers.{L}.enorm.weight": (D,),
        p + f"layers.{L}.shared_head.norm.weight": (D,),
        p + f"layers.{L}.self_attn.kv_b_proj.weight": (kv_rows, cfg.mla.kv_lora_rank),
    }
    stored = load_file(tmp_path / "model.safetensors")
    for key, shape in want.items():
        assert tuple(stored[key].shape) == shape, key
    assert torch.equal(stored[p + "layers.1.self_attn.A_log"], model.model.layers[1].self_attn.A_log)
    assert not any(k.startswith(p + "layers.0.self_attention_res") for k in stored)
    assert not any(".mlp." in k for k in stored if ".layers.0." not in k)


def test_k3_directory_with_alternative_spellings_loads(tmp_path):
    """Layer 0's (inert) self_attention_res tensors and `block_sparse_moe.` for the dense FFN are accepted."""
    cfg = tiny_k3(mtp_layers=0)
    model = random_model(cfg, seed=2)
    save_pretrained(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    stored = {k.replace("layers.0.mlp.", "layers.0.block_sparse_moe."): v for k, v in stored.items()}
    p = "language_model.model.layers.0."
    stored[p + "self_attention_res_proj.weight"] = torch.randn(1, cfg.hidden_size)
    stored[p + "self_attention_res_norm.weight"] = torch.randn(cfg.hidden_size)
    save_file(stored, tmp_path / "model.safetensors")
    back = load_pretrained(tmp_path)
    assert_identical(model, back)
    assert torch.equal(logits(model, cfg.vocab_size)[0], logits(back, cfg.vocab_size)[0])


@pytest.mark.parametrize("stored_len", [2, 3, 32, 96])  # H = 2: exactly [H], and longer with a zero tail
def test_k3_a_log_with_a_zero_tail_loads(tmp_path, stored_len):
    cfg = tiny_k3(mtp_layers=0)
    model = random_model(cfg, seed=9)
    save_pretrained(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    keys = [k for k in stored if k.endswith("self_attn.A_log")]
    assert keys and all(stored[k].shape == (cfg.kda.num_heads,) for k in keys)
    for k in keys:
        stored[k] = torch.cat([stored[k], torch.zeros(stored_len - cfg.kda.num_heads)])
    save_file(stored, tmp_path / "model.safetensors")
    assert_identical(model, load_pretrained(tmp_path))


@pytest.mark.parametrize("tail", [1e-30, -7.0, float("nan")])
def test_k3_a_log_with_a_non_zero_tail_is_an_error_naming_it(tmp_path, tail):
    cfg = tiny_k3(mtp_layers=0)
    save_pretrained(random_model(cfg, seed=10), tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    key = "language_model.model.layers.1.self_attn.A_log"
    H = cfg.kda.num_heads
    stored[key] = torch.cat([stored[key], torch.zeros(5)])
    stored[key][H + 3] = tail
    save_file(stored, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"^{key} has shape \[{H + 5}\] with non-zero entries past the first {H}"):
        load_pretrained(tmp_path)


def test_k3_a_log_shorter_than_the_heads_or_not_a_vector_is_listed(tmp_path):
    cfg = tiny_k3(mtp_layers=0, kda={"num_heads": 4, "head_dim": 16})
    save_pretrained(random_model(cfg, seed=11), tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    short, matrix = (f"language_model.model.layers.{i}.self_attn.A_log" for i in (1, 3))
    stored[short] = stored[short][:3]
    stored[matrix] = stored[matrix].view(1, 4)
    save_file(stored, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="wrong shape") as err:
        load_pretrained(tmp_path)
    message = str(err.value)
    assert f"{short} expected [4] found [3]" in message and f"{matrix} expected [4] found [1, 4]" in message


OPENK3_CONFIGS = {
    # Kimi Linear's components written in the K3 layout: fused conv, softplus gate, low-rank gates, SwiGLU
    "kimi-components": dict(
        kda={"gate": "kimi", "output_gate": "lowrank", "fused_conv": True, "gate_lower_bound": -3.0},
        mla={"q_lora_rank": None, "output_gate": False, "norm_eps": 1e-5}, activation="swiglu",
        attn_res_block_size=None, mtp_layers=0, moe={"latent_dim": None, "latent_norm": False}),
    # tied embeddings, no MoE at all, the MLA output norm, MLA on the first layer, two MTP depths
    "tied-dense-norm": dict(tie_embeddings=True, moe=None, mla={"output_norm": True}, mla_layers=[0, 4],
                            mtp_layers=2, attn_res_block_size=3, situ_beta_gate=3.0, first_k_dense=3),
    # no latent norm, no shared experts, unnormalised scaled routing, every layer MoE, A_log longer than head_dim
    "moe-variants": dict(moe={"latent_norm": False, "num_shared_experts": 0, "renormalize": False,
                              "routed_scaling_factor": 2.5}, first_k_dense=0,
                         kda={"conv_kernel": 2, "num_heads": 8, "head_dim": 4}),  # more KDA heads than head_dim
}


@pytest.mark.parametrize("name", sorted(OPENK3_CONFIGS))
def test_openk3_checkpoint_round_trip(tmp_path, name):
    cfg = tiny_k3(**OPENK3_CONFIGS[name])
    model = random_model(cfg, seed=3)
    save_pretrained(model, tmp_path, max_shard_bytes=200_000)  # sharded, with an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    back = load_pretrained(tmp_path)
    assert back.config == cfg
    assert_identical(model, back)
    if cfg.tie_embeddings:
        assert back.lm_head.weight is back.model.embed_tokens.weight
    assert torch.equal(logits(model, cfg.vocab_size)[0], logits(back, cfg.vocab_size)[0])


def test_dtypes_are_kept_or_cast(tmp_path):
    model = random_model(tiny_k3(mtp_layers=0), seed=4).to(torch.bfloat16)
    save_pretrained(model, tmp_path)
    back = load_pretrained(tmp_path)
    assert_identical(model, back)  # bf16 weights, fp32 A_log / dt_bias / router as stored
    assert back.model.layers[1].self_attn.A_log.dtype == torch.float32
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    as_fp32 = load_pretrained(tmp_path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in as_fp32.parameters())

    # a checkpoint whose fp32-kept tensors were stored in bf16 (transformers' .to(bfloat16) does that)
    stored = load_file(tmp_path / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in stored.items()}, tmp_path / "model.safetensors")
    upcast = load_pretrained(tmp_path)
    assert upcast.model.layers[1].self_attn.A_log.dtype == torch.float32
    assert torch.equal(upcast.model.layers[1].self_attn.A_log, model.model.layers[1].self_attn.A_log.bfloat16().float())
    assert upcast.model.layers[1].mlp.gate.weight.dtype == torch.float32


def test_head_dim_none_resolves_to_the_same_model(tmp_path):
    cfg = tiny_k3(kda={"head_dim": None}, mtp_layers=0)
    model = random_model(cfg, seed=5)
    save_pretrained(model, tmp_path)
    back = load_pretrained(tmp_path)
    assert back.config == cfg.with_overrides({"kda": {"head_dim": cfg.kda_head_dim}})
    assert_identical(model, back)


def test_mismatched_tensors_are_all_listed(tmp_path):
    cfg = tiny_k3(mtp_layers=0)
    save_pretrained(random_model(cfg, seed=6), tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    p = "language_model.model.layers."
    gone = [p + "1.self_attn.q_conv1d.weight", p + "3.block_sparse_moe.experts.3.w2.weight"]
    for key in gone:
        del stored[key]
    extra = p + "1.self_attn.bogus.weight"
    stored[extra] = torch.zeros(3)
    reshaped = p + "2.self_attn.kv_b_proj.weight"
    stored[reshaped] = stored[reshaped][:-1]
    save_file(stored, tmp_path / "model.safetensors")

    with pytest.raises(ValueError) as err:
        load_pretrained(tmp_path)
    message = str(err.value)
    assert f"missing (2): {gone[0]}, {gone[1]}" in message
    assert f"unexpected (1): {extra}" in message
    rows, cols = cfg.mla.num_heads * (cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim), cfg.mla.kv_lora_rank
    assert f"wrong shape (1): {reshaped} expected [{rows}, {cols}] found [{rows - 1}, {cols}]" in message


def test_hub_checkpoint_errors_list_keys(tmp_path):
    cfg = get_preset("kimi-linear-48b").with_overrides(dict(
        vocab_size=128, hidden_size=32, num_layers=2, mla_layers=[1], dense_hidden=48,
        kda={"num_heads": 2, "head_dim": 16}, moe={"num_experts": 4, "top_k": 2, "expert_hidden": 16},
        mla={"num_heads": 2, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}))
    save_pretrained(random_model(cfg, seed=7), tmp_path, layout="hub")
    stored = load_file(tmp_path / "model.safetensors")
    del stored["lm_head.weight"]
    save_file(stored, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \(1\): lm_head.weight$"):
        load_pretrained(tmp_path)


def test_bad_directories(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        load_pretrained(tmp_path)
    with pytest.raises(ValueError, match="layout"):
        save_pretrained(random_model(tiny_k3(), seed=8), tmp_path / "x", layout="gguf")


# ---- MXFP4-packed routed experts (SPEC §13) ------------------------------------------------------------------

def is_routed_expert(key: str) -> bool:
    return ".experts." in key and ".shared_experts." not in key


def with_quantized_experts(model: K3ForCausalLM) -> K3ForCausalLM:
    """A copy whose routed experts hold dequant(quant(W))."""
    copy = random_model(model.config, seed=0)
    copy.load_state_dict({k: fake_quant_mxfp4(v) if is_routed_expert(k) else v for k, v in model.state_dict().items()})
    return copy.to(next(model.parameters()).dtype)


def mxfp4_cfg(layout: str):
    if layout == "k3":
        return tiny_k3()
    return get_preset("kimi-linear-48b").with_overrides(dict(
        vocab_size=128, hidden_size=64, num_layers=2, mla_layers=[1], dense_hidden=48,
        kda={"num_heads": 2, "head_dim": 16}, moe={"num_experts": 4, "top_k": 2, "expert_hidden": 32},
        mla={"num_heads": 2, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}))


@pytest.mark.parametrize("layout,dtype", [("k3", torch.float32), ("k3", torch.bfloat16), ("hub", torch.float32)])
def test_mxfp4_save_load_round_trip(tmp_path, layout, dtype):
    """save(quantization="mxfp4") -> load gives dequant(quant(W)) for the routed experts, every other tensor
    bit-identical, and the logits of the model run on those weights; the config is one compressed-tensors reads."""
    cfg = mxfp4_cfg(layout)
    model = random_model(cfg, seed=12).to(dtype)
    save_pretrained(model, tmp_path, layout=layout, quantization="mxfp4")

    stored = load_file(tmp_path / "model.safetensors")
    experts = [k for k in stored if ".experts." in k and ".shared_experts." not in k]
    assert experts and all(k.endswith((".weight_packed", ".weight_scale")) for k in experts)
    assert all(stored[k].dtype == torch.uint8 for k in experts)
    packed = next(k for k in experts if k.endswith("w2.weight_packed"))
    assert stored[packed].shape == (model.config.moe.latent_dim or cfg.hidden_size, cfg.moe.expert_hidden // 2)
    assert stored[packed.replace("_packed", "_scale")].shape == (stored[packed].shape[0], cfg.moe.expert_hidden // 32)

    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    others = {k.removesuffix(".weight") for k, t in stored.items() if k.endswith(".weight") and t.dim() == 2}
    assert set(qc["ignore"]) == others - {k for k in others if "embed_tokens" in k}
    parsed = QuantizationConfig.model_validate(qc)  # the format's own package reads it
    assert parsed.format == "mxfp4-pack-quantized" and parsed.config_groups["group_0"].weights.num_bits == 4

    back = load_pretrained(tmp_path)
    assert back.config == (cfg if layout == "k3" else cfg.with_overrides({"name": "kimi_linear"}))
    want = with_quantized_experts(model)
    assert_identical(want, back)
    assert torch.equal(logits(want, cfg.vocab_size)[0], logits(back, cfg.vocab_size)[0])


def test_mxfp4_released_layout_loads(tmp_path):
    """A tiny checkpoint built the way the released files are: compressed-tensors packs the experts (with its own
    scale rule, not openk3's), the quantization_config sits in text_config with the format named only in its
    config group, and `ignore` is a regex; openk3 loads the experts as compressed-tensors decompresses them."""
    cfg = tiny_k3(mtp_layers=0)
    model = random_model(cfg, seed=13)
    save_pretrained(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    decompressed, other_scale_rule = {}, 0
    for key in [k for k in stored if is_routed_expert(k)]:
        w = stored.pop(key)
        amax = w.view(w.shape[0], -1, 32).abs().amax(-1)
        scale = torch.exp2(generate_mx_scales(amax) - 127)
        pair = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        stored[key + "_packed"], stored[key + "_scale"] = pair["weight_packed"], pair["weight_scale"]
        decompressed[key] = MXFP4PackedCompressor.decompress(pair, scheme)["weight"].float()
        other_scale_rule += not torch.equal(pair["weight_scale"], pack_mxfp4(w)[1])
    assert other_scale_rule  # some blocks' scales differ from the OCP floor rule openk3 writes
    save_file(stored, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["quantization_config"] = {
        "quant_method": "compressed-tensors", "quantization_status": "compressed",
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
            "dynamic": False, "scale_dtype": "torch.uint8"}}},
        "ignore": [r"re:^(?!.*\.experts\.\d+\.w[123]$).*"]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    back = load_pretrained(tmp_path)
    plan = external_plan(model.state_dict(), cfg, "k3")
    for key, tensor in back.state_dict().items():
        files = to_external({key: tensor}, {key: plan[key]})
        for name, value in files.items():
            assert torch.equal(value, decompressed.get(name, stored.get(name))), name
    assert decompressed and not torch.equal(back.model.layers[1].mlp.experts.down_proj,
                                            model.model.layers[1].mlp.experts.down_proj)


@pytest.mark.parametrize("where,value,field", [
    ("top", {"format": "nvfp4-pack-quantized"}, "quantization_config.format is 'nvfp4-pack-quantized'"),
    ("text", {"config_groups": {"g": {"format": "float-quantized"}}},
     "text_config.quantization_config.config_groups.g.format is 'float-quantized'"),
    ("top", {"quant_method": "fp8", "weight_block_size": [128, 128]}, "names no format (quant_method 'fp8')"),
    ("top", {"format": "mxfp4-pack-quantized", "config_groups": {"group_0": {"weights": {"group_size": 16}}}},
     "config_groups.group_0.weights.group_size is 16"),
])
def test_unsupported_quantization_is_an_error_naming_it(tmp_path, where, value, field):
    save_pretrained(random_model(tiny_k3(mtp_layers=0), seed=14), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (config if where == "top" else config["text_config"])["quantization_config"] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(field)):
        load_pretrained(tmp_path)


def test_mxfp4_file_errors(tmp_path):
    cfg = tiny_k3(mtp_layers=0)
    model = random_model(cfg, seed=15)
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        save_pretrained(model, tmp_path, quantization="nvfp4")
    with pytest.raises(ValueError, match="moe.expert_hidden for w2, must be multiples of 32"):
        save_pretrained(random_model(tiny_k3(moe={"expert_hidden": 48}), seed=0), tmp_path, quantization="mxfp4")

    save_pretrained(model, tmp_path, quantization="mxfp4")
    stored = load_file(tmp_path / "model.safetensors")
    p = "language_model.model.layers.1.block_sparse_moe.experts."
    del stored[p + "0.w1.weight_scale"]  # half a pair: the packed half is unexpected, the weight missing
    save_file(stored, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"missing \(1\): {re.escape(p)}0\.w1\.weight\n.*unexpected \(1\): "
                                         rf"{re.escape(p)}0\.w1\.weight_packed"):
        load_pretrained(tmp_path)
    stored[p + "0.w1.weight_scale"] = torch.zeros(cfg.moe.expert_hidden, 2, dtype=torch.uint8)  # 2 groups of 32?
    save_file(stored, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"MXFP4 pair {re.escape(p)}0\.w1\.weight_packed \[32, 16\] and "):
        load_pretrained(tmp_path)


# ---- `openk3 export`, run directories, file modes ----------------------------------------------------------------

def test_export_cli_packs_the_experts_and_carries_the_tokenizer(tmp_path, capsys):
    """`openk3 export --quantization mxfp4` on a training run directory (its latest checkpoint): the experts as
    save_pretrained packs them, the tokenizer.json copied, so `openk3 generate --ckpt` on the export needs no
    --tokenizer; an existing export is not overwritten without --overwrite. load_pretrained reads a run directory
    as the commands do; every file is written with the same mode (safetensors' own writer leaves 0600)."""
    from openk3 import export
    from openk3.cli import main
    from openk3.interop.layouts import LAYOUTS
    from openk3.interop.quantization import QUANTIZATIONS
    from openk3.tokenizer import train_bpe

    assert set(export.QUANTIZATIONS) == set(QUANTIZATIONS) and set(export.LAYOUTS) == set(LAYOUTS)
    cfg = tiny_k3(vocab_size=300)
    model = random_model(cfg, seed=3)
    run = tmp_path / "run"
    for step in ("step-000001", "step-000002"):  # complete checkpoints have a manifest (openk3.checkpoints)
        save_pretrained(random_model(cfg, seed=int(step[-1])) if step.endswith("1") else model, run / step)
        (run / step / "manifest.json").write_text("{}")
    train_bpe(["def f(x):\n    return x + 1\n"] * 20, 300).save(run / "step-000002" / "tokenizer.json")
    assert_identical(load_pretrained(run), model)  # the latest checkpoint
    out = tmp_path / "k3-tiny-mxfp4"
    assert main(["export", "--ckpt", str(run), "--out", str(out), "--quantization", "mxfp4"]) == 0
    assert f"-> {out} (k3 layout, mxfp4" in capsys.readouterr().out
    assert (out / "tokenizer.json").read_bytes() == (run / "step-000002" / "tokenizer.json").read_bytes()
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    assert_identical(load_pretrained(out), with_quantized_experts(model))
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert len(set(modes.values())) == 1, modes
    assert main(["generate", "--ckpt", str(out), "--prompt", "def ", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["export", "--ckpt", str(run), "--out", str(out), "--quantization", "mxfp4"]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert main(["export", "--ckpt", str(run), "--out", str(out), "--overwrite"]) == 0
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
