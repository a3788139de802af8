"""Token layout shared by the KDA kernels: every batch is handled as one flat variable-length batch.

[B,T,H,*] without cu_seqlens is viewed as [B*T,H,*] with sequences [0,T), [T,2T), ...; chunks of BT tokens
start at each sequence's first token, so a chunk never straddles two sequences (the last one may be short).

The token-parallel kernels take their chunks from a schedule, rows of (chunk index, first token, end token), in
the order the state passes consume them: by position from each sequence's start for the forward pass, by
position from its end for the reverse pass. The reverse pass, running beside the prepare kernel that feeds it
(overlap.py), then finds its next chunk done early.
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
    fwd_schedule: torch.Tensor  # [n_chunks, 3] int32: chunk index, first token, end token; by position from start
    bwd_schedule: torch.Tensor  # the same rows by position from the sequence's end
    n_seqs: int
    n_chunks: int


def _build(offsets: torch.Tensor, per_seq: torch.Tensor, n_chunks: int) -> ChunkLayout:
    """Tables from int64 sequence offsets [N+1] and chunks per sequence [N], on their device (no host sync)."""
    device = offsets.device
    N = len(per_seq)
    chunk_offsets = torch.cat([offsets.new_zeros(1), per_seq.cumsum(0)])
    seq = torch.repeat_interleave(torch.arange(N, device=device), per_seq, output_size=n_chunks)
    pos = torch.arange(n_chunks, device=device) - chunk_offsets[seq]
    starts = offsets[seq] + pos * CHUNK
    rows = torch.stack([torch.arange(n_chunks, device=device), starts,
                        torch.minimum(starts + CHUNK, offsets[seq + 1])], dim=-1)

    def schedule(position):
        if n_chunks == 0:
            return torch.zeros(1, 3, dtype=torch.int32, device=device)
        return rows[torch.argsort(position * N + seq)].to(torch.int32).contiguous()

    return ChunkLayout(
        cu_seqlens=offsets.to(torch.int32),
        chunk_offsets=chunk_offsets.to(torch.int32),
        fwd_schedule=schedule(pos),
        bwd_schedule=schedule(per_seq[seq] - 1 - pos),
        n_seqs=N,
        n_chunks=n_chunks,
    )


@functools.lru_cache(maxsize=64)
def _dense_layout(batch: int, seq_len: int, device: torch.device) -> ChunkLayout:
    """Equal-length batch: tables built on the device, no host round trip; cached per shape."""
    per_seq = -(-seq_len // CHUNK)
    offsets = torch.arange(batch + 1, device=device) * seq_len
    return _build(offsets, torch.full((batch,), per_seq, device=device), batch * per_seq)


def chunk_layout(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device) -> ChunkLayout:
    """Sequence and chunk tables for the flat token layout (reads cu_seqlens on the host when given)."""
    if cu_seqlens is None:
        return _dense_layout(batch, seq_len, torch.device(device))
    offsets = cu_seqlens.detach().to("cpu", torch.int64)
    per_seq = (offsets[1:] - offsets[:-1] + CHUNK - 1) // CHUNK
    lay = _build(offsets, per_seq, int(per_seq.sum()))
    return ChunkLayout(*(x.to(device) for x in (lay.cu_seqlens, lay.chunk_offsets, lay.fwd_schedule,
                                                  lay.bwd_schedule)), n_seqs=lay.n_seqs, n_chunks=lay.n_chunks)
