"""Document boundaries of a packed batch (`openk3 train --packing docs`).

A packed batch [B,T] holds whole or cut documents back to back in each row. `Documents` says where they start,
in the forms the layers read:
  cu_seqlens  host int64 [N+1]: document offsets in the flattened batch (B*T tokens); every row starts a document.
              The KDA layers run varlen on it (Triton kernels), the recurrent state starting at zero per document.
  doc_ids     [B,T] int64 on the model's device: each token's document, numbered across the whole batch. MLA
              attends where the query's and the key's documents are equal (and causally).
  starts      [B,T] int64 on the model's device: the row index of the first token of each token's document. The
              short conv of token t reads inputs from starts[t] on (zeros before: its window resets), and the
              torch KDA paths reset the state at the tokens where starts[t] == t.
  device_cu_seqlens  cu_seqlens as int32 on CUDA (None elsewhere): MLA's varlen flash attention reads it.
  block_mask  flex_attention's BlockMask of doc_ids on CUDA (None elsewhere), for the MLA head dims the varlen
              kernel does not take; built once a batch when the documents move to the device, outside any
              compiled code: every MLA layer reads the one mask, and a compiled layer takes it as an input (built
              inside, a block over a new sequence length made Inductor fail with CantSplit: the MTP block attends
              over T - 1 positions after the main layers' T).
The number of documents changes from batch to batch: the cu_seqlens tensors are marked dynamic for torch.compile
from the start (one compiled graph for every count, not one for the first batch's and one for the rest).
Everything is built on the host from per-token segment ids (any integers, equal within a document and changing
at each boundary, e.g. each token's document index in the data stream), so nothing reads the GPU back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from openk3.ops.attention import document_block_mask, uses_flex_attention
from openk3.ops.transfer import queued


def same_document(segments: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [B, T-k] for segment ids [B,T] (host): token t and token t+k lie in one document (ids never recur
    within a row once they change, as the data stream's document indices)."""
    return segments[:, k:] == segments[:, :-k]


@dataclass(frozen=True)
class Documents:
    segments: torch.Tensor  # host [B,T]: the segment ids it was built from
    cu_seqlens: torch.Tensor
    doc_ids: torch.Tensor
    starts: torch.Tensor
    device_cu_seqlens: torch.Tensor | None = None
    block_mask: BlockMask | None = None

    @classmethod
    def from_segments(cls, segments: torch.Tensor) -> Documents:
        """Documents of a batch whose tokens carry segment ids [B,T] (host): a document ends where the id changes
        and at every row end."""
        if segments.dim() != 2 or segments.shape[1] == 0:
            raise ValueError(f"segments must be [B,T] with T >= 1, got shape {tuple(segments.shape)}")
        segments = segments.detach().cpu()
        B, T = segments.shape
        first = torch.ones(B, T, dtype=torch.bool)
        first[:, 1:] = segments[:, 1:] != segments[:, :-1]
        flat = first.flatten()
        index = torch.arange(B * T)
        offsets = index[flat]
        cu = torch.cat([offsets, torch.tensor([B * T])])
        torch._dynamo.maybe_mark_dynamic(cu, 0)
        doc_ids = (flat.long().cumsum(0) - 1).view(B, T)
        starts = offsets[doc_ids].view(B, T) - torch.arange(B).unsqueeze(1) * T
        return cls(segments, cu, doc_ids, starts)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.doc_ids.shape)

    @property
    def resets(self) -> torch.Tensor:
        """Bool [B,T]: the tokens that begin a document."""
        return self.starts == torch.arange(self.shape[1], device=self.starts.device)

    def to(self, device: torch.device | str) -> Documents:
        """The device tensors on `device` (`queued`), with device_cu_seqlens and the block mask there on CUDA;
        cu_seqlens stays on the host."""
        doc_ids = queued(self.doc_ids, device)
        device_cu, mask = None, None
        if uses_flex_attention(doc_ids.device):
            device_cu, mask = queued(self.cu_seqlens.to(torch.int32), device), document_block_mask(doc_ids)
            torch._dynamo.maybe_mark_dynamic(device_cu, 0)
        return Documents(self.segments, self.cu_seqlens, doc_ids, queued(self.starts, device), device_cu, mask)

    def prefix(self, length: int) -> Documents:
        """The documents of the first `length` positions of every row (an MTP layer's positions)."""
        return Documents.from_segments(self.segments[:, :length]).to(self.doc_ids.device)

    def check(self, batch: int, seq_len: int) -> None:
        if self.shape != (batch, seq_len):
            raise ValueError(f"documents describe a batch of {self.shape}, the input is {(batch, seq_len)}")
