"""The MoE's combine without autograd in one Triton launch: each token's k expert outputs, read where the sorted
rows left them, weighted and summed in fp32 (`ops.moe.experts_forward_sorted`'s reference: the rows put back in
(token, slot) order by index_copy, widened to fp32, multiplied by the routing weights and summed, each step a pass
over all N k rows, ~10 bytes moved a row element; here 2: kimi-linear-48b's 8k prefill moves ~3.4 GB a MoE layer
in the reference, 0.34 here).

    out[n, d] = sum_j weights[n, j] * y_sorted[position[n k + j], d]      (fp32, cast to out's dtype)

position is the inverse of the sort's `order` (sorted row -> n k + j). The sum runs j = 0 .. k-1 with fused
multiply-adds, so it may differ from the reference in the last fp32 bit before the cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 512  # output columns a program


@triton.jit(do_not_specialize=["D"])
def _combine_kernel(y_ptr, position_ptr, weights_ptr, out_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(position_ptr + n * K + j).to(tl.int64)
        weight = tl.load(weights_ptr + n * K + j).to(tl.float32)
        acc += weight * tl.load(y_ptr + row * D + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * D + d, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine_sorted_triton(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
    """y_sorted [N k, D] (sorted row r came from (token, slot) row order[r]), routing weights [N, k] -> [N, D] in
    `dtype`: each token's weighted sum of its k rows in fp32."""
    N, k = weights.shape
    D = y_sorted.shape[1]
    if y_sorted.shape[0] != N * k or order.shape != (N * k,):
        raise ValueError(f"combine: y_sorted [N k, D] and order [N k] for weights [N, k] = {[N, k]}, got "
                         f"{list(y_sorted.shape)} and {list(order.shape)}")
    out = torch.empty(N, D, dtype=dtype, device=y_sorted.device)
    if N == 0 or D == 0:
        return out
    position = torch.empty_like(order).scatter_(0, order, torch.arange(N * k, device=order.device))
    _combine_kernel[(N, triton.cdiv(D, BLOCK_D))](y_sorted.contiguous(), position, weights.contiguous(), out, D,
                                                  K=k, BLOCK_D=BLOCK_D, num_warps=4)
    return out
