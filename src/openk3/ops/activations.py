"""Gated activations for the FFNs (SPEC-K3 §5). Both take the gate and up projections and return the product
that feeds the down projection, in the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.norms import acc_dtype


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): near-linear for small x, bounded by cap."""
    return cap * torch.tanh(x / cap)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta_gate: float = 4.0, beta_up: float = 25.0) -> torch.Tensor:
    """SiTU-GLU = [b1 tanh(g / b1) * sigmoid(g)] * [b2 tanh(u / b2)], in fp32; |out| < b1 * b2."""
    acc = acc_dtype(gate.dtype)
    g, u = gate.to(acc), up.to(acc)
    return (softcap(g, beta_gate) * torch.sigmoid(g) * softcap(u, beta_up)).to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU = silu(g) * u (Kimi Linear)."""
    return F.silu(gate) * up


def glu_activation(name: str, beta_gate: float = 4.0, beta_up: float = 25.0):
    """The (gate, up) -> hidden function for config.activation ("situ" or "swiglu")."""
    if name == "situ":
        return lambda g, u: situ_glu(g, u, beta_gate, beta_up)
    if name == "swiglu":
        return swiglu
    raise ValueError(f"activation must be one of ('situ', 'swiglu'), got {name!r}")
