"""Distributed glue for the training loop: process group from torchrun's environment, gradient clipping over sharded
parameters, full (unsharded) state dicts.

The model knows nothing about distribution (DESIGN.md): `openk3.parallel.parallelize` applies expert parallel,
context parallel and FSDP2 from the outside, as torchtitan does. Under one process every function here is a no-op or
the plain single-process equivalent, so the training loop has a single code path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from openk3.parallel.ep import expert_modules, gather_experts, local_experts

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_world(device_type: str) -> World:
    """Join the process group torchrun describes (WORLD_SIZE > 1): NCCL on CUDA, gloo on CPU."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return World(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def close_world(world: World) -> None:
    """Leave the process group. The barrier first: a gloo rank that tears its connections down while a peer is still
    reading from them can abort that peer ("terminate called without an active exception")."""
    if world.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def raise_from_main(world: World, error: Exception | None) -> None:
    """Collective, a barrier too: `error`, rank 0's failure in work that rank 0 alone does (writing a checkpoint),
    raised on every rank as the same type with the same message. Otherwise the other ranks would fail in their next
    collective when rank 0 exits ("Connection closed by peer"), a traceback instead of the one line."""
    if world.distributed:
        box = [None if error is None else (type(error), str(error))]
        dist.broadcast_object_list(box, src=0)
        if error is None and box[0] is not None:
            kind, message = box[0]
            error = kind(message)
    if error is not None:
        raise error


def mean_across(world: World, value: float, device: torch.device) -> float:
    if not world.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / world.size


def average_across(world: World, values: torch.Tensor) -> torch.Tensor:
    """The mean of `values` over the ranks, as a new tensor; on a GPU queued behind the work that makes them
    (no host sync)."""
    values = values.detach().clone()
    if world.distributed:
        dist.all_reduce(values)
        values /= world.size
    return values


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most max_norm (as `nn.utils.clip_grad_norm_`: by
    min(1, max_norm / (norm + 1e-6))); returns the norm before clipping, a 0-d fp64 tensor on the gradients'
    device. No host sync: the optimizer's kernels queue behind the backward's while it runs.

    Works for any mix of plain and FSDP-sharded parameters on different meshes: every gradient element is held by
    exactly one rank (FSDP shards; expert-parallel experts are split over their group and sharded over the ranks
    that hold the same experts), so the squared norm is the sum over ranks of the local shards' squares (each
    shard's norm by `torch._foreach_norm`, fused per device and dtype; their squares summed in fp64)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    device = local[0].device if local else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float64, device=device)
    if local:  # the foreach kernels group the tensors by device and dtype themselves
        square += torch.stack(torch._foreach_norm(local)).double().square().sum()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(square)
    norm = square.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
    if local:
        torch._foreach_mul_(local, coef)
    return norm


def _expert_params(model: nn.Module) -> dict[str, tuple[torch.Tensor, object]]:
    """Name -> (parameter, its expert-parallel group) for every expert-parallel expert tensor."""
    return {f"{name}.{leaf}": (getattr(m, leaf), m.expert_parallel)
            for name, m in expert_modules(model).items() for leaf in ("gate_up_proj", "down_proj")}


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict on rank 0, whatever the layout (collective: every rank must call it). Expert-parallel
    experts are gathered into the full [E, ...] tensors one process has, so checkpoints do not depend on --ep."""
    state = get_model_state_dict(model, options=FULL)
    for name, (param, ep) in _expert_params(model).items():
        full = gather_experts(param, ep)
        if name in state:
            state[name] = full.cpu()
    return state


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Unsharded optimizer state on rank 0 (collective), expert tensors gathered as in `full_model_state`."""
    state = get_optimizer_state_dict(model, optimizer, options=FULL)
    for name, (param, ep) in _expert_params(model).items():
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                full = gather_experts(value, ep)
                if name in state.get("state", {}):
                    state["state"][name][key] = full.cpu()
    return state


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    """Load full (unsharded) states on every rank; FSDP keeps each rank's shard, expert parallel its experts."""
    model_state, optim_state = dict(model_state), {**optim_state, "state": dict(optim_state.get("state", {}))}
    for name, (_, ep) in _expert_params(model).items():
        experts = model_state[name].shape[0]
        model_state[name] = local_experts(model_state[name], ep)
        if name in optim_state["state"]:
            optim_state["state"][name] = {
                key: local_experts(v, ep) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == experts else v
                for key, v in optim_state["state"][name].items()}
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)
