"""Quantization-aware training of the routed experts (SPEC §13): MXFP4 weights and MXFP8 activations, faked.

The forward sees quantize -> dequantize of the experts' weights (`gate_up_proj`, `down_proj`, MXFP4 blocks along
their input dimension) and of the activations that enter them (the expert input and the GLU output, MXFP8 blocks
along the feature dimension). The backward is straight-through: t + (q(t) - t).detach() has the value q(t) and
the gradient of t, so the master weights receive exactly the gradient the quantized weights would get. Its value
is q(t) to the bit (q(t) - t is exact by Sterbenz's lemma: a nonzero q(t) is within a factor of two of t), except
that a zero comes out as +0.

Applied from outside the model: `enable_qat` turns each `Experts` module into a `FakeQuantExperts` (a subclass
whose `gate_up_proj` / `down_proj` attributes read as fake-quantized views of the parameters), the way
torch.nn.utils.parametrize does, except that the parameters stay registered under their own names, so the state
dict, the optimizer's parameter names and checkpoints are those of the plain model and hold the full-precision
master weights. Whatever `Experts.forward` does inside (a loop over experts, grouped GEMMs) it reads the weights
through those attributes and gets the quantized values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from openk3.model.moe import Experts
from openk3.quant.mx import BLOCK, fake_quant_mxfp4, fake_quant_mxfp8

QAT_FORMATS = ("mxfp4",)


def straight_through(t: torch.Tensor, quantize: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Forward value quantize(t); gradient w.r.t. t as if the forward were the identity."""
    return t + (quantize(t) - t).detach()


def mxfp4_ste(w: torch.Tensor) -> torch.Tensor:
    return straight_through(w, fake_quant_mxfp4)


def mxfp8_ste(x: torch.Tensor) -> torch.Tensor:
    return straight_through(x, fake_quant_mxfp8)


class QuantizedOutput:
    """A GLU activation (gate, up) -> h whose output, the down projection's input, is MXFP8 fake-quantized."""

    def __init__(self, act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.act = act

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return mxfp8_ste(self.act(gate, up))


def _quantized_weight(w: torch.Tensor) -> torch.Tensor:
    """The fake-quantized view of an experts weight, except the FSDP2 shard (a DTensor) outside the forward: FSDP
    reads the attribute to find its sharded parameter (and optimizer state and checkpoints are keyed by it); in the
    forward it holds the unsharded tensor, which is quantized."""
    return w if isinstance(w, DTensor) else mxfp4_ste(w)


class FakeQuantExperts(Experts):
    """Experts whose forward runs on MXFP4 weights and MXFP8 inputs (straight-through); made by `enable_qat`.
    The parameters `gate_up_proj` and `down_proj` stay the fp32 masters in `_parameters`."""

    quantize_activations = True

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return _quantized_weight(self._parameters["gate_up_proj"])

    @property
    def down_proj(self) -> torch.Tensor:
        return _quantized_weight(self._parameters["down_proj"])

    def quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' input as they compute on it: MXFP8 fake-quantized (unless weights only). Expert parallel
        (openk3.parallel.ep), whose forward replaces this class's, applies it too."""
        return mxfp8_ste(x) if self.quantize_activations else x

    def forward(self, x, routing):
        return super().forward(self.quantized_input(x), routing)


def enable_qat(model: nn.Module, fmt: str = "mxfp4", activations: bool = True) -> int:
    """Fake-quantize every routed-experts module of `model` in place; returns how many there are.

    Call it on the plain model, before activation checkpointing, FSDP sharding or torch.compile (FSDP also
    changes module classes). activations=False keeps the expert inputs in full precision (weights only)."""
    if fmt not in QAT_FORMATS:
        raise ValueError(f"QAT format must be one of {QAT_FORMATS}, got {fmt!r}")
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if not experts:
        raise ValueError(f"QAT {fmt}: the model has no routed experts to quantize (its config has no MoE layers)")
    for module in experts:
        if type(module) is not Experts:
            raise ValueError(f"QAT {fmt}: an experts module is already a {type(module).__name__}; apply QAT once, "
                             "to the plain model")
        _, inter, width = module._parameters["gate_up_proj"].shape
        inter //= 2
        if width % BLOCK or inter % BLOCK:
            raise ValueError(f"QAT {fmt} quantizes the experts' inputs in blocks of {BLOCK}: their widths "
                             f"(moe.latent_dim or hidden_size = {width}, moe.expert_hidden = {inter}) must be "
                             f"multiples of {BLOCK}")
    for module in experts:
        module.__class__ = FakeQuantExperts
        module.quantize_activations = activations
        if activations:
            module.act = QuantizedOutput(module.act)
    return len(experts)
