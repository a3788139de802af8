"""Muon's elementwise passes over many parameters at once, in two Triton launches a step (SPEC §6;
`openk3.train.optim` holds the PyTorch form, the reference):

    momentum_into_blocks   M <- mu M + G  (in place)   and   U = G + mu M  written into U's block batch
    apply_block_updates    W <- decay W - lr O          (O read from its block batch)

Each launch covers every tensor of a list: a program takes BLOCK consecutive elements of one tensor, found
through a table of (tensor, chunk) pairs, and the tensors' addresses come in a table too (so one launch serves 196
parameters of different shapes). With PyTorch's multi-tensor operations the same work takes six passes over the
parameters and a cast-on-copy into the batches (the reference; timings: bench/RESULTS.md, `bench/train.py optim`).

Block layout (`optim.to_blocks`): element k of a parameter [out, H*d] split "cols:H" is element (h, o, j) of its
blocks [H, out, d], at h*out*d + o*d + j in a contiguous batch; every other split keeps the parameter's own order.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from openk3.ops.transfer import to_device

BLOCK = 4096  # elements a program
NUM_WARPS = 4  # BLOCK 4096 and 4 warps: 3.6 TB/s, the best of a sweep on an H200 (bench/RESULTS.md)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _chunk(chunks_ptr, layout_ptr, BLOCK: tl.constexpr):
    """This program's tensor t, its first element k0 and its elements k (in the tensor's order), the tensor's
    numel and H."""
    pid = tl.program_id(0)
    t = tl.load(chunks_ptr + 2 * pid)
    k0 = tl.load(chunks_ptr + 2 * pid + 1).to(tl.int64) * BLOCK
    return t, k0, k0 + tl.arange(0, BLOCK), tl.load(layout_ptr + 4 * t), tl.load(layout_ptr + 4 * t + 1)


@triton.jit
def _cols_place(layout_ptr, t, k, heads):
    """Where element k = o * H d + h * d + j of a "cols:H" parameter lies in its blocks: h * out d + o * d + j."""
    d = tl.load(layout_ptr + 4 * t + 2)
    return (k // (heads * d)) * d + ((k // d) % heads) * tl.load(layout_ptr + 4 * t + 3) + k % d


@triton.jit
def _address(table_ptr, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Tensor t's address from a table. ALIGNED: `_launch` found every address 16-byte aligned, and saying so
    lets Triton load and store 16 bytes at a time (in the chunks that need no mask)."""
    address = tl.load(table_ptr + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        address = tl.multiple_of(address, 16)
    return address


@triton.jit
def _momentum(grad, buf, out, mu, k, place, mask, BUF: tl.constexpr, OUT: tl.constexpr):
    g = tl.load(grad + k, mask=mask).to(tl.float32)
    m = mu * tl.load(buf + k, mask=mask).to(tl.float32) + g
    tl.store(buf + k, m.to(BUF), mask=mask)
    tl.store(out + place, (g + mu * m).to(OUT), mask=mask)


@triton.jit
def _momentum_kernel(chunks_ptr, layout_ptr, grads_ptr, bufs_ptr, outs_ptr, mus_ptr, GRAD: tl.constexpr,
                     BUF: tl.constexpr, OUT: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    t, k0, k, numel, heads = _chunk(chunks_ptr, layout_ptr, BLOCK)
    grad, buf = _address(grads_ptr, t, GRAD, ALIGNED), _address(bufs_ptr, t, BUF, ALIGNED)
    out, mu = _address(outs_ptr, t, OUT, ALIGNED), tl.load(mus_ptr + t)
    if heads != 1:
        _momentum(grad, buf, out, mu, k, _cols_place(layout_ptr, t, k, heads), k < numel, BUF, OUT)
    elif k0 + BLOCK <= numel:  # the chunks that need no mask (most of them)
        _momentum(grad, buf, out, mu, k, k, None, BUF, OUT)
    else:
        _momentum(grad, buf, out, mu, k, k, k < numel, BUF, OUT)


@triton.jit
def _apply(param, update, lr, decay, k, place, mask, PARAM: tl.constexpr):
    u = tl.load(update + place, mask=mask).to(tl.float32)
    tl.store(param + k, (decay * tl.load(param + k, mask=mask).to(tl.float32) - lr * u).to(PARAM), mask=mask)


@triton.jit
def _apply_kernel(chunks_ptr, layout_ptr, params_ptr, updates_ptr, lrs_ptr, decays_ptr, PARAM: tl.constexpr,
                  UPDATE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    t, k0, k, numel, heads = _chunk(chunks_ptr, layout_ptr, BLOCK)
    param, update = _address(params_ptr, t, PARAM, ALIGNED), _address(updates_ptr, t, UPDATE, ALIGNED)
    lr, decay = tl.load(lrs_ptr + t), tl.load(decays_ptr + t)
    if heads != 1:
        _apply(param, update, lr, decay, k, _cols_place(layout_ptr, t, k, heads), k < numel, PARAM)
    elif k0 + BLOCK <= numel:
        _apply(param, update, lr, decay, k, k, None, PARAM)
    else:
        _apply(param, update, lr, decay, k, k, k < numel, PARAM)


@lru_cache(maxsize=16)
def _tables(layouts: tuple[tuple[int, int, int, int], ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (tensor, chunk) table of a launch and the tensors' layouts (numel, H, d, out*d), on the device; the
    parameters' shapes do not change from step to step, so this is built once."""
    numels = torch.tensor([layout[0] for layout in layouts])
    counts = (numels + BLOCK - 1) // BLOCK
    tensor = torch.repeat_interleave(torch.arange(len(layouts)), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    chunks = torch.stack([tensor, torch.arange(len(tensor)) - first], 1).to(torch.int32)
    return chunks.to(device), torch.tensor(layouts, dtype=torch.int64).to(device)


def _layout(t: torch.Tensor, heads: int) -> tuple[int, int, int, int]:
    if heads == 1:
        return t.numel(), 1, 1, 1
    out, width = t.shape
    return t.numel(), heads, width // heads, out * (width // heads)


def _launch(kernel, tensors: list[torch.Tensor], heads: list[int], addresses: list[list[torch.Tensor]],
            scalars: list[list[float]], dtypes: list[torch.dtype]) -> None:
    device = tensors[0].device
    chunks, layouts = _tables(tuple(_layout(t, h) for t, h in zip(tensors, heads, strict=True)), device)
    # the per-step tables (addresses, learning rates) are queued from pinned memory: no wait for the backward
    pointers = [[x.data_ptr() for x in xs] for xs in addresses]
    kernel[(chunks.shape[0],)](
        chunks, layouts, *[to_device(p, device, torch.int64) for p in pointers],
        *[to_device(s, device, torch.float32) for s in scalars], *[_TL_DTYPES[d] for d in dtypes],
        ALIGNED=all(p % 16 == 0 for ps in pointers for p in ps), BLOCK=BLOCK, num_warps=NUM_WARPS)


def supports(tensors: list[torch.Tensor]) -> bool:
    """Whether the kernels can take these tensors: plain contiguous tensors or parameters (not DTensors), all of
    one float dtype and on one device."""
    first = tensors[0]
    return first.dtype in _TL_DTYPES and all(
        type(t.data) is torch.Tensor and t.is_contiguous() and t.dtype == first.dtype and t.device == first.device
        for t in tensors)


def momentum_into_blocks(grads: list[torch.Tensor], bufs: list[torch.Tensor], outs: list[torch.Tensor],
                         heads: list[int], mus: list[float]) -> None:
    """For each i: bufs[i] <- mus[i] bufs[i] + grads[i] in place, and outs[i] (contiguous, the blocks of
    grads[i]'s shape, `heads[i]` > 1 for a "cols" split) <- grads[i] + mus[i] bufs[i], cast to outs' dtype."""
    if grads:
        _launch(_momentum_kernel, grads, heads, [grads, bufs, outs], [mus],
                [grads[0].dtype, bufs[0].dtype, outs[0].dtype])


def apply_block_updates(params: list[torch.Tensor], updates: list[torch.Tensor], heads: list[int],
                        lrs: list[float], decays: list[float]) -> None:
    """For each i: params[i] <- decays[i] params[i] - lrs[i] updates[i], the update in block layout."""
    if params:
        _launch(_apply_kernel, params, heads, [params, updates], [lrs, decays], [params[0].dtype, updates[0].dtype])
