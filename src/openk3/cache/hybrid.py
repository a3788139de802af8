"""The batched decode cache of the hybrid model (see `openk3.cache` for the contract)."""

from __future__ import annotations

import torch

from openk3.cache.state import KDAState, MLAState, SequenceState
from openk3.config import ModelConfig
from openk3.ops.transfer import to_device


class KDALayerCache:
    """One KDA layer for a batch: conv_state [B, C, W-1] (model dtype), recurrent_state [B, H, K, V] (fp32)."""

    kind = "kda"

    def __init__(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor):
        self.conv_state = conv_state
        self.recurrent_state = recurrent_state

    def extract(self, i: int) -> KDAState:
        return KDAState(self.conv_state[i].clone(), self.recurrent_state[i].clone())


class MLALayerCache:
    """One MLA layer for a batch: buffer [B, capacity, R + r] (model dtype); row b is valid up to the cache's
    lengths[b]; the rest is padding that attention masks out. Capacity doubles as needed."""

    kind = "mla"

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer

    def append(self, new: torch.Tensor, lengths: torch.Tensor, max_after: int) -> torch.Tensor:
        """Write new [B,T,R+r] at positions lengths[b] .. lengths[b]+T-1 of each row; return the buffer's
        first `max_after` (= max(lengths) + T) positions [B, max_after, R+r]."""
        B, T, _ = new.shape
        if max_after > self.buffer.shape[1]:
            capacity = max(max_after, 2 * self.buffer.shape[1], 16)
            grown = self.buffer.new_zeros(B, capacity, self.buffer.shape[2])
            grown[:, : self.buffer.shape[1]] = self.buffer
            self.buffer = grown
        pos = lengths.view(B, 1) + torch.arange(T, device=lengths.device).view(1, T)
        rows = torch.arange(B, device=lengths.device).view(B, 1).expand(B, T)
        self.buffer[rows, pos] = new.to(self.buffer.dtype)
        return self.buffer[:, :max_after]

    def extract(self, i: int, length: int) -> MLAState:
        return MLAState(self.buffer[i, :length].clone())


class HybridCache:
    """Decode state for a batch of B sequences of possibly different lengths.

    Attributes:
      lengths  LongTensor [B]: tokens each sequence has seen (on the cache's device).
      layers   one entry per decoder layer i: a KDALayerCache for a KDA layer, an MLALayerCache for an MLA layer.

    Use: `cache = model.new_cache(B)`; `model(ids, cache=cache)` appends ids' T tokens to every sequence and
    updates the cache in place (the model calls `advance(T)` after all layers ran). Per sequence:
    `cache.extract(i)` -> SequenceState (copies); `HybridCache.from_sequences([...])` -> a new batch.

    KDA checkpoints inside one forward: set `checkpoint_offsets` (token counts 1..T into the next forward) before
    calling the model; every KDA layer then records its batch state after that many of the new tokens in
    `checkpoints[offset][layer index] = KDALayerCache` (copies), so a prefix cache can snapshot every hash-block
    boundary of a long prefill chunk in one forward (SPEC §7). Offsets are cleared by `advance`.

    Right-padded rows in one forward: set `num_tokens` [B] (the real new tokens of each row, the rest padding at its
    end) before calling the model. The padding leaves every KDA state where the row's real tokens put it; its MLA
    latents land past the row's length, where nothing reads them before they are overwritten. A serving engine
    prefills prompts of different lengths together this way; `advance` clears it.
    """

    def __init__(self, layers: list[KDALayerCache | MLALayerCache], lengths: list[int], device: torch.device):
        self.layers = layers
        self._lengths = list(lengths)
        self.lengths = to_device(self._lengths, device, torch.long)
        self.checkpoint_offsets: tuple[int, ...] = ()
        self.checkpoints: dict[int, dict[int, KDALayerCache]] = {}
        self.num_tokens: torch.Tensor | None = None

    def record_checkpoint(self, offset: int, layer_idx: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Called by KDA layers for each requested offset (see the class docstring)."""
        self.checkpoints.setdefault(offset, {})[layer_idx] = KDALayerCache(conv.clone(), recurrent.clone())

    @property
    def batch_size(self) -> int:
        return len(self._lengths)

    @property
    def max_length(self) -> int:
        return max(self._lengths, default=0)

    @property
    def host_lengths(self) -> list[int]:
        """`lengths` as known on the host (no device read)."""
        return list(self._lengths)

    @property
    def uniform(self) -> bool:
        """Every sequence has the same length (known on the host: no device read)."""
        return len(set(self._lengths)) <= 1

    @classmethod
    def empty(
        cls,
        cfg: ModelConfig,
        batch_size: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        capacity: int = 0,
    ) -> HybridCache:
        """Zero state for `batch_size` empty sequences. `capacity`: MLA tokens to preallocate (grows anyway)."""
        device = torch.device(device)
        H, K = cfg.kda.num_heads, cfg.kda_head_dim
        conv_channels, W = 3 * H * K, cfg.kda.conv_kernel
        latent = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
        layers: list[KDALayerCache | MLALayerCache] = []
        for i in range(cfg.num_layers):
            if cfg.layer_kind(i) == "kda":
                layers.append(
                    KDALayerCache(
                        torch.zeros(batch_size, conv_channels, W - 1, dtype=dtype, device=device),
                        torch.zeros(batch_size, H, K, K, dtype=torch.float32, device=device),
                    )
                )
            else:
                layers.append(MLALayerCache(torch.zeros(batch_size, capacity, latent, dtype=dtype, device=device)))
        return cls(layers, [0] * batch_size, device)

    def advance(self, num_tokens: int) -> None:
        """Record that every sequence got `num_tokens` more tokens (called by the model after a forward)."""
        self._lengths = [n + num_tokens for n in self._lengths]
        self.lengths = self.lengths + num_tokens
        self.checkpoint_offsets = ()
        self.num_tokens = None

    def rewind(self, kept: list[int], forwarded: int) -> None:
        """Keep only the first kept[b] of the `forwarded` tokens of the last forward, per sequence (speculative
        decoding's rollback, SPEC §11): KDA layers take the states recorded after kept[b] tokens (that forward's
        `checkpoint_offsets` must include every kept[b] < forwarded), MLA layers only get shorter (the rows past
        the length are masked and later overwritten)."""
        if len(kept) != self.batch_size or not all(1 <= n <= forwarded for n in kept):
            raise ValueError(f"kept must give 1..{forwarded} tokens for each of {self.batch_size} sequences, "
                             f"got {kept}")
        kda = [i for i, layer in enumerate(self.layers) if isinstance(layer, KDALayerCache)]
        for b, n in enumerate(kept):
            if n == forwarded or not kda:
                continue
            if n not in self.checkpoints:
                raise ValueError(f"no KDA checkpoint was recorded after {n} tokens (checkpoint_offsets)")
            for i in kda:
                saved = self.checkpoints[n][i]
                self.layers[i].conv_state[b] = saved.conv_state[b]
                self.layers[i].recurrent_state[b] = saved.recurrent_state[b]
        self._lengths = [length - forwarded + n for length, n in zip(self._lengths, kept)]
        self.lengths = to_device(self._lengths, self.lengths.device, torch.long)

    def extract(self, i: int) -> SequenceState:
        """A self-contained copy of sequence i's state."""
        if not 0 <= i < self.batch_size:
            raise IndexError(f"sequence index {i} out of range for a batch of {self.batch_size}")
        n = self._lengths[i]
        return SequenceState(
            n, [c.extract(i) if isinstance(c, KDALayerCache) else c.extract(i, n) for c in self.layers]
        )

    @classmethod
    def from_sequences(cls, states: list[SequenceState], device: torch.device | str | None = None) -> HybridCache:
        """A batch cache from per-sequence states (lengths may differ; MLA latents are right-padded)."""
        if not states:
            raise ValueError("from_sequences needs at least one SequenceState")
        n_layers = len(states[0].layers)
        if device is None:
            first = states[0].layers[0] if n_layers else None
            device = (first.conv if isinstance(first, KDAState) else first.latent).device if first else "cpu"
        device = torch.device(device)
        layers: list[KDALayerCache | MLALayerCache] = []
        for i in range(n_layers):
            per_seq = [s.layers[i] for s in states]
            if len(set(map(type, per_seq))) != 1 or any(len(s.layers) != n_layers for s in states):
                raise ValueError(f"sequence states disagree on the layer layout at layer {i}")
            if isinstance(per_seq[0], KDAState):
                layers.append(
                    KDALayerCache(
                        torch.stack([s.conv for s in per_seq]).to(device),
                        torch.stack([s.recurrent for s in per_seq]).to(device),
                    )
                )
            else:
                L = max(s.latent.shape[0] for s in per_seq)
                ref = per_seq[0].latent
                buf = torch.zeros(len(states), L, ref.shape[-1], dtype=ref.dtype, device=device)
                for b, s in enumerate(per_seq):
                    buf[b, : s.latent.shape[0]] = s.latent
                layers.append(MLALayerCache(buf))
        for s in states:
            for i, layer in enumerate(s.layers):
                if isinstance(layer, MLAState) and layer.latent.shape[0] != s.length:
                    raise ValueError(f"MLA layer {i} holds {layer.latent.shape[0]} tokens but length={s.length}")
        return cls(layers, [s.length for s in states], device)

    def nbytes(self) -> int:
        total = 0
        for c in self.layers:
            if isinstance(c, KDALayerCache):
                total += sum(t.numel() * t.element_size() for t in (c.conv_state, c.recurrent_state))
            else:
                total += c.buffer.numel() * c.buffer.element_size()
        return total
