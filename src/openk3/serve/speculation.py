"""Dynamic speculation (`openk3 serve --speculative auto`): each engine step, the decoding sequences take a round of
K drafts or one plain decode step, whichever yields more tokens per unit of time at the step's batch size, as vLLM's
and SGLang's dynamic speculation do (issue 43: speculation must never make serving slower).

A round with K drafts, each accepted with probability a once the ones before it are (SPEC §11), yields
E[tokens | K, a] = 1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a) tokens: one plus the accepted drafts per verification,
which the policy measures as an exponential moving average over verifications. A round costs `cost(batch)` plain
decode steps (the verification of K + 1 tokens and K draft passes against one decode step at that batch: timed by
the engine at start-up on a GPU, `DEFAULT_ROUND_COST` elsewhere); a plain step yields 1 token at cost 1. So the policy
speculates iff (1 + accepted) / cost > 1. Where a round could not pay even with every draft accepted (K + 1 <= cost:
large batches) it never speculates; where it could, it re-measures the acceptance with one round after
`probe_every` plain steps, so that a rising acceptance is seen. The engine's graphs exist for one K (the configured
one), so the choice is K or 0.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

DEFAULT_K = 3  # drafts per round of `--speculative auto`
# a round's cost in plain decode steps where it is not measured (CPU): the target for a cheap round,
# a verification of K + 1 tokens at 1.3 decode steps and the K draft passes at 0.5 together
DEFAULT_ROUND_COST = 1.8


class SpecPolicy:
    """K drafts per round or 0 (a plain decode step), per step from the batch size and the measured acceptance.

    k: the drafts of a round (the engine's `speculative`); round_costs: batch size -> a round's time over a plain
    step's at that batch (the runner's graph buckets; a batch uses the smallest bucket holding it, or the largest);
    empty: DEFAULT_ROUND_COST at every batch. alpha: the moving average's weight of one verification."""

    def __init__(self, k: int, round_costs: dict[int, float] | None = None, alpha: float = 0.05,
                 probe_every: int = 64):
        if k < 1:
            raise ValueError(f"a speculation policy needs K >= 1 drafts per round, got {k}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"the moving average's weight must be in (0, 1], got {alpha}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        costs = dict(sorted((round_costs or {}).items()))
        if any(c <= 0 for c in costs.values()):
            raise ValueError(f"round costs must be positive, got {costs}")
        self.k, self.alpha, self.probe_every = k, alpha, probe_every
        self.buckets, self.costs = list(costs), list(costs.values())
        self.accepted: float | None = None  # moving average of accepted drafts per verification (None: unmeasured)
        self._plain_steps = 0  # plain steps chosen since the last round, while a round could pay

    def cost(self, batch: int) -> float:
        """A round's cost in plain decode steps at this batch size."""
        if not self.buckets:
            return DEFAULT_ROUND_COST
        return self.costs[min(bisect.bisect_left(self.buckets, batch), len(self.buckets) - 1)]

    def gain(self, batch: int) -> float:
        """Tokens per unit of time of a round over a plain step's at the measured acceptance (> 1: a round pays)."""
        return (1.0 + (self.accepted or 0.0)) / self.cost(batch)

    def choose(self, batch: int) -> int:
        """The drafts per round for a step of `batch` decoding sequences: k, or 0 for a plain decode step."""
        if self.k + 1 <= self.cost(batch):  # not even a round accepting every draft pays
            return 0
        if self.accepted is None or self._plain_steps >= self.probe_every or self.gain(batch) > 1.0:
            self._plain_steps = 0
            return self.k
        self._plain_steps += 1
        return 0

    def observe(self, accepted: Sequence[int]) -> None:
        """A round's accepted drafts, one count per verified sequence."""
        for n in accepted:
            if not 0 <= n <= self.k:
                raise ValueError(f"a verification accepts 0 to {self.k} drafts, got {n}")
            self.accepted = float(n) if self.accepted is None else self.accepted + self.alpha * (n - self.accepted)
