"""Token layout shared by the KDA kernels: every batch is handled as one flat variable-length batch.

[B,T,H,*] without cu_seqlens is viewed as [B*T,H,*] with sequences [0,T), [T,2T), ...; chunks of BT tokens
start at each sequence's first token, so a chunk never straddles two sequences (the last one may be short).

The token-parallel kernels take their chunks from a schedule, rows of (chunk index, first token, end token), in
the order the forward state pass consumes them: by position from each sequence's start.
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
    schedule: torch.Tensor  # [n_chunks, 3] int32: chunk index, first token, end token; by position from start
    n_seqs: int
    n_chunks: int  # rows of the schedule (chunk-indexed buffers have this many rows); may include empty ones


def _build(offsets: torch.Tensor, n_rows: int) -> ChunkLayout:
    """Tables from int64 sequence offsets [N+1] on their device, without reading them on the host: `n_rows` is
    the number of chunks, or an upper bound on it; rows past the real chunks are empty (first token = end token
    = 0) and come last in the schedule, so the kernels launched over them do nothing."""
    device = offsets.device
    N = len(offsets) - 1
    per_seq = (offsets[1:] - offsets[:-1] + CHUNK - 1) // CHUNK
    chunk_offsets = torch.cat([offsets.new_zeros(1), per_seq.cumsum(0)])
    index = torch.arange(n_rows, device=device)
    seq = torch.searchsorted(chunk_offsets[1:], index, right=True)  # N past the last real chunk
    real = seq < N
    seq = seq.clamp(max=max(N - 1, 0))
    pos = index - chunk_offsets[seq]
    starts = torch.where(real, offsets[seq] + pos * CHUNK, 0)
    rows = torch.stack([index, starts, torch.where(real, torch.minimum(starts + CHUNK, offsets[seq + 1]), 0)], -1)

    if n_rows == 0:
        schedule = torch.zeros(1, 3, dtype=torch.int32, device=device)
    else:
        key = torch.where(real, pos * N + seq, n_rows * (N + 1) + index)
        schedule = rows[torch.argsort(key)].to(torch.int32).contiguous()
    return ChunkLayout(
        cu_seqlens=offsets.to(torch.int32),
        chunk_offsets=chunk_offsets.to(torch.int32),
        schedule=schedule,
        n_seqs=N,
        n_chunks=n_rows,
    )


@functools.lru_cache(maxsize=64)
def _dense_layout(batch: int, seq_len: int, device: torch.device) -> ChunkLayout:
    """Equal-length batch: built once per shape and device (exact chunk count)."""
    return _build(torch.arange(batch + 1, device=device) * seq_len, batch * -(-seq_len // CHUNK))


def chunk_layout(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device) -> ChunkLayout:
    """Sequence and chunk tables for the flat token layout, built on `device` without a host round trip (host
    cu_seqlens are copied from pinned memory, queued). With cu_seqlens (B = 1, seq_len = all tokens) the tables
    hold seq_len // CHUNK + N rows, an upper bound on the chunk count (each sequence adds at most one partial
    chunk); the extra rows are empty."""
    if cu_seqlens is None:
        return _dense_layout(batch, seq_len, torch.device(device))
    offsets = cu_seqlens.detach().to(torch.int64)
    if offsets.device.type == "cpu" and torch.device(device).type == "cuda":
        offsets = offsets.pin_memory()
    offsets = offsets.to(device, non_blocking=True)
    return _build(offsets, batch * seq_len // CHUNK + len(offsets) - 1)
