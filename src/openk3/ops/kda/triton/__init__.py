"""Triton kernels for Kimi Delta Attention (SPEC-K3 §2): chunked forward/backward, decode, conv step.

`kda_triton` is what `openk3.ops.kda.kda(..., backend="triton")` calls; `kda_decode` and
`causal_conv_step` advance many sequences by one token, or by T tokens in one launch (speculative verification,
optionally recording the state after each token for rollback), with their states updated in place;
`kda_activations` turns raw projections and gate logits into kda_triton's inputs in one pass;
`kda_triton_fused` does the same inside the chunk kernels; `initial_state_grad_triton` is the
reverse state pass alone (KCP's backward exchange), `kda_final_state_triton` the forward's state recurrence
alone (its forward exchange); `exchange.kda_triton_exchange` runs the chunk kernels with KCP's exchanges between
them, from the layer's own chunk terms.
"""

from openk3.ops.kda.triton.activations import kda_activations, kda_activations_reference
from openk3.ops.kda.triton.chunk import (
    initial_state_grad_triton,
    kda_final_state_triton,
    kda_triton,
    kda_triton_fused,
)
from openk3.ops.kda.triton.decode import (
    causal_conv_step,
    causal_conv_step_reference,
    kda_decode,
    kda_decode_reference,
)

__all__ = [
    "kda_triton",
    "kda_triton_fused",
    "initial_state_grad_triton",
    "kda_final_state_triton",
    "kda_activations",
    "kda_activations_reference",
    "kda_decode",
    "kda_decode_reference",
    "causal_conv_step",
    "causal_conv_step_reference",
]
