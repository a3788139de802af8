"""Gated Multi-head Latent Attention (SPEC-K3 §3), NoPE."""

from __future__ import annotations

import torch
from torch import nn

from openk3.config import ModelConfig
from openk3.model.common import FusableLinears, RMSNorm, linear, linear_split, out_std
from openk3.model.documents import Documents
from openk3.ops.attention import NO_CUDNN, mla_attention_absorbed, mla_attention_expanded
from openk3.ops.norms import acc_dtype


class GatedMLA(FusableLinears, nn.Module):
    """MLA with an optional sigmoid output gate. D = hidden_size, H = num_heads, n = qk_nope_head_dim,
    r = qk_rope_head_dim (the NoPE "rope" slice), v = v_head_dim, R = kv_lora_rank, Q = q_lora_rank.

    Parameters (HF Kimi Linear / DeepSeek names; [out, in]):
      q_proj               [H*(n+r), D]  when Q is None; rows of head h: [q_nope (n) | q_slice (r)]
      q_a_proj             [Q, D]        when Q is set (shared by heads)
      q_a_layernorm.weight [Q]
      q_b_proj             [H*(n+r), Q]  rows per head as q_proj
      kv_a_proj_with_mqa   [R+r, D]      rows [latent (R) | k_slice (r)], shared by heads
      kv_a_layernorm.weight [R]
      kv_b_proj            [H*(n+v), R]  rows of head h: [k_nope (n) | v (v)]
      g_proj               [H*v, D]      output gate (mla.output_gate), rows per head
      o_norm.weight        [v]           per-head RMSNorm of o before the gate (mla.output_norm, default off)
      o_proj               [D, H*v]      columns h*v:(h+1)*v read head h
    The q_a / kv_a layernorms use mla.norm_eps (HF: the RMSNorm default 1e-6); o_norm uses rms_eps.

    Without a cache: expanded K/V through SDPA (causal). With a HybridCache: the new latents are appended to the
    layer's latent cache; T == 1 runs the absorbed form on the latent cache, T > 1 the expanded form, both with a
    per-sequence mask (ragged lengths). The products that read x run as one (`input_projections`; fused for
    inference: `fused["input"]`).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        m = cfg.mla
        D, H = cfg.hidden_size, m.num_heads
        self.layer_idx = layer_idx
        self.num_heads = H
        self.nope_dim, self.slice_dim, self.v_head_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = m.kv_lora_rank, m.q_lora_rank
        self.qk_head_dim = self.nope_dim + self.slice_dim
        self.scale = self.qk_head_dim**-0.5
        self.absorb_decode = True
        std = cfg.init_std
        if m.q_lora_rank is None:
            self.q_proj = linear(D, H * self.qk_head_dim, std)
        else:
            self.q_a_proj = linear(D, m.q_lora_rank, std)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps=m.norm_eps)
            self.q_b_proj = linear(m.q_lora_rank, H * self.qk_head_dim, std)
        self.kv_a_proj_with_mqa = linear(D, m.kv_lora_rank + self.slice_dim, std)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps=m.norm_eps)
        self.kv_b_proj = linear(m.kv_lora_rank, H * (self.nope_dim + self.v_head_dim), std)
        self.g_proj = linear(D, H * self.v_head_dim, std) if m.output_gate else None
        self.o_norm = RMSNorm(self.v_head_dim, eps=cfg.rms_eps) if m.output_norm else None
        self.o_proj = linear(H * self.v_head_dim, D, out_std(cfg))

    def muon_blocks(self) -> dict[str, str]:
        """Per-head Muon blocks (SPEC §6, "q and kv" for MLA), by parameter name: q_proj / q_b_proj ([q_nope |
        q_slice] per head) and kv_b_proj ([k_nope | v] per head) by head rows. The down projections feed a latent
        shared by all heads, and o_proj and g_proj stay whole."""
        q = "q_proj.weight" if self.q_lora_rank is None else "q_b_proj.weight"
        return {q: f"rows:{self.num_heads}", "kv_b_proj.weight": f"rows:{self.num_heads}"}

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """x [B,T,D] -> q [B,T,H,n+r]."""
        return self._query_from(self.q_proj(x) if self.q_lora_rank is None else self.q_a_proj(x))

    def _query_from(self, q: torch.Tensor) -> torch.Tensor:
        """q from x's first query product (q_proj's, or q_a_proj's before the norm and q_b_proj)."""
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q.view(*q.shape[:2], self.num_heads, self.qk_head_dim)

    def input_linears(self) -> list[nn.Linear]:
        """The Linears that read x, in the order of `input_projections`' product: the query's first (q_proj, or
        q_a_proj), the latent's (kv_a_proj_with_mqa), the output gate's (g_proj) when there is one."""
        first = [self.q_proj if self.q_lora_rank is None else self.q_a_proj, self.kv_a_proj_with_mqa]
        return first + ([self.g_proj] if self.g_proj is not None else [])

    def fusion_groups(self) -> dict[str, list[nn.Linear]]:
        return {"input": self.input_linears()}

    def input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [B,T,D] -> (q [B,T,H,n+r], the cache entries [B,T,R+r], the output gate's logits [B,T,H*v] or None):
        the products that read x as one (`linear_split`), then the query's and the latent's norms."""
        q, c, *gate = linear_split(x, self.input_linears(), self.fused.get("input"))
        return self._query_from(q), self._latent_from(c), gate[0] if gate else None

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """x [B,T,D] -> the per-token cache entry [B,T,R+r] = [RMSNorm(latent) | k_slice]."""
        return self._latent_from(self.kv_a_proj_with_mqa(x))

    def _latent_from(self, c: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.kv_a_layernorm(c[..., : self.kv_lora_rank]), c[..., self.kv_lora_rank :]], dim=-1)

    def forward(self, x: torch.Tensor, cache=None, documents: Documents | None = None) -> torch.Tensor:
        """x [B,T,D] -> [B,T,D]; with `documents` (a packed batch, no cache) each token attends its own document."""
        B, T, _ = x.shape
        if documents is not None:
            if cache is not None:
                raise ValueError("packed documents are a training input: pass documents or a cache, not both")
            documents.check(B, T)
        q, kv, gate = self.input_projections(x)
        kw = dict(nope_dim=self.nope_dim, v_dim=self.v_head_dim, scale=self.scale)
        if cache is None:
            if documents is not None:
                kw.update(doc_ids=documents.doc_ids, block_mask=documents.block_mask,
                          cu_seqlens=documents.device_cu_seqlens)
            o = mla_attention_expanded(q, kv, self.kv_b_proj.weight, **kw)
        else:
            lengths = cache.lengths
            kv_all = cache.layers[self.layer_idx].append(kv, lengths, cache.max_length + T)
            if T == 1 and self.absorb_decode:
                o = mla_attention_absorbed(q, kv_all, self.kv_b_proj.weight, lengths=lengths, **kw)
            elif cache.uniform:  # equal lengths: the new tokens end every row, a bottom-right causal mask
                o = mla_attention_expanded(q, kv_all, self.kv_b_proj.weight, backends=NO_CUDNN, **kw)
            elif T > 1:  # rows of different lengths (a prefill's chunks): each row's own bottom-right causal attention
                # over its own past, where one call would expand every row's K/V to the longest and attend through
                # a dense [B, T, L] mask (no flash kernel)
                o = torch.cat([mla_attention_expanded(q[b:b + 1], kv_all[b:b + 1, :past + T], self.kv_b_proj.weight,
                                                      backends=NO_CUDNN, **kw)
                               for b, past in enumerate(cache.host_lengths)])
            else:
                o = mla_attention_expanded(q, kv_all, self.kv_b_proj.weight, lengths=lengths, backends=NO_CUDNN, **kw)
        return self.output_gated(gate, o, x.dtype)

    def output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x [B,T,D], attention output o [B,T,H,v] -> o_proj(sigmoid(g_proj(x)) * (o_norm(o) if any)) [B,T,D]."""
        return self.output_gated(self.g_proj(x) if self.g_proj is not None else None, o, x.dtype)

    def output_gated(self, gate: torch.Tensor | None, o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`output` from the output gate's logits gate [B,T,H*v] (g_proj's product of x; None without the gate), in
        `dtype` (x's)."""
        B, T, H, v = o.shape
        if self.o_norm is not None:
            o = self.o_norm(o)
        if gate is not None:
            acc = acc_dtype(dtype)
            o = (o.to(acc) * torch.sigmoid(gate.view(B, T, H, v).to(acc))).to(dtype)
        return self.o_proj(o.reshape(B, T, H * v))


__all__ = ["GatedMLA"]
