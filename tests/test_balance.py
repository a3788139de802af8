"""Quantile Balancing and the sign rule (SPEC §5) on synthetic router scores."""

import pytest
import torch
from torch import nn

from openk3.train.balance import (
    RouterBalancer,
    max_violation,
    quantile_bias,
    quantile_thresholds,
    routed_loads,
    sign_rule_bias,
    target_load,
)

M, N, K = 256, 8, 2


def skewed_scores(seed: int, m: int = M, n: int = N) -> torch.Tensor:
    """Sigmoid scores where expert j is favoured in proportion to j: plain top-k routing is badly unbalanced."""
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(m, n, generator=g) + torch.linspace(-2.0, 2.0, n))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("m,n,k", [(M, N, K), (300, 6, 1), (128, 16, 4)])
def test_one_update_routes_exactly_q_tokens_per_expert_against_the_thresholds(seed, m, n, k):
    """After one update, expert j clears token i's threshold (margin s_ij - alpha_i > -b_j) for exactly q tokens.

    Ties aside: a token's (k+1)-th expert has margin exactly 0, so an expert whose cut lands on a margin shared by
    several tokens gets fewer than q strictly above it and more than q at or above it.
    """
    scores = skewed_scores(seed, m, n)
    bias = torch.zeros(n)
    b_tilde, alpha = quantile_thresholds(scores, bias, k)
    q = target_load(m, n, k)
    margins = scores - alpha[:, None]
    above, at_or_above = (margins > -b_tilde).sum(0), (margins >= -b_tilde).sum(0)
    tied = (margins == -b_tilde).sum(0) > 1
    assert (above[~tied] == q).all() and (at_or_above[~tied] == q + 1).all()
    assert (above[tied] <= q).all() and (at_or_above[tied] > q).all()
    assert (~tied).sum() >= n // 2  # the exact case is the common one
    centred = quantile_bias(scores, bias, k)
    assert abs(float(centred.mean())) < 1e-6
    # the centring is a common shift: the top-k routing it gives is the same as with b~
    assert torch.equal(routed_loads(scores, centred, k), routed_loads(scores, b_tilde, k))


@pytest.mark.parametrize("seed", range(4))
def test_quantile_update_balances_real_top_k_routing(seed):
    scores = skewed_scores(seed)
    bias = torch.zeros(N)
    before = max_violation(routed_loads(scores, bias, K))
    bias = quantile_bias(scores, bias, K)
    after_one = max_violation(routed_loads(scores, bias, K))
    for _ in range(4):
        bias = quantile_bias(scores, bias, K)
    after_five = max_violation(routed_loads(scores, bias, K))
    assert before > 1.0  # the synthetic scores really are skewed
    assert after_one < before / 2
    assert after_five < after_one


def test_sign_rule_moves_bias_toward_underloaded_experts():
    scores = skewed_scores(0)
    bias = torch.zeros(N)
    gamma = 0.01
    loads = routed_loads(scores, bias, K).float()
    new = sign_rule_bias(scores, bias, K, gamma)
    assert torch.equal(new, gamma * torch.sign(loads.mean() - loads))


def test_max_violation_definition():
    assert float(max_violation(torch.tensor([4, 4, 4, 4]))) == 0.0
    assert float(max_violation(torch.tensor([1, 1, 1, 5]))) == pytest.approx(5 / 2 - 1)


class _Router(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("e_score_correction_bias", torch.zeros(n))
        self.last_scores = None


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.r1, self.r3 = _Router(N), _Router(N)

    def routers(self):
        yield 1, self.r1
        yield 3, self.r3


@pytest.mark.parametrize("method", ["quantile", "sign", "none"])
def test_balancer_updates_each_router_and_reports_maxvio(method):
    model = _Model()
    model.r1.last_scores, model.r3.last_scores = skewed_scores(1), skewed_scores(2)
    maxvio = RouterBalancer(model, method, top_k=K, gamma=0.01).step()
    assert set(maxvio) == {"1", "3"}
    assert float(maxvio["1"]) == pytest.approx(float(max_violation(routed_loads(skewed_scores(1), torch.zeros(N), K))))
    expected = {"quantile": quantile_bias(skewed_scores(1), torch.zeros(N), K),
                "sign": sign_rule_bias(skewed_scores(1), torch.zeros(N), K, 0.01),
                "none": torch.zeros(N)}[method]
    torch.testing.assert_close(model.r1.e_score_correction_bias, expected)


def test_balancer_state_round_trip_and_mismatch():
    model = _Model()
    model.r1.e_score_correction_bias.fill_(0.5)
    bal = RouterBalancer(model, "quantile", top_k=K)
    state = bal.state_dict()
    other = _Model()
    RouterBalancer(other, "quantile", top_k=K).load_state_dict(state)
    assert torch.equal(other.r1.e_score_correction_bias, model.r1.e_score_correction_bias)
    with pytest.raises(ValueError, match="MoE layers"):
        bal.load_state_dict({"1": torch.zeros(N)})
