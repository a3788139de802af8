"""Triton kernels for Kimi Delta Attention (SPEC-K3 §2): chunked forward/backward, decode, conv step.

`kda_triton` is what `openk3.ops.kda.kda(..., backend="triton")` calls; `kda_decode` and
`causal_conv_step` advance many sequences by one token with their states updated in place.
"""

from openk3.ops.kda.triton.chunk import kda_triton
from openk3.ops.kda.triton.decode import (
    causal_conv_step,
    causal_conv_step_reference,
    kda_decode,
    kda_decode_reference,
)

__all__ = ["kda_triton", "kda_decode", "kda_decode_reference", "causal_conv_step", "causal_conv_step_reference"]
