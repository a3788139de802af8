"""The cross-entropy part of `ops.loss.linear_cross_entropy` for one chunk of logits, in one Triton program per
row: the row's log-sum-exp (online max and sum over the vocabulary) and its loss, then, in the same program, the
gradient of the loss with respect to the logits written over the logits themselves in their own dtype:

    loss_i = lse_i - logit_i[target_i]          d loss / d logit_i = (softmax(logit_i) - onehot(target_i)) * s_i

where s_i is the row's scale (1 / kept rows for the mean, 1 for the sum, 0 for an ignored row). The PyTorch form
(`ops.loss.chunked_loss_and_grads`) does the same with fp32 [rows, V] copies and a dozen passes over them; here the
logits are read twice (the second read mostly from L2) and written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def _ce_rows_kernel(logits_ptr, targets_ptr, scale_ptr, loss_ptr, V, stride_row, ignore_index,
                    WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    target = tl.load(targets_ptr + row)
    keep = target != ignore_index
    safe = tl.where(keep, target, 0)
    # pass 1: per lane a running max and a sum of exp relative to it, merged across lanes at the end
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        alive = m_new > float("-inf")  # lanes that have seen a value (the tail block's masked lanes have not)
        s = tl.where(alive, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
        m = m_new
    top = tl.max(m, axis=0)
    total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - top), 0.0), axis=0)
    picked = tl.load(base + safe).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(keep, top + tl.log(total) - picked, 0.0))
    if WRITE_GRAD:
        row_scale = tl.where(keep, tl.load(scale_ptr).to(tl.float32), 0.0)
        factor = row_scale / total
        for start in range(0, V, BLOCK):
            idx = start + cols
            inside = idx < V
            x = tl.load(base + idx, mask=inside, other=float("-inf")).to(tl.float32)
            g = tl.exp(x - top) * factor - tl.where(idx == safe, row_scale, 0.0)
            tl.store(base + idx, g.to(logits_ptr.dtype.element_ty), mask=inside)


def ce_rows_triton(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, ignore_index: int,
                   write_grad: bool) -> torch.Tensor:
    """Per-row cross-entropy (fp32 [rows], 0 where ignored) of logits [rows, V] (unit stride along V) against
    targets [rows]; with write_grad, logits is overwritten by the loss's gradient times `scale` (a 0-d tensor),
    in logits' dtype (zero rows where ignored)."""
    rows, V = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("ce_rows_triton needs logits with unit stride along the vocabulary")
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _ce_rows_kernel[(rows,)](logits, targets, scale, loss, V, logits.stride(0), ignore_index,
                                 WRITE_GRAD=write_grad, BLOCK=min(BLOCK_V, triton.next_power_of_2(V)), num_warps=8)
    return loss
