"""The KDA state pool of the serving engine: one preallocated slot per running sequence.

Per KDA layer j: `conv[j]` [num_slots + 1, C, W-1] (model dtype; the last W-1 pre-conv q|k|v inputs) and
`recurrent[j]` [num_slots + 1, H, K, V] (fp32, the delta-rule state S; SPEC §2), each contiguous, so the decode
kernels (`kda_decode`, `causal_conv_step`) update a batch's slots in place. The extra last slot is the padding
slot: the padding rows of a CUDA-graph batch run on it, and nothing reads it.

A prefix-cache KDA checkpoint is {"conv": [n_kda, C, W-1], "recurrent": [n_kda, H, K, V]}: `snapshot` copies a
slot out into one, `load` copies one into a slot.
"""

from __future__ import annotations

import torch

from openk3.config import ModelConfig


class StatePool:
    def __init__(self, cfg: ModelConfig, num_slots: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise ValueError(f"the state pool needs >= 1 slot, got num_slots={num_slots}")
        n_kda, H, K = len(cfg.kda_layers), cfg.kda.num_heads, cfg.kda_head_dim
        self.conv = torch.zeros(n_kda, num_slots + 1, 3 * H * K, cfg.kda.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(n_kda, num_slots + 1, H, K, K, dtype=torch.float32, device=device)
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_slots = num_slots

    @property
    def padding_slot(self) -> int:
        return self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free slot (its state zeroed: an empty sequence), or None when all are taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.reset(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def snapshot(self, slot: int) -> dict[str, torch.Tensor]:
        """A checkpoint (copies) of every KDA layer's state in `slot`."""
        return {"conv": self.conv[:, slot].clone(), "recurrent": self.recurrent[:, slot].clone()}

    def load(self, slot: int, checkpoint: dict[str, torch.Tensor]) -> None:
        self.conv[:, slot].copy_(checkpoint["conv"])
        self.recurrent[:, slot].copy_(checkpoint["recurrent"])

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [n_kda, B, C, W-1], recurrent [n_kda, B, H, K, V]) copies of the states in `slots` [B]."""
        return self.conv[:, slots], self.recurrent[:, slots]

    def scatter(self, slots: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Write states back ([n_kda, B, ...] as from `gather`)."""
        self.conv[:, slots] = conv.to(self.conv.dtype)
        self.recurrent[:, slots] = recurrent
