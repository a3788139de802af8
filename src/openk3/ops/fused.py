"""When the fused Triton kernels of the fp32 islands (RMSNorm, SiTU-GLU) take over from their PyTorch references:
for CUDA tensors in a 16/32-bit float dtype, when triton imports, and not while torch.compile traces (Inductor
then fuses the reference itself). One rule, used by `ops.activations` and `model.common.RMSNorm`."""

from __future__ import annotations

from functools import cache

import torch


@cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor, compiled: bool = False) -> bool:
    """compiled=True: inside torch.compile too (a kernel behind a torch custom op, which Inductor keeps whole)."""
    return (x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (compiled or not torch.compiler.is_compiling()) and triton_available())
