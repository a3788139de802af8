"""Collectives with hand-written backwards (no autograd through a collective).

`gather_rows`: every rank's rows, concatenated in rank order (sizes may differ); backward sums the gradient over
the ranks (all-reduce) and keeps this rank's rows. `exchange`: all_to_all_single of several tensors in one autograd
node; backward sends the gradients back along the reversed splits. Keeping the tensors of one exchange in one node
matters: autograd runs a node once all its output gradients are ready, so every rank issues the reverse
collectives in the same order whatever the local graph looks like (two separate nodes could be reached in different
orders on different ranks and deadlock).

gloo (CPU) supports all_gather_into_tensor, all_reduce and all_to_all_single with uneven splits; NCCL all of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; the GPU machines run torch 2.11
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_padded(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Rows of every rank (rank r holds sizes[r] rows of x's trailing shape), concatenated; no autograd."""
    width = max(sizes)
    padded = x.new_zeros(width, *x.shape[1:])
    padded[: x.shape[0]] = x
    out = x.new_empty(len(sizes) * width, *x.shape[1:])
    _all_gather_single(out, padded.contiguous(), group=group)
    out = out.view(len(sizes), width, *x.shape[1:])
    return torch.cat([out[r, :n] for r, n in enumerate(sizes)])


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        return all_gather_padded(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]], None, None, None


def gather_rows(x: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    """x [sizes[rank], ...] -> [sum(sizes), ...]: all ranks' rows in rank order, differentiable."""
    if x.shape[0] != sizes[rank]:
        raise ValueError(f"rank {rank} holds {x.shape[0]} rows, the layout says {sizes[rank]}")
    return _GatherRows.apply(x, list(sizes), rank, group)


def _all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, splits, group, num_anchors, *tensors):
        ctx.splits, ctx.group = splits, group
        ctx.anchors = [(a.shape, a.dtype, a.device) for a in tensors[:num_anchors]]
        return tuple(_all_to_all(x, recv, send, group) for x, (send, recv) in zip(tensors[num_anchors:], splits))

    @staticmethod
    def backward(ctx, *grads):
        back = [_all_to_all(g, send, recv, ctx.group) for g, (send, recv) in zip(grads, ctx.splits)]
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.anchors]
        return (None, None, None, *zeros, *back)


def exchange(items: list[tuple[torch.Tensor, list[int], list[int]]], group,
             anchors: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, ...]:
    """all_to_all_single for each (tensor, rows sent to each rank, rows received from each rank), one autograd
    node. A tensor's rows are grouped by destination rank; the result's rows are grouped by source rank.

    Every rank must reach the node's backward, or the others wait in its collective. `anchors` (each given a zero
    gradient) are tensors this rank may not otherwise use but whose backward must run, e.g. the rows it received
    when it received none, or expert weights no row used this step (so every rank has a gradient to reduce)."""
    splits = tuple((list(send), list(recv)) for _, send, recv in items)
    return _Exchange.apply(splits, group, len(anchors), *anchors, *(x for x, _, _ in items))
