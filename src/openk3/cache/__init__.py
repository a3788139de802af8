"""Decode cache for the hybrid KDA / MLA model.

A batch of B sequences (`HybridCache`), possibly of different lengths (`cache.lengths`, LongTensor [B]):
  - KDA layer: conv state [B, 2HK+HV, W-1] (the last W-1 pre-conv q|k|v inputs, model dtype) and the recurrent
    state [B, H, K, V] (fp32). Constant size per sequence.
  - MLA layer: latent buffer [B, capacity, kv_lora_rank + qk_rope_head_dim] (model dtype): per token
    [RMSNorm(latent) | k_slice], shared by all heads; rows are valid up to lengths[b], attention masks the rest,
    so batched single-token decode of ragged sequences works.

`model.new_cache(B)` makes an empty one; `model(ids, cache=cache)` appends ids' T tokens to every sequence and
updates the cache in place. `cache.extract(i)` returns a self-contained `SequenceState` (length, and per layer a
`KDAState` or `MLAState`); `HybridCache.from_sequences([...])` rebuilds a batch. `SequenceState.clone`,
`.kda_states()` (a KDA checkpoint), `.cut(n, kda_states)` (MLA latents cut at n + the KDA checkpoint taken at n)
and `SequenceState.assemble` serve a hybrid prefix cache (SPEC §7). The model's forward (prefill, `openk3
generate`) uses these.

The serving engine keeps its sequences in pools preallocated once instead: `openk3.cache.paged` (`PagePool`: MLA
latent pages, ref-counted and shared by reference; `BlockTables`: each running sequence's pages) and
`openk3.cache.state_pool` (`StatePool`: one KDA slot per running sequence), read in place by the decode step
(`openk3.model.decode`).
"""

from openk3.cache.hybrid import HybridCache, KDALayerCache, MLALayerCache
from openk3.cache.state import KDAState, LayerState, MLAState, SequenceState

__all__ = ["HybridCache", "KDALayerCache", "MLALayerCache", "KDAState", "MLAState", "LayerState", "SequenceState"]
