"""KDA context parallel and MLA under context parallel against one process, in 2 and 4 real processes (gloo).

Layers: each rank holds a contiguous slice of one packed stream; its outputs, its input gradients (every rank, not
only the last) and the parameter gradients summed over the ranks must equal the single-process layer run on each
document alone, to 1e-10 in fp64 (exact up to rounding; in fp32 the cancelling sum that is dt_bias's gradient
alone moves by up to ~1e-5 between two summation orders). The layouts cover the traps of SPEC §10: a document
crossing 2 and 3 rank boundaries, a document boundary exactly at a rank boundary, ranks holding fewer than W-1 = 3
tokens (so a conv halo comes from two earlier ranks), a rank lying wholly inside a document, a rank that both
receives and hands on a state with a document boundary between.
Model: the whole tiny model (KDA + MLA + MoE + Block AttnRes + MTP) through `parallelize_cp` and `cp_lm_losses`
gives the single-process loss, every parameter gradient and the routers' balancing statistics, to 1e-5 in fp32.
"""

import math

import torch
import torch.distributed as dist

from distributed_spawn import assert_close, run_ranks
from openk3.config import ModelConfig
from openk3.model import K3ForCausalLM
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA
from openk3.ops.kda import kda
from openk3.parallel import SequenceSplit, cp_lm_losses, parallelize_cp
from openk3.parallel.kcp import kcp_kda, kda_layer_forward
from openk3.parallel.mla import mla_layer_forward
from openk3.train.loop import lm_losses
from train_tiny import TINY

TOL, TOL_FP64 = 1e-5, 1e-10
LAYER = ModelConfig().with_overrides({
    "hidden_size": 16, "num_layers": 1, "mla_layers": [], "moe": None, "kda": {"num_heads": 2, "head_dim": 8},
    "mla": {"num_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
            "v_head_dim": 4}})

CASES = {  # world -> (document lengths, rank bounds)
    2: [
        ((40,), (0, 23, 40)),  # one document across the boundary
        ((10, 14, 16), (0, 24, 40)),  # a document boundary exactly at the rank boundary
        ((30,), (0, 2, 30)),  # rank 0 holds 2 < W-1 tokens
        ((1, 29), (0, 2, 30)),  # ... and the halo of rank 1 is 1 token long
    ],
    4: [
        ((50,), (0, 11, 25, 38, 50)),  # one document across 3 boundaries
        ((5, 30, 15), (0, 9, 11, 35, 50)),  # across 2 boundaries through a 2-token rank; a boundary at 35
        ((3, 17), (0, 1, 2, 3, 20)),  # 1-token ranks: rank 3's halo comes from ranks 0-2 ... and none of it is used
        ((2, 21, 7), (0, 1, 2, 22, 30)),  # rank 2 starts a document that ends 1 token into rank 3
        # rank 1 lies inside a document that rank 2 ends before starting one that goes on into rank 3, which holds
        # a boundary too: rank 0's terminal gradient folds ranks 1 and 2, rank 2 both receives and sends
        ((4, 20, 16, 10), (0, 10, 14, 30, 50)),
    ],
}


def _reference(layer, x, lengths):
    """The plain layer on each document alone; returns (output, d output-weighted loss / d x, parameter grads)."""
    x = x.detach().requires_grad_()
    layer.zero_grad()
    out = torch.cat([layer(piece) for piece in x.split(list(lengths), dim=1)], dim=1)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    (out * weight).sum().backward()
    return out.detach(), weight, x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _check_layer(layer, forward, lengths, bounds, rank):
    split = SequenceSplit((0, *[sum(lengths[:i + 1]) for i in range(len(lengths))]), bounds)
    x = torch.randn(1, split.total, layer.o_proj.out_features, generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64)
    out, weight, dx, grads = _reference(layer, x, lengths)
    lo, hi = bounds[rank], bounds[rank + 1]
    layer.zero_grad()
    x_local = x[:, lo:hi].clone().requires_grad_()
    out_local = forward(layer, x_local, split, rank, dist.group.WORLD)
    (out_local * weight[:, lo:hi]).sum().backward()
    where = f"{type(layer).__name__} docs {lengths} bounds {bounds} rank {rank}"
    assert_close(out_local.detach(), out[:, lo:hi], TOL_FP64, f"{where}: output")
    assert_close(x_local.grad, dx[:, lo:hi], TOL_FP64, f"{where}: input gradient")
    for name, p in layer.named_parameters():
        dist.all_reduce(p.grad)
        assert_close(p.grad, grads[name], TOL_FP64, f"{where}: d{name}")


def _layers_worker(rank, world):
    torch.manual_seed(0)
    kda_layer, mla_layer = KimiDeltaAttention(LAYER, 0).double(), GatedMLA(LAYER, 0).double()
    with torch.no_grad():  # O(1) gates and decays, so the carried state matters
        kda_layer.A_log.uniform_(-2.0, 0.5)
        kda_layer.f_b_proj.weight.mul_(20.0)
    for lengths, bounds in CASES[world]:
        _check_layer(kda_layer, kda_layer_forward, lengths, bounds, rank)
        _check_layer(mla_layer, mla_layer_forward, lengths, bounds, rank)


def _gather_rows(x):
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, x.shape[0])
    parts = [x.new_zeros(max(sizes), *x.shape[1:]) for _ in sizes]
    dist.all_gather(parts, torch.cat([x, x.new_zeros(max(sizes) - x.shape[0], *x.shape[1:])]))
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def _model_worker(rank, world):
    torch.manual_seed(0)
    cfg = ModelConfig().with_overrides(TINY)
    model = K3ForCausalLM(cfg)
    batch = torch.randint(0, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(2))  # 3 windows x 10
    loss, lm, mtp = lm_losses(model, batch, 0.3)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    scores = {i: r.last_scores.clone() for i, r in model.routers()}
    model.zero_grad()

    cp = parallelize_cp(model, dist.group.WORLD)
    loss_cp, lm_cp, mtp_cp = cp_lm_losses(model, batch, 0.3, cp)
    loss_cp.backward()
    values = torch.tensor([float(loss_cp.detach()), float(lm_cp), float(mtp_cp)]) / world
    dist.all_reduce(values)
    assert_close(values, torch.tensor([float(loss), float(lm), float(mtp)]), TOL, f"rank {rank}: losses")
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        assert_close(p.grad / world, grads[name], TOL, f"rank {rank}: d{name}")
    for i, router in model.routers():  # the MTP router (i = num_layers) sees only positions with a target
        assert_close(_gather_rows(router.last_scores), scores[i], TOL, f"rank {rank}: router {i} scores")
    assert mtp is not None and math.isfinite(float(mtp))
    # without an active batch the wrappers are the plain forwards: evaluation and decoding per rank
    with torch.no_grad():
        plain = model(batch[:1, :-1]).logits
        cache = model.new_cache(1)
        model(batch[:1, :5], cache=cache)
        step = model(batch[:1, 5:6], cache=cache).logits
    assert_close(step[0, -1], plain[0, 5], 1e-4, "decode through the wrapped model")


TRITON_CASES = {  # world -> (document bounds, rank bounds, tokens per piece of the exchange's passes)
    2: [((0, 5, 24), (0, 13, 24), None),  # rank 0's second document continues on rank 1
        ((0, 70), (0, 37, 70), 16)],  # pieces of whole chunks, the last ones short (5 and 1 tokens)
    # rank 1 lies inside a document (it receives and hands on a state), rank 2 ends it and starts one that rank
    # 3 ends: its head and tail are different sequences, each cut into pieces
    4: [((0, 5, 65, 80), (0, 20, 45, 70, 80), 16)],
}


def _triton_worker(rank, world):
    """kcp_kda on the Triton kernels (the interpreter on CPU; the exchanges inside the kernels,
    `kda_triton_exchange`) against one process's chunked KDA, fp32."""
    for cu, bounds, piece in TRITON_CASES[world]:
        split = SequenceSplit(cu, bounds)
        n = cu[-1]
        gen = torch.Generator().manual_seed(n)
        q, k = torch.randn(1, n, 1, 16, generator=gen), torch.randn(1, n, 1, 16, generator=gen)
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        v, g = torch.randn(1, n, 1, 16, generator=gen), -0.1 * torch.rand(1, n, 1, 16, generator=gen)
        beta, weight = torch.rand(1, n, 1, generator=gen), torch.randn(1, n, 1, 16, generator=gen)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        out, _ = kda(*leaves, cu_seqlens=torch.tensor(split.cu_seqlens), backend="chunked")
        expected = (out, *torch.autograd.grad((out * weight).sum(), leaves))
        lo, hi = split.bounds[rank], split.bounds[rank + 1]
        local = [t[:, lo:hi].clone().requires_grad_() for t in (q, k, v, g, beta)]
        out = kcp_kda(*local, split, rank, dist.group.WORLD, backend="triton", piece=piece)
        got = (out, *torch.autograd.grad((out * weight[:, lo:hi]).sum(), local))
        for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, expected):
            assert_close(a.detach(), b[:, lo:hi].detach(), 1e-4, f"triton, {bounds}, rank {rank}: {name}")


def _two_process_worker(rank, world):
    _layers_worker(rank, world)
    _model_worker(rank, world)
    _triton_worker(rank, world)


def _four_process_worker(rank, world):
    _layers_worker(rank, world)
    _triton_worker(rank, world)


def test_kcp_mla_and_the_model_two_processes():
    run_ranks(_two_process_worker, 2)


def test_kcp_and_mla_layers_four_processes():
    run_ranks(_four_process_worker, 4)
