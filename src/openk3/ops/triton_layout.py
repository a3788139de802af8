"""The grouped GEMM's padded row layout (`openk3.ops.moe.grouped_layout`, the reference) in one Triton launch: in
PyTorch it is about twenty small operations per MoE layer on vectors of E experts, which bind a short prefill to
the host. Every program recomputes the per-expert vectors (E <= a few thousand: cheap) and places its block of rows:

    padded_e = ceil(max(count_e, 1) / align) * align      ends = cumsum(padded)     (offsets: ends, last = capacity)
    shift_e  = (ends_e - padded_e) - (cumsum(count)_e - count_e)     padded start - unpadded start of expert e
    dest[r]  = r + shift_{e(r)},   e(r) = #experts whose unpadded rows end at or before r      source[dest[r]] = r
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 64  # rows per program


@triton.jit(do_not_specialize=["M", "capacity"])  # one compile for every token count
def _layout_kernel(counts_ptr, offsets_ptr, dest_ptr, source_ptr, E, M, capacity, ALIGN: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    me = e < E
    counts = tl.load(counts_ptr + e, mask=me, other=0).to(tl.int64)
    padded = tl.where(me, (tl.maximum(counts, 1) + ALIGN - 1) // ALIGN * ALIGN, 0)
    ends = tl.cumsum(padded, axis=0)
    row_ends = tl.cumsum(counts, axis=0)
    shift = ends - padded - (row_ends - counts)
    if tl.program_id(0) == 0:
        tl.store(offsets_ptr + e, tl.where(e == E - 1, capacity, ends).to(tl.int32), mask=me)
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mr = r < M
    expert = tl.sum(((row_ends[None, :] <= r[:, None]) & me[None, :]).to(tl.int64), axis=1)
    dest = r + tl.sum(tl.where(e[None, :] == expert[:, None], shift[None, :], 0), axis=1)
    tl.store(dest_ptr + r, dest, mask=mr)
    tl.store(source_ptr + dest, r, mask=mr)


def grouped_layout_triton(counts: torch.Tensor, num_rows: int, align: int, capacity: int):
    """(offsets [E] int32, dest [M] int64, source [capacity] int64 with M where no row lands) for counts [E] on
    the device; `grouped_layout`'s contract."""
    E = counts.numel()
    offsets = torch.empty(E, dtype=torch.int32, device=counts.device)
    dest = torch.empty(num_rows, dtype=torch.int64, device=counts.device)
    source = torch.full((capacity,), num_rows, dtype=torch.int64, device=counts.device)
    _layout_kernel[(max(1, triton.cdiv(num_rows, BLOCK_R)),)](
        counts, offsets, dest, source, E, num_rows, capacity, ALIGN=align, BLOCK_E=triton.next_power_of_2(E),
        BLOCK_R=BLOCK_R)
    return offsets, dest, source
