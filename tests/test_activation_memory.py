"""What the training forward keeps for backward: the shared autocast copy of the MoE input, Block AttnRes
recomputing its merge and the pre-norm in backward (gradients unchanged), and bench/activation_memory.py's count
of the KDA core (against the Triton Function under the interpreter) and its attribution of saved bytes."""

import importlib.util
from pathlib import Path

import pytest
import torch

import openk3.model.attnres as attnres
from openk3.config import get_preset
from openk3.model import K3ForCausalLM
from openk3.model.common import shared_cast
from openk3.model.moe import MoE
from saved_tensors import saved_bytes, saved_storages
from test_ops_attnres import spread_attnres

BENCH = Path(__file__).resolve().parents[1] / "bench" / "activation_memory.py"
TINY = {"hidden_size": 48, "num_layers": 5, "mla_layers": [2], "attn_res_block_size": 2, "mtp_layers": 1,
        "kda": {"num_heads": 2, "head_dim": 16}, "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 24,
                                                          "num_shared_experts": 1, "latent_dim": 32}}


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_activation_memory", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def separate_casts_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """MoE.forward with a product of its own for each Linear that reads x, each casting x for itself."""
    flat = x.reshape(-1, x.shape[-1])
    y = moe.routed_up(moe.latent_norm(moe.experts(moe.routed_down(flat), moe.gate(flat))))
    shared = moe.shared_experts
    return (y + shared.down_proj(shared.act(shared.gate_proj(flat), shared.up_proj(flat)))).view(x.shape)


def test_shared_cast_gradients_sum_in_the_input_dtype():
    """Views of one bf16 copy; the gradient is the fp32 sum of the consumers' gradients (as separate casts
    give), None where a consumer gives none; without autocast x itself."""
    x = torch.randn(7, 5, requires_grad=True)
    assert all(t is x for t in shared_cast(x, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        views = shared_cast(x, 3)
    assert all(v.dtype == torch.bfloat16 and v.untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()
               for v in views)
    g = [torch.randn(7, 5, dtype=torch.bfloat16) for _ in range(2)]
    torch.autograd.backward([views[0], views[2]], g)
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, g[0].float() + g[1].float())


def test_moe_keeps_one_copy_of_its_input_under_autocast():
    """k3-tiny's MoE under CPU bf16 autocast: routed_down and the shared expert's gate and up projections as one
    product give the output of three products to the bit and every parameter's gradient to fp32 rounding; the
    input's gradient to bf16 rounding (one bf16 product where three were rounded and then summed); and one [N, D]
    bf16 copy of the input is kept where the three products kept three (the router reads the fp32 input itself)."""
    torch.manual_seed(0)
    cfg = get_preset("k3-tiny")
    moe = MoE(cfg)
    x = torch.randn(3, 11, cfg.hidden_size) * 2
    dy = torch.randn(3, 11, cfg.hidden_size)
    runs = []
    for fn in (moe, lambda t: separate_casts_moe(moe, t)):
        moe.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kept = saved_storages(lambda f, t: runs.append(f(t)), fn, xi, exclude=list(moe.parameters()))
        runs[-1].backward(dy.to(runs[-1].dtype))
        copies = [s for dtype, s, _ in kept if dtype == torch.bfloat16 and s == (33, cfg.hidden_size)]
        runs[-1] = (runs[-1].detach(), xi.grad, {n: p.grad.clone() for n, p in moe.named_parameters()
                                                if p.grad is not None}, len(copies))
    (y, gx, gp, copies), (y0, gx0, gp0, copies0) = runs
    assert torch.equal(y, y0) and (copies, copies0) == (1, 3)
    assert float((gx - gx0).norm() / gx0.norm()) < 2**-8
    assert gp.keys() == gp0.keys()
    for name in gp:
        torch.testing.assert_close(gp[name], gp0[name], rtol=1e-5, atol=1e-6, msg=name)


def _loss_and_grads(model, ids, autocast: bool):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids)
        loss = out.logits.float().logsumexp(-1).mean() + out.mtp_logits.float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("autocast", [False, True])
def test_attnres_recompute_keeps_gradients_to_the_bit(monkeypatch, autocast):
    """Block AttnRes with phase 2 and the pre-norm recomputed in backward against the same stream run straight
    through (the checkpoint replaced by a plain call): loss and every parameter's gradient identical to the bit,
    fp32 and under bf16 autocast; the recomputing stream keeps fewer bytes, at least the merged fp32 inputs of
    the pre-norms (4 bytes x width x tokens each)."""
    cfg = get_preset("k3-tiny").with_overrides(TINY)
    torch.manual_seed(1)
    model = K3ForCausalLM(cfg)
    spread_attnres(model, std=0.3, norms=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    params = list(model.parameters())
    recomputed = _loss_and_grads(model, ids, autocast)
    kept = saved_bytes(lambda: _loss_and_grads(model, ids, autocast), exclude=params)
    monkeypatch.setattr(attnres, "checkpoint", lambda fn, *args, **kwargs: fn(*args))
    straight = _loss_and_grads(model, ids, autocast)
    kept_straight = saved_bytes(lambda: _loss_and_grads(model, ids, autocast), exclude=params)
    assert torch.equal(recomputed[0], straight[0]) and recomputed[1].keys() == straight[1].keys()
    for name in straight[1]:
        assert torch.equal(recomputed[1][name], straight[1][name]), name
    merged_inputs = 2 * cfg.num_layers - 1  # every sublayer but layer 0's attention reads a merge
    assert kept_straight - kept >= merged_inputs * 4 * cfg.hidden_size * ids.numel()


def test_kda_core_count_is_what_the_triton_function_saves():
    """kda_core_bytes_per_token against the bytes the Triton KDA Function keeps (run by Triton's interpreter on
    CPU, where its states are fp32), bf16 q, k, v and fp32 g, beta, T a multiple of the 16-token chunk."""
    from openk3.ops.kda.triton import kda_triton

    bench = load_bench()
    B, T, H, K, V = 1, 32, 2, 16, 8
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, T, H, d, generator=g).to(torch.bfloat16).requires_grad_() for d in (K, K, V))
    gate = (-torch.rand(B, T, H, K, generator=g)).requires_grad_()
    beta = torch.rand(B, T, H, generator=g).requires_grad_()
    kept = saved_bytes(lambda: kda_triton(q, k, v, gate, beta, gate_min=-5.0))
    assert kept == B * T * bench.kda_core_bytes_per_token(H, K, V, operand_bytes=2, state_bytes=4)


def test_census_attributes_every_saved_byte():
    """The bench's census on a small k3: every kind it reports sums to what the hooks saw (weight copies apart),
    the KDA core replaced by its count, the per-token slope positive where the module kind exists, and autocast's
    weight copies recognised as such."""
    bench = load_bench()
    cfg = get_preset("k3-tiny").with_overrides(TINY)
    small, large = bench.k3_census(cfg, 1, 16), bench.k3_census(cfg, 1, 32)
    slope = bench.per_token(small, large)["per_token"]
    for kind in (bench.NORMS, bench.KDA_PROJ, bench.KDA_CORE, bench.MLA_PROJ, bench.ATTN_CORE, bench.ROUTER,
                 bench.DISPATCH, bench.EXPERTS, bench.SHARED, bench.LATENT, bench.FFN, bench.STREAM, bench.HEAD,
                 bench.MTP):
        assert slope[kind] > 0, kind
    assert slope[bench.ATTN_PROJ] == 0 and large["weight_copies"] > 0
    K = cfg.kda_head_dim
    assert large["kinds"][bench.KDA_CORE] == 32 * len(cfg.kda_layers) * bench.kda_core_bytes_per_token(
        cfg.kda.num_heads, K, K, 2, 2)
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.functional.linear(x * 2, w)
    assert sorted(bench.is_weight_copy(t) for t in saved) == [False, True]  # the cast of x * 2, that of w
