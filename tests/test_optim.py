"""Per-head Muon (SPEC §6): block splits, the batched Newton-Schulz against the per-block loop, its spectrum, and
which parameters each rule owns."""

import math
import re

import pytest
import torch
from torch import nn

from openk3.train.optim import (
    MUON_MOMENTUM,
    MUON_RMS_SCALE,
    NS_COEFFS,
    MuonAdamW,
    build_optimizer,
    from_blocks,
    muon_block_updates,
    muon_update_reference,
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
    assert not torch.allclose(muon_update_reference(g, "rows:4"), muon_update_reference(g, "whole"), atol=1e-3)


# blocks of one shape from several parameters and splits ([5, 7]: rows, cols, whole, experts), tall and wide blocks,
# one block alone, a zero gradient, and gradients scaled far from 1
BATCH_CASES = [
    ("rows:3", (15, 7), 1.0), ("cols:2", (5, 14), 1e-20), ("whole", (5, 7), 1e15), ("experts", (3, 5, 7), 1.0),
    ("rows:4", (4 * 9, 4), 1.0), ("experts", (2, 9, 4), 1e-3), ("whole", (9, 4), 0.0), ("cols:5", (11, 5 * 13), 1.0),
    ("whole", (1, 6), 1.0), ("experts", (6, 3, 3), 1e3),
]


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_muon_updates_equal_the_per_block_loop(seed):
    torch.manual_seed(seed)
    updates = [torch.randn(*shape) * scale for _, shape, scale in BATCH_CASES]
    originals = [u.clone() for u in updates]
    splits = [split for split, _, _ in BATCH_CASES]
    batched = muon_block_updates(updates, splits)
    for split, u, blocks in zip(splits, updates, batched):
        want = muon_update_reference(u, split)
        assert blocks.shape == to_blocks(u, split).shape and blocks.dtype == torch.float32
        got = from_blocks(blocks, split, u.shape)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{split} {list(u.shape)}")
    assert not batched[6].any()  # a zero gradient gives no update
    assert all(torch.equal(u, o) for u, o in zip(updates, originals))  # the inputs are left as they were


def test_batched_muon_updates_in_bf16_stay_close_to_the_fp32_loop():
    """The CUDA form (blocks cast to bf16 before they are normalised) on the CPU: as close to the fp32 per-block
    loop as the op-by-op bf16 iteration is, for every split and for tall and wide blocks."""
    torch.manual_seed(7)
    cases = [("rows:4", (4 * 16, 40)), ("cols:3", (48, 3 * 16)), ("experts", (3, 40, 16)), ("whole", (16, 40))]
    updates = [torch.randn(*shape) for _, shape in cases]
    batched = muon_block_updates(updates, [split for split, _ in cases], dtype=torch.bfloat16)
    for (split, shape), u, blocks in zip(cases, updates, batched):
        assert blocks.dtype == torch.bfloat16
        want = muon_update_reference(u, split)
        got = from_blocks(blocks.float(), split, u.shape)
        u_blocks = to_blocks(u, split)
        bound = torch.stack([_newton_schulz_op_by_op_bf16(block) for block in u_blocks])
        bound = from_blocks(bound * MUON_RMS_SCALE * max(u_blocks.shape[-2:]) ** 0.5, split, u.shape)
        assert _relative(got, want) <= _relative(bound, want), (split, shape)


@pytest.mark.parametrize("transposed", [False, True])
def test_block_views_write_through_to_the_parameter(transposed):
    """The optimizer adds each update through the parameter's block view, for any strides."""
    t = torch.zeros(8, 6).T if transposed else torch.zeros(6, 8)
    to_blocks(t, "cols:2")[1].add_(1.0)
    to_blocks(t, "rows:3")[1].add_(1.0)
    to_blocks(t, "whole").add_(1.0)
    assert t[:, :4].sum() == 6 * 4 + 2 * 4 and t[:, 4:].sum() == 2 * 6 * 4 + 2 * 4


def _newton_schulz_op_by_op_bf16(g: torch.Tensor) -> torch.Tensor:
    """The bf16 bound: the quintic iteration with every product and sum rounded to bf16, the way Muon's public GPU
    implementation runs it (A = X X^T, B = b A + c A A, X = a X + B X)."""
    a, b, c = NS_COEFFS
    tall = g.shape[-2] > g.shape[-1]
    x = (g.mT if tall else g).bfloat16()
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        A = x @ x.mT
        x = a * x + (b * A + c * A @ A) @ x
    return (x.mT if tall else x).float()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_newton_schulz_in_bf16_stays_close_to_fp32():
    """bf16 matmuls stay at least as close to the fp32 iteration as the op-by-op bf16 form, and keep the
    singular values in the iteration's band."""
    torch.manual_seed(6)
    for shape in [(32, 64), (64, 32), (8, 16, 48), (96, 256)]:
        g = torch.randn(*shape)
        fp32, bf16 = newton_schulz(g), newton_schulz(g, dtype=torch.bfloat16)
        assert bf16.dtype == torch.float32
        assert _relative(bf16, fp32) <= _relative(_newton_schulz_op_by_op_bf16(g), fp32), shape
        sv = torch.linalg.svdvals(bf16)
        assert sv.min() >= 0.5 and sv.max() <= 1.5, (sv.min(), sv.max())


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


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_group_of_many_matches_torch_adamw(foreach):
    """A group of parameters of different shapes, one of them without a gradient (left alone, no state), against
    torch's AdamW with its single-tensor and multi-tensor implementations."""
    torch.manual_seed(6)
    shapes = [(7, 3), (5,), (2, 4, 3), (1, 9)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = MuonAdamW([dict(params=ours, algorithm="adamw")], lr=LR, weight_decay=WD)
    ref_opt = torch.optim.AdamW(ref[:2] + ref[3:], lr=LR, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8,
                                foreach=foreach)
    for _ in range(STEPS):
        for i, (a, b) in enumerate(zip(ours, ref)):
            g = torch.randn(a.shape) * 10 ** (i - 2)  # gradients from 1e-2 to 10
            a.grad, b.grad = (None, None) if i == 2 else (g.clone(), g.clone())
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.data, b.data, rtol=1e-6, atol=1e-7)
    assert ours[2] not in opt.state


def _rules(model: nn.Module, optimizer: str = "muon") -> dict[int, str]:
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, optimizer=optimizer)
    return {id(p): group["split"] if group["algorithm"] == "muon" else "adamw"
            for group in opt.param_groups for p in group["params"]}


def _intended_split(name: str, p: torch.Tensor, cfg) -> str:
    """SPEC §6's blocks, written out by parameter name: KDA q/k/v by head rows and o_proj by head columns, MLA q and
    kv_b by head rows, routed experts one at a time; embeddings, LM head, vectors and conv kernels AdamW."""
    if "embed_tokens" in name or name == "lm_head.weight" or p.ndim < 2 or min(p.shape) == 1:
        return "adamw"
    layer = re.match(r"model\.layers\.(\d+)\.self_attn\.(\w+)\.weight$", name)
    mtp = re.match(r"mtp\.\d+\.block\.self_attn\.(\w+)\.weight$", name)
    if layer or mtp:
        mla = int(layer.group(1)) in cfg.mla_layers if layer else True  # MTP blocks use MLA
        proj = (layer or mtp).groups()[-1]
        if mla and proj in ("q_proj", "q_b_proj", "kv_b_proj"):
            return f"rows:{cfg.mla.num_heads}"
        if not mla and proj in ("q_proj", "k_proj", "v_proj"):
            return f"rows:{cfg.kda.num_heads}"
        if not mla and proj == "o_proj":
            return f"cols:{cfg.kda.num_heads}"
    if re.search(r"\.mlp\.experts\.(gate_up_proj|down_proj)$", name):
        return "experts"
    assert p.ndim == 2, name
    return "whole"


@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-linear-48b"])
def test_every_matrix_of_the_presets_gets_its_intended_blocks(preset):
    from openk3.config import get_preset
    from openk3.model import K3ForCausalLM

    cfg = get_preset(preset)
    with torch.device("meta"):  # kimi-linear-48b's 48B parameters take no memory on the meta device
        model = K3ForCausalLM(cfg)
    rule = _rules(model)
    params = dict(model.named_parameters())
    assert len(rule) == len(params)
    seen = set()
    for name, p in params.items():
        want = _intended_split(name, p, cfg)
        assert rule[id(p)] == want, (name, list(p.shape))
        seen.add(want.split(":")[0])
    assert seen == {"adamw", "whole", "rows", "cols", "experts"}
    assert set(_rules(model, "adamw").values()) == {"adamw"}


def test_a_wrong_block_declaration_fails_naming_it():
    class Declares(nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 6))
            self.e = nn.Parameter(torch.zeros(2, 4, 6))
            self.blocks = blocks

        def muon_blocks(self):
            return self.blocks

    with pytest.raises(ValueError, match="Declares.muon_blocks\\(\\) names 'v.weight', which is not a parameter"):
        _rules(nn.Sequential(Declares({"v.weight": "rows:2", "e": "experts"})))
    with pytest.raises(ValueError, match="unknown Muon split 'heads:2'"):
        _rules(nn.Sequential(Declares({"w": "heads:2", "e": "experts"})))
    with pytest.raises(ValueError, match="parameter 0.e \\[2, 4, 6\\] has more than two dimensions and no Muon split"):
        _rules(nn.Sequential(Declares({"w": "rows:2"})))


def test_k3_parameters_go_to_the_rule_and_split_the_spec_names():
    from openk3.config import get_preset
    from openk3.model import K3ForCausalLM

    cfg = get_preset("k3-tiny")
    model = K3ForCausalLM(cfg)
    rule = _rules(model)
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
