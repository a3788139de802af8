"""Gated activations for the FFNs (SPEC-K3 §5). Both take the gate and up projections and return the product
that feeds the down projection, in the input dtype.

`situ_glu` and `swiglu` are the plain-PyTorch references. `glu_activation(name)` returns the `GLUActivation` the
model layers call: SiTU-GLU runs as one Triton pass each way (`openk3.ops.triton_glu`) where `ops.fused.use_triton`
says so (CUDA, not while torch.compile traces), the reference elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openk3.ops.fused import use_triton
from openk3.ops.norms import acc_dtype

ACTIVATIONS = ("situ", "swiglu")


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


@dataclass(frozen=True)
class GLUActivation:
    """(gate, up) -> hidden for config.activation; `packed(h)` takes h [..., 2I] = [gate | up] (the experts'
    gate/up product) and gives the same values as `self(*h.chunk(2, -1))`."""

    name: str
    beta_gate: float = 4.0
    beta_up: float = 25.0

    def __post_init__(self):
        if self.name not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.name!r}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.name == "swiglu":
            return swiglu(gate, up)
        if use_triton(gate) and gate.dtype == up.dtype:
            from openk3.ops.triton_glu import situ_glu_triton  # triton is an optional dependency

            return situ_glu_triton(gate, up, self.beta_gate, self.beta_up)
        return situ_glu(gate, up, self.beta_gate, self.beta_up)

    def packed(self, h: torch.Tensor) -> torch.Tensor:
        if self.name == "situ" and use_triton(h):
            from openk3.ops.triton_glu import situ_glu_packed_triton

            return situ_glu_packed_triton(h, self.beta_gate, self.beta_up)
        return self(*h.chunk(2, dim=-1))


def glu_activation(name: str, beta_gate: float = 4.0, beta_up: float = 25.0) -> GLUActivation:
    """The (gate, up) -> hidden function for config.activation ("situ" or "swiglu")."""
    return GLUActivation(name, beta_gate, beta_up)


def apply_glu(act, h: torch.Tensor) -> torch.Tensor:
    """act on the packed gate/up product h [..., 2I]; `act` is a GLUActivation or any (gate, up) callable."""
    packed = getattr(act, "packed", None)
    return packed(h) if packed is not None else act(*h.chunk(2, dim=-1))
