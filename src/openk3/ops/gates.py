"""KDA forget-gate activations (SPEC-K3 §2). Both return the log decay g = log(alpha) <= 0 in fp32
(fp64 for fp64 inputs).

Shapes: f [..., H, K] (the low-rank projection f_b(f_a(x)) viewed per head), A_log [H], dt_bias [H*K] or [H, K].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.norms import acc_dtype


def _pre(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    H, K = f.shape[-2:]
    acc = acc_dtype(f.dtype)
    x = f.to(acc) + dt_bias.to(acc).reshape(H, K)
    rate = A_log.to(acc).reshape(H, 1).exp()  # exp(A_log), one per head, broadcast over K
    return x, rate


def k3_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float = -5.0) -> torch.Tensor:
    """K3's lower-bounded gate: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), so g in (lower_bound, 0)."""
    x, rate = _pre(f, A_log, dt_bias)
    return lower_bound * torch.sigmoid(rate * x)


def kimi_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi Linear's gate: g = -exp(A_log) * softplus(f + dt_bias) (no lower bound)."""
    x, rate = _pre(f, A_log, dt_bias)
    return -rate * F.softplus(x)
