"""Module structure the rest of openk3 relies on: HF-style parameter names and shapes, router buffers and scores,
fp32-kept parameters, num_heads attributes, gradients, meta-device construction, the inference fusion of the
Linears that read one input."""

import copy
import dataclasses
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from openk3.config import get_preset
from openk3.model import GLUMLP, GatedMLA, K3ForCausalLM, KimiDeltaAttention, MoE, TopkRouter, configure_kda
from openk3.model.common import FusableLinears, fuse_linears, linear, linear_concat, linear_split
from openk3.model.moe import decisive_routing, pinned_routing
from test_model_decode import kimi_tiny


def shapes(model):
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_k3_names_and_shapes():
    cfg = get_preset("k3-tiny")
    model = K3ForCausalLM(cfg)
    s = shapes(model)
    D, H, K, W = cfg.hidden_size, cfg.kda.num_heads, cfg.kda_head_dim, cfg.kda.conv_kernel
    m, moe = cfg.mla, cfg.moe
    kda = "model.layers.0.self_attn."
    expect = {
        "model.embed_tokens.weight": (cfg.vocab_size, D),
        "lm_head.weight": (cfg.vocab_size, D),
        "model.norm.weight": (D,),
        kda + "q_proj.weight": (H * K, D), kda + "k_proj.weight": (H * K, D), kda + "v_proj.weight": (H * K, D),
        kda + "q_conv1d.weight": (H * K, 1, W), kda + "k_conv1d.weight": (H * K, 1, W),
        kda + "v_conv1d.weight": (H * K, 1, W),
        kda + "f_a_proj.weight": (K, D), kda + "f_b_proj.weight": (H * K, K),
        kda + "A_log": (H,), kda + "dt_bias": (H * K,), kda + "b_proj.weight": (H, D),
        kda + "g_proj.weight": (H * K, D), kda + "o_norm.weight": (K,), kda + "o_proj.weight": (D, H * K),
        "model.layers.0.mlp.gate_proj.weight": (cfg.dense_hidden, D),
        "model.layers.0.mlp.down_proj.weight": (D, cfg.dense_hidden),
        "model.layers.0.input_layernorm.weight": (D,),
        "model.layers.0.post_attention_layernorm.weight": (D,),
        "model.layers.0.mlp_res_proj.weight": (1, D), "model.layers.0.mlp_res_norm.weight": (D,),
        "model.layers.1.attn_res_proj.weight": (1, D), "model.layers.1.attn_res_norm.weight": (D,),
        "model.output_res_proj.weight": (1, D), "model.output_res_norm.weight": (D,),
        "model.layers.3.self_attn.q_a_proj.weight": (m.q_lora_rank, D),
        "model.layers.3.self_attn.q_a_layernorm.weight": (m.q_lora_rank,),
        "model.layers.3.self_attn.q_b_proj.weight": (m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim),
                                                     m.q_lora_rank),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, D),
        "model.layers.3.self_attn.kv_a_layernorm.weight": (m.kv_lora_rank,),
        "model.layers.3.self_attn.kv_b_proj.weight": (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                                      m.kv_lora_rank),
        "model.layers.3.self_attn.g_proj.weight": (m.num_heads * m.v_head_dim, D),
        "model.layers.3.self_attn.o_proj.weight": (D, m.num_heads * m.v_head_dim),
        "model.layers.1.mlp.gate.weight": (moe.num_experts, D),
        "model.layers.1.mlp.gate.e_score_correction_bias": (moe.num_experts,),
        "model.layers.1.mlp.routed_down.weight": (moe.latent_dim, D),
        "model.layers.1.mlp.latent_norm.weight": (moe.latent_dim,),
        "model.layers.1.mlp.routed_up.weight": (D, moe.latent_dim),
        "model.layers.1.mlp.experts.gate_up_proj": (moe.num_experts, 2 * moe.expert_hidden, moe.latent_dim),
        "model.layers.1.mlp.experts.down_proj": (moe.num_experts, moe.latent_dim, moe.expert_hidden),
        "model.layers.1.mlp.shared_experts.gate_proj.weight": (moe.expert_hidden * moe.num_shared_experts, D),
        "mtp.0.eh_proj.weight": (D, 2 * D), "mtp.0.enorm.weight": (D,), "mtp.0.hnorm.weight": (D,),
        "mtp.0.norm.weight": (D,), "mtp.0.block.self_attn.kv_b_proj.weight":
            (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
    }
    for k, v in expect.items():
        assert s.get(k) == v, (k, s.get(k), v)
    assert "model.layers.0.attn_res_proj.weight" not in s  # layer 0: no attention AttnRes
    assert "model.layers.3.self_attn.q_proj.weight" not in s and "model.layers.3.self_attn.o_norm.weight" not in s


def test_kimi_linear_names():
    cfg = get_preset("kimi-linear-48b").with_overrides({
        "vocab_size": 50, "hidden_size": 32, "num_layers": 3, "mla_layers": [2], "dense_hidden": 40,
        "kda": {"num_heads": 2, "head_dim": 8},
        "mla": {"num_heads": 2, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4},
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 8}})
    s = shapes(K3ForCausalLM(cfg))
    a = "model.layers.0.self_attn."
    assert s[a + "conv1d.weight"] == (3 * 16, 1, 4)
    assert s[a + "g_a_proj.weight"] == (8, 32) and s[a + "g_b_proj.weight"] == (16, 8)
    assert a + "g_proj.weight" not in s and a + "q_conv1d.weight" not in s
    assert s["model.layers.2.self_attn.q_proj.weight"] == (2 * 8, 32)
    assert "model.layers.2.self_attn.g_proj.weight" not in s
    assert s["model.layers.1.mlp.experts.gate_up_proj"] == (4, 16, 32)
    assert not any("_res_" in k or k.startswith("mtp.") or "routed_down" in k for k in s)


def test_routers_scores_and_buffers():
    model = K3ForCausalLM(get_preset("k3-tiny"))
    cfg = model.config
    routers = list(model.routers())
    assert [i for i, _ in routers] == list(range(1, cfg.num_layers)) + [cfg.num_layers]  # + the MTP layer
    router = routers[0][1]
    assert isinstance(router, TopkRouter)
    assert "e_score_correction_bias" in dict(router.named_buffers())
    assert all("e_score_correction_bias" not in n for n, _ in model.named_parameters())
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    model.eval()
    model(ids)
    assert router.last_scores is None
    model.train()
    model(ids)
    assert router.last_scores.shape == (14, cfg.moe.num_experts) and not router.last_scores.requires_grad
    assert ((router.last_scores > 0) & (router.last_scores < 1)).all()


def test_router_is_fp32_under_bf16_autocast():
    """The router's logits are fp32 products under a bf16 autocast too (near-ties decide the top-k): the same
    routing, to the bit, as without autocast; its gradient reaches the fp32 weight."""
    router = TopkRouter(get_preset("k3-tiny"))
    x = torch.randn(37, router.weight.shape[1]) * 3
    want = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router(x)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.weights, want.weights)
    got.weights.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.dtype == torch.float32


def test_heads_attributes():
    model = K3ForCausalLM(get_preset("k3-tiny"))
    attn = [layer.self_attn for layer in model.model.layers]
    assert isinstance(attn[0], KimiDeltaAttention) and attn[0].num_heads == 4 and attn[0].head_dim == 32
    assert isinstance(attn[3], GatedMLA) and attn[3].num_heads == 4


def test_bf16_keeps_fp32_params_and_runs():
    model = K3ForCausalLM(get_preset("k3-tiny")).to(torch.bfloat16)
    a = model.model.layers[0].self_attn
    assert a.A_log.dtype == torch.float32 and a.dt_bias.dtype == torch.float32
    assert isinstance(a.A_log, torch.nn.Parameter)
    r = model.model.layers[1].mlp.gate
    assert r.weight.dtype == torch.float32 and r.e_score_correction_bias.dtype == torch.float32
    assert a.q_proj.weight.dtype == torch.bfloat16
    out = model(torch.randint(0, 4096, (1, 9)))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()
    cache = model.new_cache(1)
    model(torch.randint(0, 4096, (1, 4)), cache=cache)
    assert cache.layers[0].recurrent_state.dtype == torch.float32


def test_bf16_forward_follows_fp32_once_routing_is_pinned():
    """bf16 against fp32 on the same weights, each run's experts pinned to the fp32 run's choices (a random router's
    near-ties would otherwise let rounding pick other experts). Measured 1e-2 on k3-tiny; bf16 rounding of the
    residual stream over 8 layers allows a few times that; a bf16 island that should be fp32 (gates, states) would
    not stay inside it. Also: pinning replays exactly (same precision, same choices -> same logits)."""
    base = get_preset("k3-tiny")
    cfg = dataclasses.replace(base, moe=dataclasses.replace(base.moe, num_experts=16, top_k=4))
    torch.manual_seed(3)
    m32 = K3ForCausalLM(cfg).eval()
    m16 = copy.deepcopy(m32).bfloat16()
    ids = torch.randint(0, cfg.vocab_size, (2, 67))
    with torch.no_grad():
        with pinned_routing(m32) as choices:
            want = m32(ids).logits
        assert len(choices) == len(list(m32.routers())) and all(c.shape[-1] == 4 for c in choices)
        with pinned_routing(m32, choices):
            assert torch.equal(m32(ids).logits, want)
        with pinned_routing(m16, choices):
            got = m16(ids).logits.float()
    assert ((got - want).norm() / want.norm()).item() < 3e-2


def test_decisive_routing_makes_bf16_pick_the_fp32_experts_and_restores_the_biases():
    """Inside decisive_routing the two precisions choose the same experts for every token (recorded with
    pinned_routing), so their logits agree to bf16 rounding; outside, the routers' biases are their own again."""
    base = get_preset("k3-tiny")
    cfg = dataclasses.replace(base, moe=dataclasses.replace(base.moe, num_experts=16, top_k=4))
    torch.manual_seed(4)
    m32 = K3ForCausalLM(cfg).eval()
    routers = [router for _, router in m32.routers()]
    for router in routers:
        router.e_score_correction_bias.normal_()
    biases = [r.e_score_correction_bias.clone() for r in routers]
    m16 = copy.deepcopy(m32).bfloat16()
    ids = torch.randint(0, cfg.vocab_size, (2, 67))
    with torch.no_grad(), decisive_routing(m32), decisive_routing(m16):
        with pinned_routing(m32) as want_choices:
            want = m32(ids).logits
        with pinned_routing(m16) as got_choices:
            got = m16(ids).logits.float()
    assert all(torch.equal(a, b) for a, b in zip(want_choices, got_choices, strict=True))
    assert ((got - want).norm() / want.norm()).item() < 3e-2
    assert all(torch.equal(r.e_score_correction_bias, b) for r, b in zip(routers, biases, strict=True))


def test_backward_reaches_every_parameter():
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("k3-tiny"))
    ids = torch.randint(0, 4096, (2, 24))
    out = model(ids)
    loss = out.logits.float().logsumexp(-1).mean() + out.mtp_logits.float().logsumexp(-1).mean()
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None and ".experts." not in n]
    assert not missing, missing


def test_meta_device_build():
    with torch.device("meta"):
        model = K3ForCausalLM(get_preset("k3-debug"))
    assert all(p.is_meta for p in model.parameters())
    n = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    assert 1e8 < n < 2e9  # "a few hundred million" scale


def test_configure_kda_sets_every_layer():
    model = K3ForCausalLM(get_preset("k3-tiny"))
    configure_kda(model, backend="recurrent")
    layers = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    assert layers and all(m.kda_backend == "recurrent" for m in layers)
    with pytest.raises(ValueError, match="backend"):
        configure_kda(model, backend="cuda")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-linear-48b"])
def test_kda_layer_triton_path_matches_chunked(preset):
    """With the Triton backend the layer takes its activations from one Triton pass (kda_activations) and runs the
    chunk kernels (K3's bounded gate in their bounded mode, Kimi Linear's unbounded one in the any-gate mode);
    outputs and every parameter's gradient match the PyTorch activations + chunked KDA in relative error (the
    Triton kernels run under TRITON_INTERPRET=1 without CUDA, set by tests/conftest.py)."""
    cfg = get_preset(preset).with_overrides({"hidden_size": 64, "kda": {"num_heads": 2, "head_dim": 16}})
    layers = {}
    for backend in ("triton", "chunked"):
        torch.manual_seed(0)
        layers[backend] = KimiDeltaAttention(cfg, 0)
        with torch.no_grad():  # O(1) weights, so gradients are not all near zero
            for p in layers[backend].parameters():
                if p.dim() > 1:
                    p.normal_(0.0, p.shape[-1] ** -0.5)
        layers[backend].kda_backend = backend
    x = torch.randn(2, 21, cfg.hidden_size)
    outs = {}
    for backend, layer in layers.items():
        xb = x.clone().requires_grad_()
        y = layer(xb)
        y.square().sum().backward()
        outs[backend] = (y, xb.grad)
    assert _rel(outs["triton"][0], outs["chunked"][0]) < 1e-5
    assert _rel(outs["triton"][1], outs["chunked"][1]) < 1e-5
    for (name, a), b in zip(layers["triton"].named_parameters(), layers["chunked"].parameters()):
        assert b.grad.norm() > 0, name
        assert _rel(a.grad, b.grad) < 1e-4, name


def test_linear_concat_equals_the_linears_side_by_side():
    """linear_concat: with autograd one product over the concatenated weights, without it one per Linear or one over
    their fused buffer; all the Linears' outputs side by side (fp64, odd sizes), the fused product bit for bit the
    training one (the same product), linear_split's outputs views of it, and the gradients of x and every weight
    those of the separate products."""
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    linears = [linear(13, n, 0.5).double() for n in (5, 1, 7)]
    x = torch.randn(2, 3, 13, generator=g, dtype=torch.float64) * 100
    with torch.no_grad():
        want = torch.cat([lin(x) for lin in linears], dim=-1)
        torch.testing.assert_close(linear_concat(x, linears), want, rtol=1e-12, atol=1e-9)
        fused = torch.cat([lin.weight for lin in linears])
        got = linear_concat(x, linears, fused)
        parts = linear_split(x, linears, fused)
    assert torch.equal(got, linear_concat(x, linears)) and torch.equal(got, linear_concat(x, linears, fused))
    assert all(part._base is not None for part in parts) and torch.equal(torch.cat(parts, dim=-1), got)
    dy = torch.randn(want.shape, generator=g, dtype=torch.float64)
    grads = []
    for fn in (lambda t: linear_concat(t, linears), lambda t: torch.cat([lin(t) for lin in linears], dim=-1)):
        leaf = x.clone().requires_grad_()
        for lin in linears:
            lin.weight.grad = None
        out = fn(leaf)
        out.backward(dy)
        grads.append([out.detach(), leaf.grad] + [lin.weight.grad.clone() for lin in linears])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-9)


def test_fuse_linears_makes_the_weights_row_views_of_one_buffer():
    """fuse_linears: the buffer holds the weights in order, each Linear's weight an nn.Parameter over its rows
    (requires_grad kept); a copy into a weight lands in the buffer."""
    linears = [linear(6, n, 1.0) for n in (2, 3, 1)]
    linears[1].weight.requires_grad_(False)
    want = torch.cat([lin.weight.detach() for lin in linears])
    fused = fuse_linears(linears)
    assert torch.equal(fused, want) and not fused.requires_grad
    rows = 0
    for lin, grad in zip(linears, (True, False, True), strict=True):
        assert isinstance(lin.weight, torch.nn.Parameter) and lin.weight.requires_grad == grad
        assert lin.weight.data_ptr() == fused[rows].data_ptr() and lin.weight.shape == (lin.out_features, 6)
        rows += lin.out_features
    with torch.no_grad():
        linears[2].weight.fill_(7.0)
    assert (fused[5] == 7.0).all()


def _config(k3: bool, **sections):
    cfg = get_preset("k3-tiny") if k3 else kimi_tiny()
    return cfg.with_overrides(sections)


# every kind of fused group: KDA (full-rank and low-rank output gates); MLA with and without q_lora and g_proj; the
# dense FFN; LatentMoE and plain MoE, with and without a shared expert: case -> (config, module of it)
FUSION_CASES = {
    "kda-k3": (_config(True), lambda cfg: KimiDeltaAttention(cfg, 0)),
    "kda-kimi": (_config(False), lambda cfg: KimiDeltaAttention(cfg, 0)),
    "mla-q-lora-gate": (_config(True), lambda cfg: GatedMLA(cfg, 3)),
    "mla-q-lora": (_config(True, mla={"output_gate": False}), lambda cfg: GatedMLA(cfg, 3)),
    "mla-gate": (_config(False, mla={"output_gate": True}), lambda cfg: GatedMLA(cfg, 1)),
    "mla": (_config(False), lambda cfg: GatedMLA(cfg, 1)),
    "glu": (_config(True), lambda cfg: GLUMLP(cfg, cfg.hidden_size, cfg.dense_hidden)),
    "moe-latent-shared": (_config(True), MoE),
    "moe-latent": (_config(True, moe={"num_shared_experts": 0}), MoE),
    "moe-plain-shared": (_config(False), MoE),
    "moe-plain": (_config(False, moe={"num_shared_experts": 0}), MoE),
}


def _fusable(module):
    return [m for m in module.modules() if isinstance(m, FusableLinears)]


def _randomized(module, seed):
    """O(1) weights (the conv kernels kept), so that the comparisons are meaningful."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return module


def _inference(module, x):
    """(module(x) without autograd, the number of F.linear products it ran)."""
    with torch.no_grad(), mock.patch.object(F, "linear", wraps=F.linear) as products:
        return module(x), products.call_count


@pytest.mark.parametrize("case", sorted(FUSION_CASES))
def test_fused_projections_keep_the_weights_and_the_outputs(case):
    """fuse_projections (every module of the case's that has groups): each group's Linears become row views of one
    buffer, the state dict unchanged (same keys, same values); each group's fused product is the training product
    bit for bit, and the module's inference forward runs fewer products (a group of one Linear: as many, without
    the concatenation) and equals the unfused one (fp32, tight: one product in place of several); fusing again
    keeps the buffers; a state dict loaded into the fused module lands in them (assign=True: new tensors, the
    fusion dropped); `.to(torch.float64)` drops the fusion and the fp64 forward is the unfused module's, bit for
    bit."""
    cfg, build = FUSION_CASES[case]
    torch.manual_seed(0)
    module = _randomized(build(cfg), 1).eval()
    reference = copy.deepcopy(module)
    x = torch.randn(2, 7, cfg.hidden_size)
    state = copy.deepcopy(module.state_dict())
    want, products = _inference(module, x)
    for m in _fusable(module):
        m.fuse_projections()
    buffers = {(m, name): buf for m in _fusable(module) for name, buf in m.fused.items()}
    assert buffers or case == "moe-plain"
    for (m, name), buf in buffers.items():
        linears = m.fusion_groups()[name]
        rows = 0
        for lin in linears:
            assert lin.weight.data_ptr() == buf[rows].data_ptr()
            rows += lin.weight.shape[0]
        assert rows == buf.shape[0]
        with torch.no_grad():
            fused = linear_concat(x, linears, buf)
        assert torch.equal(fused, linear_concat(x, linears).detach())
    fused_state = module.state_dict()
    assert list(fused_state) == list(state) and all(torch.equal(fused_state[k], v) for k, v in state.items())
    got, fused_products = _inference(module, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wide = any(len(m.fusion_groups()[name]) > 1 for m, name in buffers)
    assert fused_products < products if wide else fused_products == products
    for m in _fusable(module):
        m.fuse_projections()
    assert all(m.fused[name] is buf for (m, name), buf in buffers.items())

    other = _randomized(build(cfg), 2).state_dict()
    module.load_state_dict(other)
    reference.load_state_dict(other)
    assert all(m.fused[name] is buf for (m, name), buf in buffers.items())
    with torch.no_grad():
        torch.testing.assert_close(module(x), reference(x), rtol=1e-5, atol=1e-5)
        module.load_state_dict(state, assign=True)
        assert not any(m.fused for m in _fusable(module))
        for m in _fusable(module):
            m.fuse_projections()
        module.to(torch.float64)
        assert not any(m.fused for m in _fusable(module))
        assert all(p.dtype == torch.float64 for n, p in module.named_parameters() if "proj" in n)
        reference.load_state_dict(state)
        assert torch.equal(module(x.double()), reference.double()(x.double()))
