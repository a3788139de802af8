"""Expert parallelism (SPEC §10): the routed experts of every MoE layer split over the ranks of a group.

`parallelize_ep(model, group)` keeps, on rank h, experts [h m, (h+1) m) (m = E / R) of each `Experts` module (the
parameters keep their names, with m rows instead of E) and replaces its forward; routers, shared experts and the
latent projections stay replicated. Per MoE layer and step:
  1. all-gather the tokens-per-expert table [R, E] (no gradient) and plan where each token-expert row is computed
     (`planner.plan_balanced`, MoonEP: exactly S x K rows per rank, with replicas; or `plan_static`: every row to
     its expert's home rank). Every rank computes the same plan from the same table.
  2. dispatch: one all_to_all_single of the rows (the hidden vector of each token-expert pair, grouped by
     destination rank, then slot), and in the same autograd node the weights of the replicas each rank computes,
     fetched from their home ranks. Backward returns row gradients to their sources and replica weight gradients
     to the home ranks, where they add to the expert's own gradient.
  3. `openk3.ops.moe.grouped_glu_mlp` over the received rows grouped by slot (own experts, then replicas; empty
     slots have zero rows and zero weights, so the shapes depend only on m).
  4. combine: all_to_all_single back and sum_k w[n,k] y[n,k] in fp32 (as `experts_forward`).
The numbers equal one process's `Experts.forward` up to the order of floating-point sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from openk3.model.moe import Experts
from openk3.ops.moe import Routing, grouped_glu_mlp
from openk3.ops.norms import acc_dtype
from openk3.parallel.comm import all_gather_padded, exchange
from openk3.parallel.planner import PLANNERS, EPPlan
from openk3.quant.qat import FakeQuantExperts


@dataclass(frozen=True)
class ExpertParallel:
    """The group the experts are split over, this rank's index in it, and the planner ("balanced" | "static").

    average_gradients: an expert's gradient sums the loss terms of every rank of the group; divide it by the group
    size, so that it is the mean over the group's ranks as data parallelism takes it for every other parameter
    (training: each rank's loss is its own mean, and FSDP averages over the ranks that hold the same experts).
    Off, the gradient is that of the sum of the ranks' losses."""

    group: object
    rank: int
    size: int
    planner: str = "balanced"
    average_gradients: bool = False

    def __post_init__(self) -> None:
        if self.planner not in PLANNERS:
            raise ValueError(f"expert-parallel planner must be one of {sorted(PLANNERS)}, got {self.planner!r}")

    def own(self, num_experts: int) -> slice:
        m = num_experts // self.size
        return slice(self.rank * m, (self.rank + 1) * m)


def _rows_per_rank(seg_rank: np.ndarray, rows: np.ndarray, ranks: int) -> list[int]:
    return np.bincount(seg_rank, weights=rows, minlength=ranks).astype(np.int64).tolist()


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _replica_weights(gate_up: torch.Tensor, down: torch.Tensor, plan: EPPlan, ep: ExpertParallel):
    """What this rank sends (its experts that other ranks replicate, grouped by destination) and receives (its
    replicas, by ascending expert id = by home rank, then slot)."""
    m = plan.experts_per_rank
    send_local, send_counts = [], []
    for d in range(ep.size):
        mine = [int(e) - ep.rank * m for e in plan.replicas(d) if e // m == ep.rank]
        send_local += mine
        send_counts.append(len(mine))
    recv_counts = np.bincount(plan.replicas(ep.rank) // m, minlength=ep.size).tolist()
    flat = torch.cat([gate_up.flatten(1), down.flatten(1)], dim=1)  # [m, P]
    send = flat[torch.tensor(send_local, dtype=torch.long, device=flat.device)]
    return send, send_counts, recv_counts


def _slot_weights(gate_up: torch.Tensor, down: torch.Tensor, received: torch.Tensor | None, m: int):
    """gate_up [slots, 2I, D], down [slots, D, I]: own experts, then the received replicas, zero-padded to m."""
    if received is None:
        return gate_up, down
    padded = torch.cat([received, received.new_zeros(m - received.shape[0], received.shape[1])])
    split = gate_up[0].numel()
    return (torch.cat([gate_up, padded[:, :split].view(m, *gate_up.shape[1:])]),
            torch.cat([down, padded[:, split:].view(m, *down.shape[1:])]))


def ep_experts_forward(experts: Experts, ep: ExpertParallel, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """`Experts.forward` over the group (module docstring): x [N, Din] -> [N, Dout]."""
    if isinstance(experts, FakeQuantExperts):  # --qat: what the class's forward, replaced here, would apply
        x = experts.quantized_input(x)
    N, K = routing.indices.shape
    E, R, rank = experts.num_experts, ep.size, ep.rank
    m = E // R
    flat = routing.indices.reshape(-1)
    local_counts = torch.bincount(flat, minlength=E).unsqueeze(0)
    counts = all_gather_padded(local_counts, [1] * R, ep.group).cpu().numpy()
    plan = PLANNERS[ep.planner](counts)
    slots = plan.slot_expert.shape[1]
    device = x.device
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if ep.average_gradients:
        gate_up, down = _ScaleGradient.apply(gate_up, 1 / R), _ScaleGradient.apply(down, 1 / R)

    # rows sorted by expert fill the segments in `by_expert` order; send them grouped by (destination, slot)
    fill = plan.by_expert()
    mine = torch.from_numpy(plan.seg_rows[rank, fill]).to(device)
    seg_key = torch.from_numpy((plan.seg_rank * slots + plan.seg_slot)[fill]).to(device)
    by_expert = torch.argsort(flat, stable=True)
    row_key = torch.repeat_interleave(seg_key, mine)
    rows = by_expert[torch.argsort(row_key, stable=True)]  # flat (token, k) ids in send order
    send_counts = _rows_per_rank(plan.seg_rank, plan.seg_rows[rank], R)
    to_me = np.flatnonzero(plan.seg_rank == rank)
    to_me = to_me[np.argsort(plan.seg_slot[to_me], kind="stable")]
    from_each = plan.seg_rows[:, to_me]  # [R sources, my segments by slot]
    recv_counts = from_each.sum(1).tolist()

    items = [(x[rows // K], send_counts, recv_counts)]
    has_replicas = slots > m and bool((plan.slot_expert[:, m:] >= 0).any())  # the same answer on every rank
    if has_replicas:
        items.append(_replica_weights(gate_up, down, plan, ep))
    received = exchange(items, ep.group)
    x_recv = received[0]

    # received rows are grouped by source, then slot: regroup by slot for the grouped GEMM
    recv_slot = torch.from_numpy(np.repeat(np.tile(plan.seg_slot[to_me], R), from_each.reshape(-1))).to(device)
    by_slot = torch.argsort(recv_slot, stable=True)
    slot_counts = torch.bincount(recv_slot, minlength=slots)
    slot_gate_up, slot_down = _slot_weights(gate_up, down, received[1] if has_replicas else None, m)
    y_sorted = grouped_glu_mlp(x_recv[by_slot], slot_counts, slot_gate_up, slot_down, experts.act)
    y_recv = y_sorted[torch.argsort(by_slot)]
    # anchors: this rank may have received no rows, or used some of its experts for none
    (y,) = exchange([(y_recv, recv_counts, send_counts)], ep.group, anchors=(x_recv, slot_gate_up, slot_down))
    experts.rows_computed = int(x_recv.shape[0])  # S x K under the balanced planner (read by tests and benchmarks)

    acc = acc_dtype(x.dtype)
    out = torch.zeros(N, y.shape[-1], dtype=acc, device=device)
    weights = routing.weights.reshape(-1)[rows].unsqueeze(-1)
    out.index_add_(0, rows // K, y.to(acc) * weights.to(acc))
    return out.to(x.dtype)


def shard_experts(experts: Experts, ep: ExpertParallel) -> None:
    """Keep this rank's experts and route the module's forward through the group."""
    E = experts.num_experts
    if E % ep.size:
        raise ValueError(f"moe.num_experts={E} must be divisible by the expert-parallel size (--ep {ep.size})")
    own = ep.own(E)
    for name in ("gate_up_proj", "down_proj"):  # the registered masters (under QAT the attributes are quantized)
        setattr(experts, name, torch.nn.Parameter(experts._parameters[name].detach()[own].clone()))
    experts.expert_parallel = ep
    experts.forward = partial(ep_experts_forward, experts, ep)


def expert_modules(model: torch.nn.Module) -> dict[str, Experts]:
    """Name -> every expert-parallel `Experts` module of the model."""
    return {name: m for name, m in model.named_modules() if getattr(m, "expert_parallel", None) is not None}


def parallelize_ep(model: torch.nn.Module, group, *, planner: str = "balanced", average_gradients: bool = True) -> None:
    """Split every MoE layer's routed experts over `group` (decoder and MTP layers alike); `ExpertParallel` explains
    `average_gradients` (the training default)."""
    ep = ExpertParallel(group, dist.get_rank(group), dist.get_world_size(group), planner, average_gradients)
    for module in list(model.modules()):
        if isinstance(module, Experts):
            shard_experts(module, ep)


# ---- full (unsplit) expert tensors for checkpoints ---------------------------------------------------------------

def gather_experts(local: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """This rank's rows [m, ...] of an expert tensor (a plain tensor or an FSDP DTensor) -> all E rows, on every rank
    (collective over the expert-parallel group)."""
    if hasattr(local, "full_tensor"):
        local = local.full_tensor()
    local = local.detach()
    return all_gather_padded(local, [local.shape[0]] * ep.size, ep.group)


def local_experts(full: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """All E rows of an expert tensor -> this rank's [m, ...]."""
    return full[ep.own(full.shape[0])]
