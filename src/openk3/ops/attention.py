"""Multi-head Latent Attention math (SPEC-K3 §3): prefill with expanded K/V and decode on the latent cache.

Shared layout:
  q         [B,T,H,n+r]   per head [q_nope (n) | q_slice (r)]
  kv_cache  [B,L,R+r]     per token [RMSNorm(latent) (R) | k_slice (r)], shared by all heads; L >= T
  kv_b      [H*(n+v), R]  the kv_b_proj weight; rows of head h: [k_nope (n) | v (v)] = [W_UK_h ; W_UV_h]
  lengths   [B] or None   tokens each sequence had *before* the T new ones. None: every sequence had L - T, so
                          the new tokens are the cache's last T (causal, aligned bottom-right; L == T: no past).
                          Query i of sequence b sees keys j <= lengths[b] + i; cache rows past that are ignored
                          (so a ragged batch padded to L works; padding must be finite, HybridCache keeps zeros).
  out       [B,T,H,v]
NoPE: the r-wide slice is used as is, never rotated. Scores are scaled by `scale` (default (n+r)^-0.5).

`mla_attention_expanded` materialises k = [W_UK c | k_slice] and v = W_UV c for every head and calls torch SDPA
(a fused kernel: no T x T scores are formed in this code; see `causal_sdpa` for which kernel takes it on a GPU);
`mla_attention_absorbed` folds W_UK into the query and W_UV into the output and attends on the latent directly:
    score = (q_nope W_UK) . c + q_slice . k_slice,     out = (p . c) W_UV^T
They are the same function of the inputs (tested).

Packed batches (doc_ids: each query attends the keys of its own document, causally) take `document_attention`:
on a GPU torch's varlen flash kernel over the flattened batch (each document its own causal sequence), or
flex_attention with a document-causal BlockMask for head dims that kernel does not take (compiled: a fused kernel
that skips the key blocks of other documents); elsewhere SDPA with the dense [B,1,T,T] `document_mask` (the
reference; tested against each other).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from openk3.ops.norms import acc_dtype, compute_dtype

try:  # torch's variable-length flash attention (torch >= 2.9; CUDA)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None


def _causal_varlen_flag() -> dict:
    """varlen_attn's causal flag: window_size=(-1, 0) from torch 2.12, is_causal=True before."""
    if varlen_attn is None:
        return {}
    return {"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters \
        else {"is_causal": True}


CAUSAL_VARLEN = _causal_varlen_flag()  # read once, outside compiled code

FUSED = (SDPBackend.FLASH_ATTENTION.value, SDPBackend.CUDNN_ATTENTION.value)
# Serving and context parallelism attend without cuDNN. cuDNN builds an execution plan for every new shape (45-71
# ms on an H200, and a server sees a new prompt length at almost every request), and on the context-parallel path's
# tensors (q a slice of [L,H,d], one document per SDPA call) its backward gave wrong MLA gradients on an H200
# (torch 2.11, cuDNN 9.19: relative error 1.3 where memory-efficient attention agrees to bf16 rounding; the
# training path's tensors agreed; bench/RESULTS.md, 2026-12-01). Training keeps torch's choice (cuDNN there).
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def mla_mask(lengths: torch.Tensor, T: int, L: int) -> torch.Tensor:
    """Boolean [B,1,T,L]: True where query i of sequence b may attend key j (j <= lengths[b] + i)."""
    j = torch.arange(L, device=lengths.device)
    i = torch.arange(T, device=lengths.device)
    limit = lengths.view(-1, 1, 1) + i.view(1, T, 1)  # [B,T,1]
    return (j.view(1, 1, L) <= limit).unsqueeze(1)


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [B,1,T,T] for a packed batch: query i may attend key j <= i of its own document (doc_ids [B,T])."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)) & causal).unsqueeze(1)


def document_block_mask(doc_ids: torch.Tensor, block_size: int = 128) -> BlockMask:
    """flex_attention's BlockMask for a packed batch: `document_mask` as a mask_mod, per batch row (all heads).

    Built from the blocks' first and last document ids, O(B (T / block)^2), never the T x T mask
    (`create_block_mask` run eagerly evaluates the mask_mod at every query and key; compiled it fails for some
    lengths, see openk3.model.documents). Documents are contiguous, their ids non-decreasing along a row (as
    `Documents` numbers them), so key block j is visible from query block i iff j <= i and j's last document is
    at least i's first, and fully visible (no mask_mod) iff j < i and j's first document is i's last."""
    B, T = doc_ids.shape

    def document_causal(b, h, i, j):
        return (doc_ids[b, i] == doc_ids[b, j]) & (j <= i)

    starts = torch.arange(0, T, block_size, device=doc_ids.device)
    first, last = doc_ids[:, starts], doc_ids[:, (starts + block_size - 1).clamp(max=T - 1)]  # [B, blocks]
    blocks = torch.arange(starts.numel(), device=doc_ids.device)
    q, k = blocks.unsqueeze(1), blocks.unsqueeze(0)  # [nq,1], [1,nk]; below keys' documents [B,1,nk], queries' [B,nq,1]
    full = (k < q) & (first.unsqueeze(1) == last.unsqueeze(2))
    if T % block_size:
        full[:, -1] = False  # the last query block's padding rows see nothing (as create_block_mask has it)
    partial = (k <= q) & (last.unsqueeze(1) >= first.unsqueeze(2)) & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, nq, nk] bool -> the count per query block [B,1,nq] and the key blocks, those set first [B,1,nq,nk]."""
        indices = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
        return blocks.sum(-1).to(torch.int32).unsqueeze(1), indices.to(torch.int32).unsqueeze(1)

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block_size,
                                    mask_mod=document_causal, seq_lengths=(T, T))


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once (uncompiled it materialises the T x T scores)."""
    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor,
                            scale: float, block_mask: BlockMask | None = None) -> torch.Tensor:
    """`document_attention` through flex_attention with `block_mask` (built from doc_ids when None: pass the
    prebuilt one from a compiled caller, see openk3.model.documents). Inside a compiled region the
    surrounding graph compiles flex_attention; outside it the cached `compiled_flex_attention` runs. flex takes
    v's head dim as it is (MLA's dv < dk: no padding) and one dtype for q, k and v: under autocast they are cast
    to its dtype, as SDPA's autocast rule does."""
    dtype = compute_dtype(q)
    attend = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
    mask = block_mask if block_mask is not None else document_block_mask(doc_ids)
    return attend(q.to(dtype), k.to(dtype), v.to(dtype), block_mask=mask, scale=scale)


def uses_flex_attention(device: torch.device) -> bool:
    """Whether packed batches attend through flex_attention on `device` (CUDA), not the dense-mask SDPA, where
    `varlen_usable` does not take them."""
    return device.type == "cuda"


def varlen_usable(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `varlen_document_attention` takes q [.., dk], v [.., dv]: torch's varlen flash kernel on CUDA, in
    half precision (under autocast: its dtype), head dims up to 256 in multiples of 8 (v padded to dk)."""
    dtype = compute_dtype(q)
    return (varlen_attn is not None and q.is_cuda and dtype in (torch.bfloat16, torch.float16)
            and all(d % 8 == 0 and d <= 256 for d in (q.shape[-1], v.shape[-1])) and v.shape[-1] <= q.shape[-1])


def varlen_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """`document_attention` as one varlen flash call over the flattened batch: q [B,H,T,dk], k [B,H,T,dk],
    v [B,H,T,dv] (each a [B,T,H,d] tensor transposed, as `mla_attention_expanded` makes them: flattening is a
    view), cu_seqlens [N+1] int32 on the device (the documents' offsets in the B*T tokens) -> [B,H,T,dv]. Each
    document is its own causal sequence; no block of another document is visited. v is zero-padded to dk (the
    flash kernel takes one head dim), its padded columns dropped. T bounds every document's length (a constant
    for compiled code, where the longest document's length would be a new integer every batch)."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    dtype = compute_dtype(q)
    # contiguous [B*T, H, d] (a view for MLA's own tensors): the layout the op's fake output assumes under compile
    flat = lambda t: t.transpose(1, 2).reshape(B * T, H, t.shape[-1]).to(dtype).contiguous()
    v = v if dv == dk else F.pad(v, (0, dk - dv))
    o = varlen_attn(flat(q), flat(k), flat(v), cu_seqlens, cu_seqlens, T, T, scale=scale, **CAUSAL_VARLEN)
    return o[..., :dv].view(B, T, H, dv).transpose(1, 2)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, scale: float,
                       backends: list[SDPBackend] | None = None, block_mask: BlockMask | None = None,
                       cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Document-causal attention of a packed batch: q [B,H,T,dk], k [B,H,T,dk], v [B,H,T,dv], doc_ids [B,T] ->
    [B,H,T,dv]. Query i attends key j <= i of its own document: with cu_seqlens (device int32 [N+1], the same
    documents' offsets) the varlen flash kernel where `varlen_usable`, else flex_attention on CUDA (head dims
    from 16), else SDPA with the dense `document_mask` (`backends` as in `causal_sdpa`; flex and varlen take
    none)."""
    if cu_seqlens is not None and varlen_usable(q, v):
        return varlen_document_attention(q, k, v, cu_seqlens, scale)
    if uses_flex_attention(q.device) and min(q.shape[-1], v.shape[-1]) >= 16:  # flex's kernels: head dims >= 16
        return flex_document_attention(q, k, v, doc_ids, scale, block_mask)
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc_ids), scale=scale)


def _split_kv_b(kv_b: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int):
    w = kv_b.view(num_heads, nope_dim + v_dim, -1)
    return w[:, :nope_dim], w[:, nope_dim:]  # W_UK [H,n,R], W_UV [H,v,R]


def mla_expand_kv(kv_cache: torch.Tensor, kv_b: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int):
    """kv_cache [B,L,R+r] -> k [B,H,L,n+r], v [B,H,L,v] (the expanded per-head keys and values)."""
    B, L, _ = kv_cache.shape
    R = kv_b.shape[-1]
    latent, k_slice = kv_cache[..., :R], kv_cache[..., R:]
    kv = F.linear(latent, kv_b).view(B, L, num_heads, nope_dim + v_dim)
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    k = torch.cat([k_nope, k_slice.unsqueeze(2).expand(B, L, num_heads, k_slice.shape[-1])], dim=-1)
    return k.transpose(1, 2), v.transpose(1, 2)  # [B,L,H,*] in memory, like q: the layout the fused kernels read


def fused_sdpa_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """The SDPBackend value torch would run for causal attention on these tensors (no mask, no dropout)."""
    return torch._fused_sdp_choice(q, k, v, is_causal=True)


def padded_v_for_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """v zero-padded to q's head dim when torch would run neither flash nor cuDNN on (q, k, v) but would run one of
    them on the padded tensors; None otherwise (the rule `causal_sdpa` applies in eager mode)."""
    dk, dv = q.shape[-1], v.shape[-1]
    if dv >= dk or fused_sdpa_choice(q, k, v) in FUSED:
        return None
    padded = F.pad(v, (0, dk - dv))
    return padded if fused_sdpa_choice(q, k, padded) in FUSED else None


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Softmax attention over two disjoint key sets from each one's output [B,H,T,d] and log-sum-exp [B,H,T]:
    o = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2), in fp32, returned in o1's dtype."""
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = (lse1 - lse).exp().unsqueeze(-1), (lse2 - lse).exp().unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype)


def _flash_with_lse(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's flash attention kernel (CUDA, or its CPU counterpart; one head dim for q, k, v) with the log-sum-exp
    it keeps for backward: (out [B,H,T,d], lse [B,H,T] fp32)."""
    if q.is_cuda:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.reshape(q.shape[:3]).float()


def past_and_own_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Bottom-right causal attention of T queries over L > T keys as two flash calls merged by their log-sum-exps
    (`merge_attention`): the L - T past keys unmasked, the T own keys causally (a square mask), v zero-padded to
    q's head dim for the kernel (which takes head dims of multiples of 8 up to 256: `causal_sdpa` checks). On an
    H100 the bottom-right-masked call ran at ~100 TFLOP/s for a 16k-token chunk over 256k keys, this at ~270:
    207 -> 79 ms a layer (bench/long_prefill_attention.py, 2026-12-05).
    q [B,H,T,dk], k [B,H,L,dk], v [B,H,L,dv] -> [B,H,T,dv]."""
    T, L, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    v = F.pad(v, (0, q.shape[-1] - dv))
    past = _flash_with_lse(q, k[:, :, :L - T], v[:, :, :L - T], False, scale)
    own = _flash_with_lse(q, k[:, :, L - T:], v[:, :, L - T:], True, scale)
    return merge_attention(*past, *own)[..., :dv]


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, pad_v: bool | None = None,
                backends: list[SDPBackend] | None = None) -> torch.Tensor:
    """Causal softmax attention through torch SDPA. q [B,H,T,dk]; k [B,H,L,dk], v [B,H,L,dv] -> [B,H,T,dv]; with
    L > T the queries are the last T positions (a bottom-right-aligned mask, which the fused kernels take as such,
    without a dense L x T mask). `backends`: the SDPA kernels allowed (None: torch's choice; `NO_CUDNN`).

    MLA has dk = n + r (192 in K3) > dv (128). Flash attention needs one head dim for q, k and v; cuDNN takes 192 /
    128 forward and backward on sm90 (cuDNN >= 9.11), and torch tries it first on an H200 when its cuDNN is newer
    than 9.15; otherwise torch takes memory-efficient attention (fused too, slower than flash) on a GPU and its
    math fallback (T x T scores) on a CPU. pad_v=None (auto, eager mode): `padded_v_for_flash` (GPU: flash at 20%
    more attention FLOPs for 192 / 128; CPU: its flash kernel, faster than the math fallback); the
    padded output columns are dropped. pad_v=True / False forces it. `python bench/train.py gpu` prints the
    choice and times both."""
    dv = v.shape[-1]
    T, L = q.shape[-2], k.shape[-2]
    if L > T and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256 \
            and q.shape[-1] % 8 == 0 \
            and not torch.compiler.is_compiling() and not (q.requires_grad or k.requires_grad or v.requires_grad) \
            and (backends is None or SDPBackend.FLASH_ATTENTION in backends):
        return past_and_own_attention(q, k, v, scale)  # a prompt's chunk after its past (serving; no gradient)
    mask = None if L == T else causal_lower_right(T, L)
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        if pad_v is None:
            padded = None if torch.compiler.is_compiling() else padded_v_for_flash(q, k, v)
        else:
            padded = F.pad(v, (0, q.shape[-1] - dv)) if pad_v else None
        out = F.scaled_dot_product_attention(q, k, v if padded is None else padded, attn_mask=mask,
                                             is_causal=mask is None, scale=scale)
    return out if padded is None else out[..., :dv]


def mla_attention_expanded(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_b: torch.Tensor,
    *,
    nope_dim: int,
    v_dim: int,
    scale: float | None = None,
    lengths: torch.Tensor | None = None,
    backends: list[SDPBackend] | None = None,
    doc_ids: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expanded-K/V MLA through torch SDPA (the prefill / training path; `backends` as in `causal_sdpa`). Returns
    [B,T,H,v]. doc_ids [B,T] (a packed batch, no past: L == T): each query attends its own document only
    (`document_attention`: varlen flash attention on CUDA given `cu_seqlens`, the documents' offsets on the
    device, else flex_attention with `block_mask`, the prebuilt mask of doc_ids if given; the dense-mask SDPA
    elsewhere)."""
    B, T, H, _ = q.shape
    L = kv_cache.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = mla_expand_kv(kv_cache, kv_b, H, nope_dim, v_dim)
    qh = q.transpose(1, 2)  # [B,H,T,n+r]
    if doc_ids is not None:
        if lengths is not None or L != T or tuple(doc_ids.shape) != (B, T):
            raise ValueError(f"doc_ids [B,T] = {(B, T)} take no past (L == T, no lengths), got doc_ids "
                             f"{tuple(doc_ids.shape)}, L={L}")
        o = document_attention(qh, k, v, doc_ids, scale, backends, block_mask, cu_seqlens)
    elif lengths is None:
        if L < T:
            raise ValueError(f"the cache must hold the T={T} new tokens, got L={L}")
        o = causal_sdpa(qh, k, v, scale, backends=backends)
    else:
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mla_mask(lengths, T, L), scale=scale)
    return o.transpose(1, 2)


def mla_attention_absorbed(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_b: torch.Tensor,
    *,
    nope_dim: int,
    v_dim: int,
    scale: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-absorbed MLA directly on the latent cache (the decode path). Returns [B,T,H,v]."""
    B, T, H, _ = q.shape
    L = kv_cache.shape[1]
    R = kv_b.shape[-1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    w_uk, w_uv = _split_kv_b(kv_b, H, nope_dim, v_dim)
    latent, k_slice = kv_cache[..., :R], kv_cache[..., R:]
    q_nope, q_slice = q[..., :nope_dim], q[..., nope_dim:]
    q_latent = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)
    scores = torch.einsum("bthr,blr->bhtl", q_latent, latent) + torch.einsum("bthp,blp->bhtl", q_slice, k_slice)
    scores = scores.to(acc_dtype(q.dtype)) * scale
    if lengths is None:
        if L != T:
            raise ValueError(f"without lengths the cache must hold exactly the T={T} new tokens, got L={L}")
        lengths = torch.zeros(B, dtype=torch.long, device=q.device)
    scores = scores.masked_fill(~mla_mask(lengths, T, L), float("-inf"))
    p = scores.softmax(-1).to(latent.dtype)
    o_latent = torch.einsum("bhtl,blr->bthr", p, latent)
    return torch.einsum("bthr,hvr->bthv", o_latent, w_uv)
