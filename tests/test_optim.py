"""Per-head Muon (SPEC §6): block splits, Newton-Schulz spectrum, and which parameters each rule owns."""

import math

import pytest
import torch
from torch import nn

from openk3.train.optim import (
    MUON_MOMENTUM,
    MUON_RMS_SCALE,
    MuonAdamW,
    from_blocks,
    muon_update,
    newton_schulz,
    to_blocks,
)

LR, WD, STEPS = 0.05, 0.1, 3


def _run(params_and_splits, grads_per_step):
    """Run MuonAdamW with one group per (param, split) for len(grads_per_step) steps."""
    groups = [dict(params=[p], algorithm="muon", split=split) for p, split in params_and_splits]
    opt = MuonAdamW(groups, lr=LR, weight_decay=WD)
    for grads in grads_per_step:
        for (p, _), g in zip(params_and_splits, grads):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("heads,d,cols", [(4, 8, 24), (3, 5, 7)])
def test_per_head_rows_equals_separate_muon_per_head(heads, d, cols):
    torch.manual_seed(heads * 100 + d)
    w0 = torch.randn(heads * d, cols)
    grads = [torch.randn(heads * d, cols) for _ in range(STEPS)]
    fused = nn.Parameter(w0.clone())
    _run([(fused, f"rows:{heads}")], [[g] for g in grads])
    separate = [nn.Parameter(w0[h * d:(h + 1) * d].clone()) for h in range(heads)]
    _run([(p, "whole") for p in separate], [[g[h * d:(h + 1) * d] for h in range(heads)] for g in grads])
    torch.testing.assert_close(fused.data, torch.cat([p.data for p in separate]), rtol=1e-5, atol=1e-6)


def test_per_head_cols_equals_separate_muon_per_head():
    torch.manual_seed(1)
    rows, heads, d = 20, 4, 6
    w0 = torch.randn(rows, heads * d)
    grads = [torch.randn(rows, heads * d) for _ in range(STEPS)]
    fused = nn.Parameter(w0.clone())
    _run([(fused, f"cols:{heads}")], [[g] for g in grads])
    separate = [nn.Parameter(w0[:, h * d:(h + 1) * d].clone()) for h in range(heads)]
    _run([(p, "whole") for p in separate], [[g[:, h * d:(h + 1) * d] for h in range(heads)] for g in grads])
    torch.testing.assert_close(fused.data, torch.cat([p.data for p in separate], dim=1), rtol=1e-5, atol=1e-6)


def test_experts_split_equals_separate_muon_per_expert():
    torch.manual_seed(2)
    experts, out_f, in_f = 5, 12, 9
    w0 = torch.randn(experts, out_f, in_f)
    grads = [torch.randn(experts, out_f, in_f) for _ in range(STEPS)]
    fused = nn.Parameter(w0.clone())
    _run([(fused, "experts")], [[g] for g in grads])
    separate = [nn.Parameter(w0[e].clone()) for e in range(experts)]
    _run([(p, "whole") for p in separate], [[g[e] for e in range(experts)] for g in grads])
    torch.testing.assert_close(fused.data, torch.stack([p.data for p in separate]), rtol=1e-5, atol=1e-6)


def test_per_head_differs_from_whole_matrix_muon():
    """The split matters: orthogonalising the concatenation gives a different update."""
    torch.manual_seed(3)
    g = torch.randn(4 * 8, 16) * torch.arange(1, 33).unsqueeze(1)  # heads with very different gradient scales
    assert not torch.allclose(muon_update(g, "rows:4"), muon_update(g, "whole"), atol=1e-3)


@pytest.mark.parametrize("split,shape", [("whole", (6, 10)), ("rows:3", (12, 5)), ("cols:2", (7, 8)),
                                         ("experts", (3, 4, 6))])
def test_block_view_round_trip(split, shape):
    t = torch.randn(*shape)
    assert torch.equal(from_blocks(to_blocks(t, split), split, t.shape), t)


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (16, 16), (8, 128), (4, 16, 48)])
def test_newton_schulz_singular_values_near_one(shape):
    torch.manual_seed(sum(shape))
    sv = torch.linalg.svdvals(newton_schulz(torch.randn(*shape)))
    assert sv.min() >= 0.5 and sv.max() <= 1.5, (sv.min(), sv.max())


def test_first_step_matches_the_spec_formula():
    """Step 1 from zero momentum: W <- W(1 - lr wd) - lr 0.2 sqrt(max(r, c)) NS(G + mu G)."""
    torch.manual_seed(4)
    w0, g = torch.randn(10, 6), torch.randn(10, 6)
    p = nn.Parameter(w0.clone())
    _run([(p, "whole")], [[g]])
    expected = w0 * (1 - LR * WD) - LR * MUON_RMS_SCALE * math.sqrt(10) * newton_schulz(g * (1 + MUON_MOMENTUM))
    torch.testing.assert_close(p.data, expected, rtol=1e-5, atol=1e-6)


def test_adamw_group_matches_torch_adamw():
    torch.manual_seed(5)
    w0 = torch.randn(7, 3)
    grads = [torch.randn(7, 3) for _ in range(STEPS)]
    ours, ref = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opt = MuonAdamW([dict(params=[ours], algorithm="adamw")], lr=LR, weight_decay=WD)
    ref_opt = torch.optim.AdamW([ref], lr=LR, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8)
    for g in grads:
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(ours.data, ref.data, rtol=1e-5, atol=1e-6)


def test_k3_parameters_go_to_the_rule_and_split_the_spec_names():
    from openk3.config import get_preset
    from openk3.model import K3ForCausalLM
    from openk3.train.optim import build_optimizer

    cfg = get_preset("k3-tiny")
    model = K3ForCausalLM(cfg)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    rule = {}
    for group in opt.param_groups:
        for p in group["params"]:
            rule[id(p)] = group["split"] if group["algorithm"] == "muon" else "adamw"
    names = dict(model.named_parameters())
    kda_heads, mla_heads = cfg.kda.num_heads, cfg.mla.num_heads
    expected = {
        "model.layers.0.self_attn.q_proj.weight": f"rows:{kda_heads}",
        "model.layers.0.self_attn.k_proj.weight": f"rows:{kda_heads}",
        "model.layers.0.self_attn.v_proj.weight": f"rows:{kda_heads}",
        "model.layers.0.self_attn.o_proj.weight": f"cols:{kda_heads}",
        "model.layers.0.self_attn.g_proj.weight": "whole",
        "model.layers.0.self_attn.A_log": "adamw",
        "model.layers.0.self_attn.dt_bias": "adamw",
        "model.layers.0.self_attn.q_conv1d.weight": "adamw",
        "model.layers.3.self_attn.q_b_proj.weight": f"rows:{mla_heads}",
        "model.layers.3.self_attn.kv_b_proj.weight": f"rows:{mla_heads}",
        "model.layers.3.self_attn.q_a_proj.weight": "whole",
        "model.layers.3.self_attn.o_proj.weight": "whole",
        "model.layers.1.mlp.experts.gate_up_proj": "experts",
        "model.layers.1.mlp.experts.down_proj": "experts",
        "model.layers.1.mlp.gate.weight": "whole",
        "model.layers.0.mlp.gate_proj.weight": "whole",
        "model.embed_tokens.weight": "adamw",
        "lm_head.weight": "adamw",
        "model.norm.weight": "adamw",
        "model.layers.1.attn_res_proj.weight": "adamw",
    }
    for name, want in expected.items():
        assert rule[id(names[name])] == want, name
    assert len(rule) == len(names)  # every parameter has exactly one rule
