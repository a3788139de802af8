"""Expert parallel against one process, in 4 real processes (gloo): outputs and every gradient of a LatentMoE layer.

Each rank routes its own tokens; the reference is the single-process layer on all ranks' tokens. Routings: skewed
(one expert receives half of all token-expert rows: every token picks it), everything to one home rank (under the
static plan the other ranks compute nothing, and must still take part in every backward collective), and the
natural routing of the random router. The balanced planner must give every rank exactly S x K rows.
"""

import copy

import torch
import torch.distributed as dist

from distributed_spawn import assert_close, run_ranks
from openk3.config import ModelConfig
from openk3.model.moe import MoE
from openk3.parallel.ep import ExpertParallel, gather_experts, local_experts, shard_experts

TOL = 1e-5
TOKENS, WORLD = 12, 4  # tokens per rank
CFG = ModelConfig().with_overrides({"hidden_size": 16, "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 8,
                                                              "num_shared_experts": 1, "latent_dim": 8}})
ROUTINGS = {"natural": {}, "hot expert": {5: 10.0}, "one home rank": {0: 10.0, 1: 10.0}}


def _check(rank, world, planner, bias):
    torch.manual_seed(0)
    moe = MoE(CFG)
    with torch.no_grad():
        for expert, value in bias.items():
            moe.gate.e_score_correction_bias[expert] = value
    x = torch.randn(world, TOKENS, CFG.hidden_size, generator=torch.Generator().manual_seed(3))
    weight = torch.randn(world, TOKENS, CFG.hidden_size, generator=torch.Generator().manual_seed(4))
    x_ref = x.clone().requires_grad_()
    out_ref = moe(x_ref.view(1, -1, CFG.hidden_size)).view_as(x)
    (out_ref * weight).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}

    ep = ExpertParallel(dist.group.WORLD, rank, world, planner)
    local = copy.deepcopy(moe)
    local.zero_grad()
    shard_experts(local.experts, ep)
    x_local = x[rank:rank + 1].clone().requires_grad_()
    out = local(x_local)
    (out * weight[rank]).sum().backward()
    where = f"{planner} planner, {bias or 'natural'} routing, rank {rank}"
    assert_close(out.detach(), out_ref[rank:rank + 1].detach(), TOL, f"{where}: output")
    assert_close(x_local.grad, x_ref.grad[rank:rank + 1], TOL, f"{where}: input gradient")
    for name, p in local.named_parameters():
        if name.startswith("experts."):  # a home rank's experts collect every rank's gradient already
            assert_close(p.grad, local_experts(grads[name], ep), TOL, f"{where}: d{name}")
            assert torch.equal(gather_experts(p, ep), getattr(moe.experts, name.split(".")[1]))
        else:
            dist.all_reduce(p.grad)
            assert_close(p.grad, grads[name], TOL, f"{where}: d{name}")
    return local.experts.rows_computed


def _worker(rank, world):
    hot_rows = None
    for name, bias in ROUTINGS.items():
        assert _check(rank, world, "balanced", bias) == TOKENS * CFG.moe.top_k, name  # exactly S x K per rank
        static = torch.tensor([_check(rank, world, "static", bias)])
        dist.all_reduce(static, op=dist.ReduceOp.MAX)
        if name == "hot expert":
            hot_rows = int(static)
    assert hot_rows >= world * TOKENS  # the hot expert's home rank alone computes at least half of all rows


def test_expert_parallel_matches_one_process_and_balances():
    run_ranks(_worker, WORLD)
