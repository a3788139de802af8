"""Routed experts kept MXFP4 (`quant.packed_experts`): `quantize_experts_` gives the model whose experts hold the
dequantized values, exactly on the CPU's reference path and within bf16 rounding on the Triton path (the kernel
under TRITON_INTERPRET=1 on CPU), for a latent MoE (k3-tiny) and a plain one (Kimi Linear); the bytes it reports;
and its errors for a model without experts and for widths MXFP4 cannot block."""

from __future__ import annotations

import copy

import pytest
import torch

from openk3.config import get_preset
from openk3.model import K3ForCausalLM
from openk3.model.moe import Experts, decisive_routing
from openk3.quant import packed_experts
from openk3.quant.packed_experts import PackedExperts, expert_bytes, quantize_experts_
from test_ops_fused import DEV


def tiny_kimi_linear():
    """kimi-linear-48b's topology (plain MoE, a dense first layer, fused conv, low-rank output gate) at toy size."""
    return get_preset("kimi-linear-48b").with_overrides({
        "name": "kimi-linear-tiny", "vocab_size": 256, "hidden_size": 64, "num_layers": 4, "mla_layers": [3],
        "kda": {"num_heads": 2, "head_dim": 32}, "dense_hidden": 96, "max_seq_len": 512,
        "mla": {"num_heads": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16},
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32}})


CONFIGS = {"k3-tiny": lambda: get_preset("k3-tiny"), "kimi-linear-tiny": tiny_kimi_linear}


def models(name: str, seed: int = 0) -> tuple[K3ForCausalLM, K3ForCausalLM]:
    """(the model with packed experts, the same model with plain experts holding the dequantized values), bf16."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(CONFIGS[name]()).to(torch.bfloat16).eval()
    quantize_experts_(model)
    plain = copy.deepcopy(model)
    for parent in list(plain.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, PackedExperts):
                gate_up, down = child.dequantized(torch.bfloat16)
                experts = Experts(plain.config, gate_up.shape[-1]).to(torch.bfloat16)
                experts.gate_up_proj.data, experts.down_proj.data = gate_up, down
                setattr(parent, child_name, experts)
    return model, plain


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_path_is_the_dequantized_model(name):
    model, plain = models(name)
    assert sum(isinstance(m, PackedExperts) for m in model.modules()) == len(list(plain.routers()))
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_triton_path_matches_the_dequantized_model(name, monkeypatch):
    """The kernel path's logits against the dequantized model's, routing pinned to the same experts in both
    (`decisive_routing`: bf16 rounding would otherwise flip near-tied random-init routers)."""
    model, plain = models(name, seed=2)
    calls = []
    kernel = packed_experts.experts_forward_mxfp4
    monkeypatch.setattr(packed_experts, "use_triton", lambda x, compiled=False: True)
    monkeypatch.setattr(packed_experts, "experts_forward_mxfp4", lambda *a: calls.append(1) or kernel(*a))
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), decisive_routing(model), decisive_routing(plain):
        got = model.to(DEV)(ids.to(DEV)).logits.cpu().float()
        want = plain(ids).logits.float()
    assert len(calls) == len(list(model.routers()))  # every MoE layer, the MTP block's included
    err = (got - want).norm() / want.norm()
    # bf16 rounding of each layer's expert outputs, carried through the stack: 0.5-0.6% here, about as far as the
    # same bf16 model is from its fp32 self
    assert err < 1.5e-2, float(err)


def test_bytes_and_errors():
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("k3-tiny")).to(torch.bfloat16)
    before = expert_bytes(model)
    values = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    assert before == 2 * values
    memory = quantize_experts_(model)
    assert memory.modules == len(list(model.routers())) and memory.bytes_before == before
    assert memory.bytes_after == expert_bytes(model) == values // 2 + values // 32
    assert quantize_experts_(model).modules == 0  # already packed: nothing to do
    dense = get_preset("k3-tiny").with_overrides({"name": "dense-tiny", "moe": None})
    with pytest.raises(ValueError, match=r"model 'dense-tiny' has none \(config field 'moe' is None\)"):
        quantize_experts_(K3ForCausalLM(dense))
    odd = get_preset("k3-tiny").with_overrides({"moe": {"expert_hidden": 48}})
    with pytest.raises(ValueError, match=r"moe.expert_hidden = 48\) must be multiples of 32"):
        quantize_experts_(K3ForCausalLM(odd))
