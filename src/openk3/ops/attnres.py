"""Block Attention Residuals (SPEC-K3 §4): a softmax-weighted mix over depth, per token.

    keys_i  = RMSNorm_noweight(v_i)                 (fp32)
    score_i = sum_d (r_d * w_d) * keys_i[d]         w: the pseudo-query [D], r: the RMSNorm weight [D]
    h       = sum_i softmax_i(score) * v_i          (values are the raw sources)
"""

from __future__ import annotations

import torch

from openk3.ops.norms import acc_dtype


def attn_res(
    sources: list[torch.Tensor] | torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """sources: a list of N tensors [...,D] (or one stacked [N,...,D]); query, norm_weight [D] -> [...,D]."""
    v = torch.stack(list(sources)) if isinstance(sources, list | tuple) else sources
    acc = acc_dtype(v.dtype)
    vf = v.to(acc)
    keys = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps)
    scores = keys @ (norm_weight.to(acc) * query.to(acc).reshape(-1))  # [N,...]
    p = scores.softmax(0).unsqueeze(-1)
    return (p * vf).sum(0).to(v.dtype)
