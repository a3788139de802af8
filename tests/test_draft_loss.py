"""The draft losses (SPEC §11): LK^alpha's gradient against central finite differences (fp64), zero exactly when the
draft equals the target, cross-entropy when the target is one-hot; KL and the hybrid at their known points."""

import pytest
import torch
import torch.nn.functional as F

from openk3.draft.loss import LOSSES, acceptance, draft_loss


def random_case(seed: int, rows: int = 3, vocab: int = 7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2
    p = torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2, -1)
    return logits, p


def loss64(kind, logits, p, mask=None, lam=None):
    """The losses' formulas in float64. The hybrid's lambda is a stop-gradient: finite differences hold it at the
    unperturbed value (`lam`)."""
    log_q = torch.log_softmax(logits, -1)
    alpha = torch.minimum(p, log_q.exp()).sum(-1)
    kl = (torch.xlogy(p, p) - p * log_q).sum(-1)
    lam = torch.exp(-3.0 * alpha.detach()) if lam is None else lam
    per = {"lk": -alpha.log(), "kl": kl, "hybrid": lam * kl + (1 - lam) * (1 - alpha)}[kind]
    return per.mean() if mask is None else per[mask].mean()


@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("seed", [0, 1])
def test_gradient_matches_finite_differences(kind, seed):
    logits, p = random_case(seed)
    logits.requires_grad_(True)
    loss64(kind, logits, p).backward()
    eps, numeric = 1e-6, torch.zeros_like(logits)
    with torch.no_grad():
        lam = torch.exp(-3.0 * acceptance(p, torch.softmax(logits, -1)))
        for idx in torch.cartesian_prod(*(torch.arange(s) for s in logits.shape)):
            i, j = idx.tolist()
            plus, minus = logits.clone(), logits.clone()
            plus[i, j] += eps
            minus[i, j] -= eps
            numeric[i, j] = (loss64(kind, plus, p, lam=lam) - loss64(kind, minus, p, lam=lam)) / (2 * eps)
    torch.testing.assert_close(logits.grad, numeric, rtol=1e-5, atol=1e-7)
    # the module's fp32 loss agrees with the fp64 formula, value and gradient
    x = logits.detach().float().requires_grad_(True)
    value, _ = draft_loss(x, p.float(), kind)
    value.backward()
    torch.testing.assert_close(value.double(), loss64(kind, logits.detach(), p), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), logits.grad, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("kind", LOSSES)
def test_zero_when_draft_equals_target(kind):
    logits, _ = random_case(3)
    logits = logits.float()
    loss, alpha = draft_loss(logits, torch.softmax(logits, -1), kind)
    assert abs(float(loss)) < 1e-6 and abs(float(alpha) - 1) < 1e-6


def test_lk_is_cross_entropy_for_a_one_hot_target():
    logits, _ = random_case(4, rows=7, vocab=13)
    logits = logits.float()
    targets = torch.tensor([0, 12, 5, 5, 3, 7, 1])
    loss, alpha = draft_loss(logits, F.one_hot(targets, 13).float(), "lk")
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets))
    torch.testing.assert_close(alpha, torch.softmax(logits, -1)[torch.arange(7), targets].mean())


def test_mask_averages_the_counted_positions_only():
    logits, p = random_case(5, rows=6)
    mask = torch.tensor([True, False, True, True, False, True])
    for kind in LOSSES:
        loss, _ = draft_loss(logits.float(), p.float(), kind, mask=mask)
        torch.testing.assert_close(loss.double(), loss64(kind, logits, p, mask), rtol=1e-5, atol=1e-6)


def test_acceptance_is_one_minus_total_variation():
    _, p = random_case(6)
    _, q = random_case(7)
    torch.testing.assert_close(acceptance(p, q), 1 - 0.5 * (p - q).abs().sum(-1))


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="draft loss must be one of"):
        draft_loss(torch.zeros(2, 3), torch.full((2, 3), 1 / 3), "ce")
