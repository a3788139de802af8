"""Routed experts kept MXFP4 in memory for inference (SPEC §13): `quantize_experts_(model)` turns each `Experts`
module into a `PackedExperts`, whose weights stay 4-bit (uint8 code pairs, one E8M0 scale per 32 inputs: the layout
of the released files, openk3.quant.mx) and are dequantized inside the expert GEMMs (`ops.triton_mxfp4`). Only the
routed experts change; the model's output is that of the model whose experts hold the dequantized values.

Resident bytes per expert weight: 0.5 + 1/32 per value against 2 in bf16 (kimi-linear-48b's routed experts:
87.75 -> 23.31 GiB).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from openk3.model.moe import Experts
from openk3.ops.fused import use_triton
from openk3.ops.moe import Routing, experts_forward, experts_forward_mxfp4
from openk3.ops.norms import compute_dtype
from openk3.quant.mx import BLOCK, pack_mxfp4, unpack_mxfp4

# values quantized at a time when packing (the quantizer's fp32 temporaries are a few times this many bytes)
PACK_CHUNK_ELEMENTS = 1 << 26


def pack_mxfp4_chunked(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_mxfp4` of w [E, N, K] a few experts at a time (bounded temporaries on a GPU holding a large model)."""
    E, N, K = w.shape
    packed = torch.empty(E, N, K // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(E, N, K // BLOCK, dtype=torch.uint8, device=w.device)
    step = max(1, PACK_CHUNK_ELEMENTS // max(N * K, 1))
    for i in range(0, E, step):
        packed[i:i + step], scales[i:i + step] = pack_mxfp4(w[i:i + step].detach())
    return packed, scales


def packed_bytes(numel: int) -> int:
    """Bytes of `numel` values in MXFP4: half a byte each plus one scale byte per 32."""
    return numel // 2 + numel // BLOCK


class PackedExperts(nn.Module):
    """E routed experts with MXFP4 weights, as buffers (uint8, each expert's matrices in nn.Linear's [out, in]
    layout, packed along the input dimension):
      gate_up_packed [E, 2I, Din/2], gate_up_scales [E, 2I, Din/32]   (rows [:I] gate, [I:] up, as in Experts)
      down_packed    [E, Dout, I/2], down_scales    [E, Dout, I/32]
    Forward: the grouped W4A16 Triton GEMMs where Triton runs (CUDA tensors, compiled code included; `method`:
    `ops.triton_mxfp4`'s kernel, by default picked by the rows per expert), else the reference: the weights
    dequantized to the compute dtype and `ops.moe.experts_forward`, the plain experts' forward on the dequantized
    values. Inference only: the weights take no gradient (with autograd on the reference runs, so gradients still
    reach x)."""

    def __init__(self, gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor],
                 act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], method: str = "auto"):
        super().__init__()
        self.num_experts = gate_up[0].shape[0]
        self.register_buffer("gate_up_packed", gate_up[0])
        self.register_buffer("gate_up_scales", gate_up[1])
        self.register_buffer("down_packed", down[0])
        self.register_buffer("down_scales", down[1])
        self.act = act
        self.method = method

    @classmethod
    def from_experts(cls, experts: Experts, method: str = "auto") -> PackedExperts:
        """The MXFP4 form of `experts`' weights (quantized per OCP MX: openk3.quant.mx)."""
        return cls(pack_mxfp4_chunked(experts.gate_up_proj), pack_mxfp4_chunked(experts.down_proj), experts.act,
                   method)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, Din], down [E, Dout, I]) in `dtype`: the values the experts compute with."""
        return (unpack_mxfp4(self.gate_up_packed, self.gate_up_scales, dtype),
                unpack_mxfp4(self.down_packed, self.down_scales, dtype))

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        if use_triton(x, compiled=True) and not (torch.is_grad_enabled() and x.requires_grad):
            return experts_forward_mxfp4(x, routing.indices, routing.weights, (self.gate_up_packed,
                                         self.gate_up_scales), (self.down_packed, self.down_scales), self.act,
                                         self.method)
        gate_up, down = self.dequantized(compute_dtype(x))
        return experts_forward(x, routing.indices, routing.weights, gate_up, down, self.act)

    def extra_repr(self) -> str:
        E, inter2, half = self.gate_up_packed.shape
        return f"experts={E}, in={2 * half}, hidden={inter2 // 2}, mxfp4, method={self.method}"


class ExpertsMemory(NamedTuple):
    modules: int  # experts modules converted
    bytes_before: int  # resident bytes of the routed experts' weights before
    bytes_after: int  # and after


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def expert_bytes(model: nn.Module) -> int:
    """Resident bytes of the routed experts' weights (plain or packed)."""
    return sum(tensor_bytes(m) for m in model.modules() if isinstance(m, (Experts, PackedExperts)))


def _check_widths(experts: Experts) -> None:
    _, inter2, width = experts.gate_up_proj.shape
    if width % BLOCK or (inter2 // 2) % BLOCK:
        raise ValueError(f"MXFP4 experts group {BLOCK} inputs: the experts' input widths (moe.latent_dim or "
                         f"hidden_size = {width}, moe.expert_hidden = {inter2 // 2}) must be multiples of {BLOCK}")


def pack_experts_in(module: nn.Module, method: str = "auto") -> ExpertsMemory:
    """Replace every `Experts` module below `module` by its `PackedExperts`, one at a time (each plain copy is
    dropped before the next is packed); modules already packed are left alone."""
    found = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if isinstance(child, Experts)]
    for _, _, child in found:
        _check_widths(child)
    before = after = 0
    for parent, name, child in found:
        before += tensor_bytes(child)
        packed = PackedExperts.from_experts(child, method)
        setattr(parent, name, packed)
        after += tensor_bytes(packed)
    return ExpertsMemory(len(found), before, after)


def no_experts(model_name: str) -> ValueError:
    return ValueError(f"--quantization mxfp4 keeps routed MoE experts packed, but model {model_name!r} has none "
                      "(config field 'moe' is None)")


def quantize_experts_(model: nn.Module, method: str = "auto") -> ExpertsMemory:
    """Keep `model`'s routed experts MXFP4 (in place); ValueError naming the config field when it has none."""
    if not any(isinstance(m, (Experts, PackedExperts)) for m in model.modules()):
        raise no_experts(getattr(getattr(model, "config", None), "name", type(model).__name__))
    return pack_experts_in(model, method)
