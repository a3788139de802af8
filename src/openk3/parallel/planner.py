"""Expert-parallel placement plans: on which rank every token-expert row is computed (SPEC §10, MoonEP).

Input: counts [R, E], the rows source rank s sends to expert e (all-gathered, so every rank computes the same plan).
Expert e lives on its home rank e // m (m = E / R experts per rank). A plan cuts each expert's rows, ordered by
source rank and then by the source's own order, into consecutive segments, one per rank that computes them:

    segment j: expert seg_expert[j] on rank seg_rank[j] in slot seg_slot[j]; seg_rows[s, j] of its rows from s.

Segment e (e < E) is expert e's home segment; the replica segments follow, sorted by (expert, destination rank).
Within one expert the rows are cut home segment first, then the replica segments in that order, so a stable sort
of the segments by expert (`EPPlan.by_expert`) gives the order in which a source's rows, sorted by expert, fill
them. A rank has 2m slots: slots [0, m) hold its own experts (slot i: expert r m + i), slots [m, 2m) the replicas
it computes this step, by ascending expert id (-1 when empty): `slot_expert` [R, 2m].

`plan_static`: every row goes home (plain expert parallelism; the load follows the routing).
`plan_balanced`: MoonEP's planner; every rank receives exactly cap[d] rows, cap = total / R spread as evenly as
integers allow (S x K rows each when every rank holds S tokens with top-K). Integer-only and deterministic:
  1. bal[h] = rows for home rank h's experts - cap[h].
  2. Single-source fill: take the most over-full rank s and the most under-full rank d (ties: lower index) and
     move d's whole deficit -bal[d] from s to d. If that is more than s's surplus, s becomes under-full and is
     filled later like any other rank; a filled rank never gives or receives again. So each receiving rank
     takes its extra rows from a single home rank, and m replica slots always suffice.
  3. Each home rank splits its outgoing quotas over its experts greedily: largest quota first (ties: lower
     destination), each piece from the expert with the most rows left (ties: lower expert id).
  4. Segment row counts per source follow from prefix sums over source ranks (no communication).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EPPlan:
    slot_expert: np.ndarray  # [R, 2m] (static: [R, m]) int64, -1 = empty replica slot
    seg_expert: np.ndarray  # [G]
    seg_rank: np.ndarray  # [G]
    seg_slot: np.ndarray  # [G]
    seg_rows: np.ndarray  # [R, G]
    experts_per_rank: int  # m

    @property
    def num_ranks(self) -> int:
        return self.slot_expert.shape[0]

    def by_expert(self) -> np.ndarray:
        """Segment indices in the order a source's rows, sorted by expert, fill them (module docstring)."""
        return np.argsort(self.seg_expert, kind="stable")

    def rows_received(self) -> np.ndarray:
        """[R] rows each rank computes."""
        return np.bincount(self.seg_rank, weights=self.seg_rows.sum(0), minlength=self.num_ranks).astype(np.int64)

    def replicas(self, rank: int) -> np.ndarray:
        """Experts rank `rank` computes as replicas this step (ascending)."""
        extra = self.slot_expert[rank, self.experts_per_rank:]
        return extra[extra >= 0]


def _check(counts: np.ndarray) -> tuple[int, int, int]:
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.dtype.kind not in "iu" or (counts.size and counts.min() < 0):
        raise ValueError(f"counts must be a non-negative integer table [ranks, experts], got {counts.dtype} "
                         f"{counts.shape}")
    R, E = counts.shape
    if E % R:
        raise ValueError(f"{E} experts cannot be split evenly over {R} expert-parallel ranks")
    return R, E, E // R


def plan_static(counts: np.ndarray) -> EPPlan:
    """Every row computed on its expert's home rank."""
    R, E, m = _check(counts)
    experts = np.arange(E)
    return EPPlan(experts.reshape(R, m), experts, experts // m, experts % m, np.asarray(counts, dtype=np.int64), m)


def _single_source_fill(bal: list[int]) -> list[tuple[int, int, int]]:
    """Step 2: moves (source, destination, rows) until every bal is 0 (sum(bal) must be 0)."""
    over = [(-b, r) for r, b in enumerate(bal) if b > 0]
    under = [(b, r) for r, b in enumerate(bal) if b < 0]
    heapq.heapify(over)
    heapq.heapify(under)
    moves = []
    while over:
        surplus, s = heapq.heappop(over)
        deficit, d = heapq.heappop(under)
        moves.append((s, d, -deficit))
        left = -surplus + deficit
        if left > 0:
            heapq.heappush(over, (-left, s))
        elif left < 0:
            heapq.heappush(under, (left, s))
    return moves


def _split_quotas(moves, load: list[int], m: int) -> list[tuple[int, int, int]]:
    """Step 3: pieces (expert, destination, rows); `load` (rows per expert) is reduced to what stays home."""
    quotas: dict[int, list[tuple[int, int]]] = {}
    for s, d, rows in moves:
        quotas.setdefault(s, []).append((d, rows))
    pieces = []
    for s, outgoing in quotas.items():
        left = [(-load[e], e) for e in range(s * m, (s + 1) * m) if load[e] > 0]
        heapq.heapify(left)
        for d, q in sorted(outgoing, key=lambda t: (-t[1], t[0])):
            while q > 0:
                neg, e = heapq.heappop(left)
                take = min(-neg, q)
                pieces.append((e, d, take))
                load[e] -= take
                q -= take
                if load[e] > 0:
                    heapq.heappush(left, (-load[e], e))
    return pieces


def plan_balanced(counts: np.ndarray) -> EPPlan:
    """MoonEP's balanced plan (module docstring): every rank computes exactly cap[d] rows."""
    R, E, m = _check(counts)
    counts = np.asarray(counts, dtype=np.int64)
    load = counts.sum(0)
    home = load.reshape(R, m).sum(1)
    total = int(home.sum())
    cap = total // R + (np.arange(R) < total % R)
    moves = _single_source_fill((home - cap).tolist())
    stay = load.tolist()
    pieces = _split_quotas(moves, stay, m)

    p_expert = np.array([p[0] for p in pieces], dtype=np.int64)
    p_rank = np.array([p[1] for p in pieces], dtype=np.int64)
    p_rows = np.array([p[2] for p in pieces], dtype=np.int64)
    # pieces sorted by (expert, destination): the order they take an expert's rows after its home segment
    order = np.lexsort((p_rank, p_expert))
    p_expert, p_rank, p_rows = p_expert[order], p_rank[order], p_rows[order]
    # slots: each destination's replicas by ascending expert id
    by_dest = np.lexsort((p_expert, p_rank))
    p_slot = np.empty(len(pieces), dtype=np.int64)
    p_slot[by_dest] = m + np.arange(len(pieces)) - np.searchsorted(p_rank[by_dest], p_rank[by_dest])
    slot_expert = np.full((R, 2 * m), -1, dtype=np.int64)
    slot_expert[:, :m] = np.arange(E).reshape(R, m)
    slot_expert[p_rank, p_slot] = p_expert

    experts = np.arange(E)
    seg_expert = np.concatenate([experts, p_expert])
    seg_rank = np.concatenate([experts // m, p_rank])
    seg_slot = np.concatenate([experts % m, p_slot])
    # step 4: an expert without replicas keeps all its rows home; for a replicated one, source s holds rows
    # [lo, hi) of the expert's rows, the home segment is [0, stay) and the pieces follow
    seg_rows = np.empty((R, E + len(pieces)), dtype=np.int64)
    seg_rows[:, :E] = counts
    if pieces:
        replicated = np.unique(p_expert)
        hi = np.cumsum(counts[:, replicated], axis=0)
        lo = hi - counts[:, replicated]
        stay = np.asarray(stay, dtype=np.int64)
        seg_rows[:, replicated] = np.clip(np.minimum(hi, stay[replicated]) - lo, 0, None)
        before = np.cumsum(p_rows) - p_rows
        a = stay[p_expert] + before - before[np.searchsorted(p_expert, p_expert)]
        col = np.searchsorted(replicated, p_expert)
        seg_rows[:, E:] = np.clip(np.minimum(hi[:, col], a + p_rows) - np.maximum(lo[:, col], a), 0, None)
    return EPPlan(slot_expert, seg_expert, seg_rank, seg_slot, seg_rows, m)


PLANNERS = {"balanced": plan_balanced, "static": plan_static}
