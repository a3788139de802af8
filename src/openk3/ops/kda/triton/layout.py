"""Token layout shared by the KDA kernels: every batch is handled as one flat variable-length batch.

[B,T,H,*] without cu_seqlens is viewed as [B*T,H,*] with sequences [0,T), [T,2T), ...; chunks of BT tokens
start at each sequence's first token, so a chunk never straddles two sequences (the last one may be short).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

CHUNK = 16  # tokens per chunk: a 16-token span keeps exp(+-G) inside fp32 range for g >= -5 (SPEC §2)


@dataclass(frozen=True)
class ChunkLayout:
    cu_seqlens: torch.Tensor  # [N+1] int32, token offsets of the sequences in the flat batch
    chunk_offsets: torch.Tensor  # [N+1] int32, index of each sequence's first chunk
    chunk_bounds: torch.Tensor  # [n_chunks, 2] int32, first token and end token of every chunk
    n_seqs: int
    n_chunks: int


@functools.lru_cache(maxsize=64)
def _dense_layout(batch: int, seq_len: int, device: torch.device) -> ChunkLayout:
    """Equal-length batch: tables built on the device, no host round trip; cached per shape."""
    per_seq = -(-seq_len // CHUNK)
    i32 = dict(dtype=torch.int32, device=device)
    starts = (torch.arange(batch, **i32)[:, None] * seq_len + torch.arange(per_seq, **i32)[None, :] * CHUNK)
    ends = torch.minimum(starts + CHUNK, (torch.arange(batch, **i32)[:, None] + 1) * seq_len)
    n_chunks = batch * per_seq
    bounds = torch.stack([starts, ends], dim=-1).reshape(-1, 2) if n_chunks else torch.zeros(1, 2, **i32)
    return ChunkLayout(
        cu_seqlens=torch.arange(batch + 1, **i32) * seq_len,
        chunk_offsets=torch.arange(batch + 1, **i32) * per_seq,
        chunk_bounds=bounds.contiguous(),
        n_seqs=batch,
        n_chunks=n_chunks,
    )


def chunk_layout(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device) -> ChunkLayout:
    """Sequence and chunk tables for the flat token layout (reads cu_seqlens on the host when given)."""
    if cu_seqlens is None:
        return _dense_layout(batch, seq_len, torch.device(device))
    offsets = cu_seqlens.detach().to("cpu", torch.int64)
    per_seq = (offsets[1:] - offsets[:-1] + CHUNK - 1) // CHUNK
    chunk_offsets = torch.cat([offsets.new_zeros(1), per_seq.cumsum(0)])
    n_chunks = int(chunk_offsets[-1])
    seq = torch.repeat_interleave(torch.arange(len(per_seq)), per_seq)
    starts = offsets[seq] + (torch.arange(n_chunks) - chunk_offsets[seq]) * CHUNK
    bounds = torch.stack([starts, torch.minimum(starts + CHUNK, offsets[seq + 1])], dim=-1)
    as_i32 = lambda x: x.to(device=device, dtype=torch.int32)
    return ChunkLayout(
        cu_seqlens=as_i32(offsets),
        chunk_offsets=as_i32(chunk_offsets),
        chunk_bounds=as_i32(bounds if n_chunks else torch.zeros(1, 2, dtype=torch.int64)),
        n_seqs=len(per_seq),
        n_chunks=n_chunks,
    )
