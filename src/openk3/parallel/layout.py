"""Where the tokens of a packed batch live under context parallelism (SPEC §10, KCP layout).

A packed batch is one stream of T tokens (B = 1) holding documents at `cu_seqlens` [0, ..., T]. Context parallelism
splits the stream contiguously (no zigzag): rank r owns tokens [bounds[r], bounds[r+1]). A document may start
before a rank's first token and end after its last one, crossing any number of rank boundaries. Everything here
is integer bookkeeping that every rank computes identically, with no communication.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class SequenceSplit:
    """cu_seqlens: document starts plus the total, (0, ..., T); bounds: rank starts plus the total, (0, ..., T),
    one more entry than ranks. Every rank holds at least one token; documents are non-empty."""

    cu_seqlens: tuple[int, ...]
    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        cu, bounds = self.cu_seqlens, self.bounds
        if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise strictly from 0, got {cu}")
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != cu[-1] or any(b <= a for a, b in zip(bounds,
                                                                                                     bounds[1:])):
            raise ValueError(f"rank bounds must rise strictly from 0 to T={cu[-1]} (every rank holds a token), "
                             f"got {bounds}")

    @classmethod
    def even(cls, cu_seqlens, num_ranks: int) -> SequenceSplit:
        """Rank r owns [r T / R, (r+1) T / R) (rounded down)."""
        cu = tuple(int(c) for c in cu_seqlens)
        T = cu[-1]
        if T < num_ranks:
            raise ValueError(f"{T} tokens cannot be split over {num_ranks} context-parallel ranks")
        return cls(cu, tuple(r * T // num_ranks for r in range(num_ranks + 1)))

    @property
    def num_ranks(self) -> int:
        return len(self.bounds) - 1

    @property
    def total(self) -> int:
        return self.cu_seqlens[-1]

    def size(self, r: int) -> int:
        return self.bounds[r + 1] - self.bounds[r]

    def doc_of(self, position: int) -> int:
        """Index of the document holding global token `position`."""
        return bisect.bisect_right(self.cu_seqlens, position) - 1

    def rank_of(self, position: int) -> int:
        return bisect.bisect_right(self.bounds, position) - 1

    def local_cu_seqlens(self, r: int) -> list[int]:
        """Document boundaries inside rank r, relative to its first token: [0, ..., size(r)]."""
        lo, hi = self.bounds[r], self.bounds[r + 1]
        inner = [c - lo for c in self.cu_seqlens if lo < c < hi]
        return [0, *inner, hi - lo]

    def head_start(self, r: int) -> int:
        """Global start of the document holding rank r's first token."""
        return self.cu_seqlens[self.doc_of(self.bounds[r])]

    def continues_from(self, r: int) -> bool:
        """Rank r's first local sequence began on an earlier rank."""
        return self.head_start(r) < self.bounds[r]

    def continues_to(self, r: int) -> bool:
        """Rank r's last local sequence goes on past its last token."""
        return self.bounds[r + 1] not in self.cu_seqlens

    def tail_start(self, r: int) -> int:
        """Local index where rank r's last local sequence starts (0 when it is also the first)."""
        return self.local_cu_seqlens(r)[-2]

    def spans(self, r: int) -> bool:
        """Rank r lies strictly inside one document (it continues from the left and to the right)."""
        return self.continues_from(r) and self.continues_to(r) and len(self.local_cu_seqlens(r)) == 2

    def state_chain(self, r: int) -> range:
        """The earlier ranks whose last local sequence is rank r's first one (their states fold into r's
        initial state), in order; empty when r's first sequence starts on r."""
        return range(self.rank_of(self.head_start(r)), r) if self.continues_from(r) else range(0)

    def later_chain(self, r: int) -> range:
        """The later ranks that hold the rest of rank r's last local sequence, in order."""
        if not self.continues_to(r):
            return range(0)
        end = self.cu_seqlens[self.doc_of(self.bounds[r + 1] - 1) + 1]
        return range(r + 1, self.rank_of(end - 1) + 1)

    @cached_property
    def _doc_ids(self) -> torch.Tensor:
        lengths = torch.tensor(self.cu_seqlens).diff()
        return torch.repeat_interleave(torch.arange(len(lengths)), lengths)

    def positions(self, r: int) -> torch.Tensor:
        """Position of each of rank r's tokens inside its document [size(r)] (int64)."""
        lo, hi = self.bounds[r], self.bounds[r + 1]
        starts = torch.tensor(self.cu_seqlens)[self._doc_ids[lo:hi]]
        return torch.arange(lo, hi) - starts

    def doc_lengths(self, r: int) -> torch.Tensor:
        """Length of the document holding each of rank r's tokens [size(r)] (int64)."""
        lengths = torch.tensor(self.cu_seqlens).diff()
        return lengths[self._doc_ids[self.bounds[r]:self.bounds[r + 1]]]
