"""Small building blocks shared by the layers: RMSNorm, the short conv's weight holder, init helpers, the
fp32 guard for parameters that must stay fp32 (A_log, dt_bias, router weight and bias), one autocast copy of
an input shared by the matmuls that read it, and the Linears that read one input run as one product (training:
over their concatenated weights; inference: over one buffer holding them, `FusableLinears`)."""

from __future__ import annotations

import abc
import math

import torch
import torch.nn.functional as F
from torch import nn

from openk3.ops.fused import use_triton
from openk3.ops.norms import add_rms_norm, compute_dtype, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm with a learned weight [dim] (init 1), computed in fp32: `openk3.ops.norms.rms_norm`, or one Triton
    pass each way where `ops.fused.use_triton` says so (CUDA tensors, outside torch.compile)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from openk3.ops.triton_norm import rms_norm_triton  # triton is an optional dependency

            return rms_norm_triton(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual): the pre-norm residual step, fused in one pass on CUDA."""
        if use_triton(x) and use_triton(residual):
            from openk3.ops.triton_norm import add_rms_norm_triton

            return add_rms_norm_triton(x, residual, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def shared_cast(x: torch.Tensor, consumers: int) -> tuple[torch.Tensor, ...]:
    """x for `consumers` matmuls: under autocast, views of one copy in autocast's dtype (each autocast matmul
    would otherwise cast x and keep its own copy for backward); backward sums their gradients in x's dtype, as
    autograd sums the gradients of separate casts (so they agree to fp32 rounding; the order of the sum may
    differ). When x is already in the compute dtype (no autocast, or a bf16 x), or while torch.compile traces
    (Inductor shares the casts itself): x itself, `consumers` times."""
    dtype = compute_dtype(x)
    if dtype == x.dtype or torch.compiler.is_compiling():
        return (x,) * consumers
    return _SharedCast.apply(x, dtype, consumers)


class _SharedCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dtype, consumers):
        ctx.dtype = x.dtype
        copy = x.to(dtype)
        return tuple(copy.view_as(copy) for _ in range(consumers))

    @staticmethod
    def backward(ctx, *grads):
        total = None
        for g in grads:
            if g is not None:
                total = g.to(ctx.dtype) if total is None else total + g.to(ctx.dtype)
        return total, None, None


def linear_concat(x: torch.Tensor, linears: list[nn.Linear], fused: torch.Tensor | None = None) -> torch.Tensor:
    """x through the bias-free `linears`: their outputs side by side on the last dim. With autograd on (training) one
    matrix product over their concatenated weights: one GEMM reads x once (under autocast, one cast of it), and x's
    gradient is one GEMM instead of a sum of several. Without it (inference) one product over `fused` when given (the
    Linears' weights in one buffer, `fuse_linears`), else a product per Linear, outputs concatenated: concatenating
    the weights on every call would triple a decode step's weight reads, which are its cost."""
    if torch.is_grad_enabled():
        return F.linear(x, torch.cat([lin.weight for lin in linears]))
    if fused is not None:
        return F.linear(x, fused)
    return torch.cat([F.linear(x, lin.weight) for lin in linears], dim=-1)


def linear_split(x: torch.Tensor, linears: list[nn.Linear], fused: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The outputs of the bias-free `linears` on x: with autograd on, or without it over `fused` (`linear_concat`),
    views of one product (x read, and its gradient formed, once); without either, one product each (no
    concatenated copy to split)."""
    if fused is None and not torch.is_grad_enabled():
        return [F.linear(x, lin.weight) for lin in linears]
    return list(linear_concat(x, linears, fused).split([lin.weight.shape[0] for lin in linears], dim=-1))


def fuse_linears(linears: list[nn.Linear]) -> torch.Tensor:
    """Put the weights of the bias-free `linears` (one input width, dtype and device) in one buffer [their rows, in]
    and return it; each Linear's weight becomes an nn.Parameter over its rows (same values, same requires_grad, no
    extra memory), so loading a state dict copies into the buffer and training updates it."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[row:row + n], requires_grad=lin.weight.requires_grad)
        row += n
    return fused


class FusableLinears(nn.Module, metaclass=abc.ABCMeta):
    """Mixin: a module whose Linears read one input in groups (`fusion_groups`: name -> Linears, each Linear in at
    most one group of a model). `fuse_projections` puts each group in one buffer (`fuse_linears`), kept in `fused`
    by name, for its inference products to run as one (`linear_concat` / `linear_split` over it): one GEMM instead
    of one per Linear, whose outputs need no concatenated copy. A later dtype or device move gives the Linears new
    weights, and a load_state_dict(assign=True) new tensors: either drops the fusion. Fusing again keeps the
    buffers: a second engine on the same model must not move the weights that the first one's CUDA graphs read."""

    def __init__(self):
        super().__init__()
        self.fused: dict[str, torch.Tensor] = {}
        self.register_load_state_dict_post_hook(_drop_replaced_fusion)

    @abc.abstractmethod
    def fusion_groups(self) -> dict[str, list[nn.Linear]]:
        """Group name -> its Linears, in the order of their product's output columns (each subclass says which)."""

    def fuse_projections(self) -> None:
        if not self.fused:  # already fused: keep the buffers
            self.fused = {name: fuse_linears(linears) for name, linears in self.fusion_groups().items()}

    def _apply(self, fn, recurse=True):
        self.fused = {}
        return super()._apply(fn, recurse)


def _drop_replaced_fusion(module: FusableLinears, incompatible_keys) -> None:
    """After a load_state_dict: a Linear whose weight is no longer a view of its group's buffer (assign=True) ends
    the module's fusion, whose buffers would otherwise hold the old weights."""
    groups = module.fusion_groups()
    if any(lin.weight.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
           for name, buffer in module.fused.items() for lin in groups[name]):
        module.fused = {}


def fuse_inference_projections(model: nn.Module) -> None:
    """`FusableLinears.fuse_projections` on every module of `model` (the serving engine's start-up)."""
    for module in model.modules():
        if isinstance(module, FusableLinears):
            module.fuse_projections()


class ShortConv(nn.Module):
    """Holds a depthwise causal conv kernel `weight` [C, 1, W] (nn.Conv1d's layout, as in HF / fla checkpoints).
    No bias. Init: PyTorch's Conv1d default for this shape, U(-1/sqrt(W), 1/sqrt(W)). The math is in
    `openk3.ops.conv`."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        bound = 1.0 / math.sqrt(kernel)
        nn.init.uniform_(self.weight, -bound, bound)

    def extra_repr(self) -> str:
        return f"channels={self.weight.shape[0]}, kernel={self.weight.shape[-1]}"


def linear(in_features: int, out_features: int, std: float) -> nn.Linear:
    """nn.Linear without bias, weight [out, in] ~ N(0, std)."""
    layer = nn.Linear(in_features, out_features, bias=False)
    nn.init.normal_(layer.weight, mean=0.0, std=std)
    return layer


def out_std(cfg) -> float:
    """Init std of the projections that write into the residual stream (o_proj, down_proj, routed_up)."""
    return cfg.init_std / math.sqrt(2 * cfg.num_layers)


class KeepFp32(nn.Module):
    """Mixin: the parameters / buffers named in `_fp32_names` stay fp32 when the module is cast to a 16-bit
    float dtype (`model.to(torch.bfloat16)`, `.half()`); device moves still apply. fp64 casts go through."""

    _fp32_names: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        saved = {}
        for name in self._fp32_names:
            t = getattr(self, name, None)
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                saved[name] = t.detach()
        super()._apply(fn, recurse)
        for name, old in saved.items():
            new = getattr(self, name)
            if new.dtype in (torch.float16, torch.bfloat16):
                kept = old.to(new.device)
                if name in self._parameters:
                    self._parameters[name].data = kept
                else:
                    self._buffers[name] = kept
        return self
