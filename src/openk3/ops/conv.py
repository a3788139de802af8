"""Depthwise causal (short) convolution with a carried state, SiLU after (SPEC-K3 §2).

weight [C, W] (one kernel of width W per channel; an nn.Conv1d-style [C, 1, W] weight is accepted too).
y_t[c] = silu( sum_{w=0}^{W-1} weight[c, w] * x_{t-W+1+w}[c] ), with x_{<0} taken from `state` (zeros if None).
state [B, C, W-1]: the last W-1 inputs (pre-conv, oldest first). Both forms return the new state so decoding
carries it; the full form over T tokens equals T single steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _kernel(weight: torch.Tensor) -> torch.Tensor:
    return weight.reshape(weight.shape[0], weight.shape[-1])


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None, activation: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-sequence form. x [B,T,C] -> (y [B,T,C], new state [B,C,W-1])."""
    B, T, C = x.shape
    w = _kernel(weight)
    W = w.shape[-1]
    xt = x.transpose(1, 2).to(w.dtype)  # [B,C,T]
    if state is None:
        state = xt.new_zeros(B, C, W - 1)
    full = torch.cat([state.to(w.dtype), xt], dim=-1)  # [B,C,W-1+T]
    y = F.conv1d(full, w.unsqueeze(1), groups=C)  # [B,C,T]
    if activation:
        y = F.silu(y)
    new_state = full[..., full.shape[-1] - (W - 1):]
    return y.transpose(1, 2).to(x.dtype), new_state.to(x.dtype)


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, activation: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-token form. x [B,C], state [B,C,W-1] -> (y [B,C], new state [B,C,W-1])."""
    w = _kernel(weight)
    window = torch.cat([state.to(w.dtype), x.to(w.dtype).unsqueeze(-1)], dim=-1)  # [B,C,W]
    y = (window * w).sum(-1)
    if activation:
        y = F.silu(y)
    return y.to(x.dtype), window[..., 1:].to(x.dtype)
