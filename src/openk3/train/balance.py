"""Router load balancing without an auxiliary loss: Quantile Balancing, the sign rule, or none (SPEC §5).

The router selects experts on s + b (s = sigmoid scores, b = `e_score_correction_bias`, a buffer no optimizer
touches) and combines with the unbiased s. After each optimizer step the balancer reads every router's scores
from that step's forward (`router.last_scores`, [tokens, experts]) and sets b for the next step. In eval mode
nothing is recorded or updated: the bias is frozen.

Quantile Balancing, per MoE layer with m tokens, n experts, top-k:
  1. alpha_i = the (k+1)-th largest biased score of token i (its threshold under the current bias);
  2. margins s_ij - alpha_i; expert j would get token i when margin_ij > -b_j, so the target load
     q = k m / n is met by b~_j = -(the (q+1)-th largest margin of expert j)  (exact order statistic);
  3. b = b~ - mean(b~) (a common shift never changes a top-k), applied from the next step.
Sign rule (the DeepSeek-V3 baseline): b_j += gamma * sign(mean load - load_j).

Data parallel: scores are all-gathered so every rank computes the same bias from the global batch (exact order
statistic; at scale SPEC §5 suggests all-reduced histograms instead, whose traffic does not grow with tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

METHODS = ("quantile", "sign", "none")


def routed_loads(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens per expert [n] when each of the m tokens picks its top-k of scores + bias ([m, n])."""
    chosen = (scores + bias).topk(k, dim=-1).indices.flatten()
    # counted by a scatter: bincount reads the largest index on the host (a sync a layer on a GPU)
    return torch.zeros(scores.shape[-1], dtype=torch.int64, device=scores.device).scatter_add_(
        0, chosen, torch.ones_like(chosen))


def max_violation(loads: torch.Tensor) -> torch.Tensor:
    """MaxVio = max load / mean load - 1 (0 is perfect balance), a 0-d tensor (read it once the step is done)."""
    loads = loads.float()
    return loads.max() / loads.mean() - 1


def target_load(m: int, n: int, k: int) -> int:
    """q = k m / n, rounded down when the batch does not divide evenly."""
    return (k * m) // n


def quantile_thresholds(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(b~ [n], alpha [m]): the uncentred Quantile Balancing bias and the per-token thresholds it was cut against."""
    m, n = scores.shape
    if k >= n:
        raise ValueError(f"Quantile Balancing needs top_k < num_experts (top-(k+1) threshold), got k={k}, n={n}")
    alpha = (scores + bias).topk(k + 1, dim=-1).values[:, k]
    margins = scores - alpha[:, None]
    q = target_load(m, n, k)
    # (q+1)-th largest margin of each expert = the (m - q)-th smallest, i.e. kthvalue with 1-based rank m - q
    b_tilde = -margins.kthvalue(m - q, dim=0).values
    return b_tilde, alpha


def quantile_bias(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    b_tilde, _ = quantile_thresholds(scores.float(), bias.float(), k)
    return b_tilde - b_tilde.mean()


def sign_rule_bias(scores: torch.Tensor, bias: torch.Tensor, k: int, gamma: float) -> torch.Tensor:
    loads = routed_loads(scores, bias, k).float()
    return bias + gamma * torch.sign(loads.mean() - loads)


def _gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Every rank's rows; the counts may differ between ranks (the MTP router's under context parallelism)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([x.shape[0]], device=x.device))
    sizes = [int(n) for n in sizes]
    padded = x.new_zeros(max(sizes), *x.shape[1:])
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


class RouterBalancer:
    """Reads each router's last scores after a step, logs MaxVio and updates the correction bias."""

    def __init__(self, model: nn.Module, method: str, top_k: int, gamma: float = 1e-3):
        if method not in METHODS:
            raise ValueError(f"--balance must be one of {METHODS}, got {method!r}")
        self.model, self.method, self.top_k, self.gamma = model, method, top_k, gamma

    def routers(self) -> list[tuple[int, nn.Module]]:
        return list(self.model.routers())

    @torch.no_grad()
    def step(self) -> dict[str, torch.Tensor]:
        """MaxVio per MoE layer of the forward just taken (under the bias it used), 0-d tensors: no host sync;
        then the bias update."""
        maxvio = {}
        for layer, router in self.routers():
            scores = getattr(router, "last_scores", None)
            if scores is None:
                continue
            scores = _gather_rows(scores.detach().float().reshape(-1, scores.shape[-1]))
            bias = router.e_score_correction_bias
            maxvio[str(layer)] = max_violation(routed_loads(scores, bias.float(), self.top_k))
            if self.method == "quantile":
                bias.copy_(quantile_bias(scores, bias, self.top_k))
            elif self.method == "sign":
                bias.copy_(sign_rule_bias(scores, bias.float(), self.top_k, self.gamma))
        return maxvio

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {str(layer): r.e_score_correction_bias.detach().cpu().clone() for layer, r in self.routers()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        routers = dict((str(layer), r) for layer, r in self.routers())
        if set(routers) != set(state):
            raise ValueError(f"checkpoint has balancing biases for MoE layers {sorted(state)}, the model has "
                             f"{sorted(routers)}")
        for layer, bias in state.items():
            routers[layer].e_score_correction_bias.copy_(bias)
