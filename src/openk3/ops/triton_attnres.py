"""Block AttnRes phase 2 (SPEC-K3 §4, `openk3.ops.attnres.attn_res_merge`, the reference) in one Triton pass per
row, forward only: what inference runs (`attn_res_merge` takes it for CUDA tensors when no gradient is wanted).
In PyTorch the merge is 13 small operations, two per decoder layer; a serving prefill of a short prompt is
bound by launching such operations, not by their arithmetic.

    s   = (p . q) / sqrt(mean(p^2) + eps)        p: the partial sum in fp32, q: the query (norm weight * w)
    out = (e^s p + e^lse mix) / (e^s + e^lse)    the softmax over the two logits (s, lse), shifted by their max
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(p_ptr, mix_ptr, lse_ptr, q_ptr, out_ptr, n_cols, mix_row_stride, lse_stride, eps,
                  BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    m = c < n_cols
    p = tl.load(p_ptr + row * n_cols + c, mask=m, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + c, mask=m, other=0.0).to(tl.float32)
    s = tl.sum(p * q, axis=0) / tl.sqrt(tl.sum(p * p, axis=0) / n_cols + eps)
    lse = tl.load(lse_ptr + row * lse_stride).to(tl.float32)
    top = tl.maximum(s, lse)
    e_p, e_b = tl.exp(s - top), tl.exp(lse - top)
    mix = tl.load(mix_ptr + row * mix_row_stride + c, mask=m, other=0.0).to(tl.float32)
    out = (e_p * p + e_b * mix) / (e_p + e_b)
    tl.store(out_ptr + row * n_cols + c, out.to(out_ptr.dtype.element_ty), mask=m)


def attn_res_merge_triton(mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, query: torch.Tensor,
                          eps: float, dtype: torch.dtype) -> torch.Tensor:
    """`attn_res_merge`'s value (mix [..., D] and lse [...] may be strided views of phase 1's [..., Q, D] and
    [..., Q]) in `dtype`; no autograd."""
    D = partial.shape[-1]
    p2 = partial.reshape(-1, D).contiguous()
    mix2, lse1 = mix.reshape(-1, D), lse.reshape(-1)  # views: the collapsed rows keep one stride
    if mix2.stride(-1) != 1:
        mix2 = mix2.contiguous()
    out = torch.empty(p2.shape, dtype=dtype, device=partial.device)
    if out.numel():
        block = triton.next_power_of_2(D)
        _merge_kernel[(p2.shape[0],)](p2, mix2, lse1, query.contiguous(), out, D, mix2.stride(0), lse1.stride(0),
                                      eps, BLOCK_D=block, num_warps=8 if block >= 4096 else 4 if block >= 1024 else 2)
    return out.view(partial.shape)
