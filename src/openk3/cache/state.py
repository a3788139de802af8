"""Per-sequence decode state: what one sequence carries between forward calls (see `openk3.cache`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KDAState:
    """One KDA layer of one sequence. conv [C, W-1]: the last W-1 pre-conv q|k|v inputs (model dtype,
    C = 2*H*K + H*V, zeros before the first token); recurrent [H, K, V]: the delta-rule state S (fp32).
    Constant size however long the sequence is; it cannot be rewound, only checkpointed and restored."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    def clone(self) -> KDAState:
        return KDAState(self.conv.clone(), self.recurrent.clone())

    def to(self, device: torch.device | str) -> KDAState:
        return KDAState(self.conv.to(device), self.recurrent.to(device))

    def nbytes(self) -> int:
        return _nbytes(self.conv) + _nbytes(self.recurrent)


@dataclass
class MLAState:
    """One MLA layer of one sequence. latent [len, R + r]: per token [RMSNorm(latent) (kv_lora_rank R) |
    k_slice (qk_rope_head_dim r)], model dtype. Appendable and cuttable at any token count."""

    latent: torch.Tensor

    def clone(self) -> MLAState:
        return MLAState(self.latent.clone())

    def to(self, device: torch.device | str) -> MLAState:
        return MLAState(self.latent.to(device))

    def cut(self, n: int) -> MLAState:
        """The first n tokens (a copy)."""
        if not 0 <= n <= self.latent.shape[0]:
            raise ValueError(f"cannot cut an MLA latent of {self.latent.shape[0]} tokens at n={n}")
        return MLAState(self.latent[:n].clone())

    def nbytes(self) -> int:
        return _nbytes(self.latent)


LayerState = KDAState | MLAState


@dataclass
class SequenceState:
    """Everything one sequence needs to continue decoding: `length` tokens seen, and one state per decoder
    layer (`layers[i]` is a KDAState for a KDA layer, an MLAState for an MLA layer). Self-contained: its tensors
    are copies, not views of a batch cache.

    For a hybrid prefix cache (SPEC §7): `kda_states()` gives the constant-size KDA part to checkpoint at a
    512-token boundary; `mla_states()` the per-token latents; `cut(n, kda_states)` rebuilds the state of the
    first n tokens from the latents (cut at n) and a KDA checkpoint taken at n; `assemble` builds one from parts.
    """

    length: int
    layers: list[LayerState]

    def clone(self) -> SequenceState:
        return SequenceState(self.length, [s.clone() for s in self.layers])

    def to(self, device: torch.device | str) -> SequenceState:
        return SequenceState(self.length, [s.to(device) for s in self.layers])

    def kda_states(self) -> dict[int, KDAState]:
        """{layer index: KDAState} (copies): the checkpoint of this sequence's KDA layers at `length` tokens."""
        return {i: s.clone() for i, s in enumerate(self.layers) if isinstance(s, KDAState)}

    def mla_states(self) -> dict[int, MLAState]:
        """{layer index: MLAState} (copies)."""
        return {i: s.clone() for i, s in enumerate(self.layers) if isinstance(s, MLAState)}

    def cut(self, n: int, kda_states: dict[int, KDAState] | None = None) -> SequenceState:
        """The state after the first n tokens: every MLA latent cut to n tokens, and the KDA layers taken from
        `kda_states` (a checkpoint made at exactly n tokens). With n == length the KDA states may be omitted
        (they are kept); otherwise they are required, since a recurrent state cannot be rewound."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cut position n={n} must be in [0, length={self.length}]")
        if kda_states is None and n != self.length and any(isinstance(s, KDAState) for s in self.layers):
            raise ValueError(
                f"cutting at n={n} < length={self.length} needs the KDA checkpoint taken at n (kda_states=...)"
            )
        layers: list[LayerState] = []
        for i, s in enumerate(self.layers):
            if isinstance(s, MLAState):
                layers.append(s.cut(n))
            elif kda_states is not None:
                if i not in kda_states:
                    raise ValueError(f"kda_states lacks KDA layer {i}; it has {sorted(kda_states)}")
                layers.append(kda_states[i].clone())
            else:
                layers.append(s.clone())
        return SequenceState(n, layers)

    @classmethod
    def assemble(
        cls, length: int, kda_states: dict[int, KDAState], mla_states: dict[int, MLAState]
    ) -> SequenceState:
        """Build from parts (e.g. a KDA checkpoint and MLA latent pages). MLA latents must hold `length` tokens."""
        n_layers = len(kda_states) + len(mla_states)
        if set(kda_states) & set(mla_states) or set(kda_states) | set(mla_states) != set(range(n_layers)):
            raise ValueError(
                f"layer indices must split 0..{n_layers - 1} between KDA {sorted(kda_states)} "
                f"and MLA {sorted(mla_states)}"
            )
        for i, s in mla_states.items():
            if s.latent.shape[0] != length:
                raise ValueError(f"MLA layer {i} holds {s.latent.shape[0]} tokens, expected length={length}")
        layers = [kda_states[i] if i in kda_states else mla_states[i] for i in range(n_layers)]
        return cls(length, [s.clone() for s in layers])

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
