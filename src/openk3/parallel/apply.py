"""`parallelize`: expert parallel, context parallel and FSDP2 applied to a plain K3ForCausalLM, in that order.

Layout of N processes (torchrun): rank = dp_index * cp + cp_index.
  - context parallel: the cp consecutive ranks of a data-parallel index share that index's windows, packed into one
    stream and split contiguously (`cp.cp_lm_losses`);
  - data parallel: N / cp indices, each taking batch_size / (N / cp) windows of the global batch;
  - expert parallel: groups of ep consecutive ranks split the routed experts (each rank of a group holds different
    tokens, whether they differ by data-parallel or context-parallel index);
  - FSDP2 shards every parameter over all N ranks (they all hold the same model) and averages its gradient over
    them, except the routed experts, which are sharded over the N / ep ranks that hold the same experts and averaged
    over those; the expert-parallel forward has already divided their gradient (a sum over the ep ranks of the
    group) by ep, so it too ends up the mean over all N ranks.
So the loss and every gradient are those of one process on the same global batch, whatever the layout.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from openk3.parallel.cp import ContextParallel, parallelize_cp
from openk3.parallel.ep import expert_modules, parallelize_ep
from openk3.parallel.planner import PLANNERS


@dataclass(frozen=True)
class ParallelDims:
    """world = processes; cp = context-parallel size; ep = expert-parallel size; data parallel = world / cp."""

    world: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for flag, value in (("--cp", self.cp), ("--ep", self.ep)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
            if self.world % value:
                raise ValueError(f"{flag} {value} must divide the number of processes ({self.world}; run under "
                                 f"torchrun --nproc-per-node with a multiple of {value})")

    @property
    def dp(self) -> int:
        return self.world // self.cp

    def check_batch(self, batch_size: int, seq_len: int | None = None) -> None:
        """The global batch splits over the data-parallel ranks, and each index's stream of windows (seq_len
        tokens each) over its context-parallel ranks, every one holding at least one token."""
        if batch_size % self.dp:
            raise ValueError(f"--batch-size {batch_size} (global) must divide by the {self.dp} data-parallel ranks "
                             f"({self.world} processes / --cp {self.cp})")
        tokens = batch_size // self.dp * (seq_len or self.cp)
        if tokens < self.cp:
            raise ValueError(f"--cp {self.cp}: each data-parallel index's {batch_size // self.dp} window(s) of "
                             f"--seq-len {seq_len} hold {tokens} token(s), fewer than its {self.cp} context-parallel "
                             "ranks; raise --seq-len or --batch-size")


@dataclass
class Parallel:
    """What the training loop needs from the layout: its rows of the global batch, and the context-parallel handle
    (None without context parallelism)."""

    dims: ParallelDims
    rank: int = 0
    cp: ContextParallel | None = None

    def data_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's windows of the global batch [batch_size, ...]: its data-parallel index's share."""
        per = batch.shape[0] // self.dims.dp
        index = self.rank // self.dims.cp
        return batch[index * per:(index + 1) * per]


def apply_fsdp(model: nn.Module, mesh, expert_mesh) -> None:
    """FSDP2 units: each token mixer and FFN of a decoder layer, each MTP layer's block, the root; expert-parallel
    experts are their own units on `expert_mesh` (module docstring)."""
    from torch.distributed.fsdp import fully_shard

    # The MoE returns a view (`y.view(shape)`). FSDP warns that an in-place op on it would skip its pre-backward
    # hook; the decoder only ever adds sublayer outputs out of place (`h + f(h)`, `partial + h`), so it is safe.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

    def shard(module: nn.Module) -> None:
        for experts in expert_modules(module).values():
            fully_shard(experts, mesh=expert_mesh)
        fully_shard(module, mesh=mesh)

    for layer in model.model.layers:
        shard(layer.self_attn)
        shard(layer.mlp)
    for layer in model.mtp or []:
        shard(layer.block)  # not the whole MTP layer: its final norm is applied outside its forward
    fully_shard(model, mesh=mesh)


def parallelize(model: nn.Module, dims: ParallelDims, rank: int, device_type: str, *, ep_planner: str = "balanced",
                activation_checkpointing: bool = False) -> Parallel:
    """Apply the layout to `model` (in place) and return the handle the training loop uses. One process: nothing
    to apply. `activation_checkpointing`: the loop already wrapped the sublayers; the context-parallel forwards
    then checkpoint themselves too."""
    if ep_planner not in PLANNERS:
        raise ValueError(f"--ep-planner must be one of {sorted(PLANNERS)}, got {ep_planner!r}")
    if dims.world == 1:
        return Parallel(dims)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (dims.world,))
    expert_mesh = None
    if dims.ep > 1:
        moe = getattr(model.config, "moe", None)
        if moe is None:
            raise ValueError(f"--ep {dims.ep} needs a model with routed experts (this config has no moe section)")
        ep_mesh = init_device_mesh(device_type, (dims.world // dims.ep, dims.ep), mesh_dim_names=("replica", "ep"))
        parallelize_ep(model, ep_mesh["ep"].get_group(), planner=ep_planner)
        expert_mesh = ep_mesh["replica"]
    cp = None
    if dims.cp > 1:
        cp_mesh = init_device_mesh(device_type, (dims.dp, dims.cp), mesh_dim_names=("dp", "cp"))
        cp = parallelize_cp(model, cp_mesh["cp"].get_group(), activation_checkpointing=activation_checkpointing)
    apply_fsdp(model, mesh, expert_mesh)
    return Parallel(dims, rank, cp)
