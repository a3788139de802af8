"""Greedy and temperature sampling of a batch of logits rows in one Triton launch (one program per row): the common
case of `openk3.sampling.sample_tokens` (its reference), rows without top-k / top-p cuts, bias or penalties.

Per row, three passes over the vocabulary in blocks:
1. the largest logit m and the first index holding it (NaN read as -inf);
2. Z = sum_j exp((x_j - m) / T) (exp in fp32, sums in fp64);
3. the drawn token: the number of tokens whose cumulative mass is <= u Z (u the row's uniform), i.e. the first token
   whose cumulative mass exceeds u Z, as `draw_by_inversion` finds it, and never past the last token of positive
   mass (the two sums may differ in their last bit).
A row with T = 0 (greedy) or no finite largest logit (+inf wins outright; all -inf leaves nothing) takes the argmax.
The masses are the reference's up to fp32 rounding (exp, and no division by Z: the reference normalises in fp32), so
a uniform within ~1e-7 (relative) of a boundary between two tokens may pick the neighbour; u Z is kept below Z, as
the reference keeps it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # vocabulary entries per loop step


@triton.jit
def _sample_kernel(logits_ptr, params_ptr, out_ptr, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    temperature = tl.load(params_ptr + 2 * row)
    u = tl.load(params_ptr + 2 * row + 1)
    cols = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_at = tl.zeros([], tl.int64)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x == x, x, float("-inf"))  # NaN is never chosen
        block_best = tl.max(x, axis=0)
        at = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start
        better = block_best > best
        best_at = tl.where(better, at, best_at)
        best = tl.where(better, block_best, best)
    token = best_at
    if (temperature > 0) & (tl.abs(best) < float("inf")):
        t = temperature.to(tl.float32)
        total = tl.zeros([], tl.float64)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            e = tl.exp((tl.where(x == x, x, float("-inf")) - best) / t).to(tl.float64)
            total += tl.sum(e, axis=0)
        target = tl.minimum(u * total, total * (1 - 2.0**-52))
        below = tl.zeros([], tl.int64)
        last = tl.zeros([], tl.int64)  # the last token of positive mass: the draw never goes past it
        running = tl.zeros([], tl.float64)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            e = tl.exp((tl.where(x == x, x, float("-inf")) - best) / t).to(tl.float64)
            cdf = running + tl.cumsum(e, axis=0)
            below += tl.sum(((cdf <= target) & (start + cols < V)).to(tl.int64), axis=0)
            last = tl.maximum(last, tl.max(tl.where(e > 0, start + cols, 0), axis=0).to(tl.int64))
            running += tl.sum(e, axis=0)
        token = tl.minimum(below, last)
    tl.store(out_ptr + row, token)


def sample_rows_triton(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype, rows contiguous), temperature [B] (0: greedy), u [B] in [0, 1) -> one token
    per row [B] (int64), on the logits' device. The per-row parameters travel in one host-to-device copy."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    params = torch.stack([temperature.double().cpu(), u.double().cpu()], dim=1).to(logits.device)
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        _sample_kernel[(B,)](logits, params, out, V, logits.stride(0), BLOCK=min(BLOCK_V, triton.next_power_of_2(V)))
    return out
