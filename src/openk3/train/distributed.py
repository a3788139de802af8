"""Data parallelism glue: process group from torchrun's environment, FSDP2 sharding, full state dicts.

The model knows nothing about distribution (DESIGN.md): `shard_model` applies `fully_shard` from the outside, as
torchtitan does. Under one process every function here is a
no-op or the plain single-process equivalent, so the training loop has a single code path.
"""

from __future__ import annotations

import os
import warnings
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
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def mean_across(world: World, value: float, device: torch.device) -> float:
    if not world.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / world.size


def shard_model(model: nn.Module) -> None:
    """FSDP2 units: each token mixer and FFN of a decoder layer, each MTP layer's block, and the root (the rest).

    The units are the sublayers rather than whole decoder layers because a Block AttnRes layer is driven through
    `forward_block(stream)`, which takes and returns no tensors; FSDP's hooks need tensors in and out to gather
    parameters before forward and again before backward. The sublayers are ordinary tensor-to-tensor modules.
    """
    from torch.distributed.fsdp import fully_shard

    # The MoE returns a view (`y.view(shape)`). FSDP warns that an in-place op on it would skip its pre-backward
    # hook; the decoder only ever adds sublayer outputs out of place (`h + f(h)`, `partial + h`), so it is safe.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for layer in model.model.layers:
        fully_shard(layer.self_attn)
        fully_shard(layer.mlp)
    for layer in model.mtp or []:
        fully_shard(layer.block)  # not the whole MTP layer: its final norm is applied outside its forward
    fully_shard(model)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict (collective under FSDP: every rank must call it)."""
    return get_model_state_dict(model, options=FULL)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return get_optimizer_state_dict(model, optimizer, options=FULL)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    """Load full (unsharded) states on every rank; FSDP keeps each rank's shard."""
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)
