"""Draft-model training losses (SPEC §11): LK^alpha (the default), forward KL, and the hybrid LK^lambda.

p: the target's next-token distribution at a position, q: the draft's. Speculative sampling accepts a token drafted
from q with probability min(1, p(x) / q(x)), so the expected acceptance at the position is

    alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q).

- "lk":     LK^alpha = -log alpha. For a one-hot p (the token y) it is -log q(y): cross-entropy.
- "kl":     KL(p || q) = sum_x p(x) (log p(x) - log q(x)), the usual distillation proxy.
- "hybrid": LK^lambda = lambda KL + (1 - lambda)(1 - alpha), lambda = exp(-eta stopgrad(alpha)): mostly KL while the
            draft is poor (alpha near 0, where 1 - alpha has little gradient), mostly the acceptance itself as alpha
            grows.

Averaging: every loss is computed per position and then averaged over the positions (the mean of per-token -log
alpha, not -log of the batch-mean alpha). Why: a chain of drafted tokens is accepted up to the first rejection, so
the expected acceptance length is a sum of *products* of the per-position alphas; the log of such a product is the
sum of the per-token log alphas, which the per-token mean optimises directly. It also keeps each position's
gradient its own (weighted by 1 / alpha_t: the positions the draft gets wrong count most), exactly as
cross-entropy does, whereas -log(mean alpha) lets well-predicted positions mask the poor ones.
"""

from __future__ import annotations

import torch

LOSSES = ("lk", "kl", "hybrid")
DEFAULT_ETA = 3.0  # hybrid: lambda = exp(-eta alpha) is 1 at alpha = 0 and e^-3 = 0.05 at alpha = 1
ALPHA_FLOOR = 1e-12  # alpha is a sum of probabilities: only underflow can make it 0


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Expected acceptance sum_x min(p(x), q(x)) over the last dimension: [..., V] x 2 -> [...]."""
    return torch.minimum(p, q).sum(-1)


def draft_loss(draft_logits: torch.Tensor, target_probs: torch.Tensor, kind: str = "lk",
               eta: float = DEFAULT_ETA, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_logits [..., V] (the draft's raw logits), target_probs [..., V] (p, rows summing to 1), mask [...]
    (True: the position counts; None: all do) -> (the mean loss over the counted positions, their mean alpha,
    detached). Computed in fp32."""
    if kind not in LOSSES:
        raise ValueError(f"draft loss must be one of {LOSSES}, got {kind!r}")
    p = target_probs.float()
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    alpha = acceptance(p, log_q.exp())
    if kind == "lk":
        per_position = -alpha.clamp_min(ALPHA_FLOOR).log()
    else:
        kl = (torch.xlogy(p, p) - p * log_q).sum(-1)  # xlogy: 0 log 0 = 0
        if kind == "kl":
            per_position = kl
        else:
            lam = torch.exp(-eta * alpha.detach())
            per_position = lam * kl + (1 - lam) * (1 - alpha)
    if mask is None:
        return per_position.mean(), alpha.detach().mean()
    weight = mask.to(per_position.dtype)
    count = weight.sum().clamp_min(1)
    return (per_position * weight).sum() / count, (alpha.detach() * weight).sum() / count
