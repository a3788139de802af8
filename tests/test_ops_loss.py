"""The chunked LM head + cross-entropy (openk3.ops.loss) against the plain F.linear + F.cross_entropy on fp32 logits:
loss and gradients w.r.t. hidden and weight, on fresh random inputs with odd sizes, ignored rows, extreme logits,
both reductions, fp32 and CPU bf16 autocast, and weighted sums of several losses; plus what it keeps for backward."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.loss import cross_entropy_reference, linear_cross_entropy
from saved_tensors import saved_storages

IGNORE = -100


def make_inputs(n: int, v: int, d: int, logit_scale: float = 1.0, ignored: float = 0.2, seed: int = 0):
    """hidden [n, d], weight [v, d] with logits of about `logit_scale`, targets [n] with a fraction ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g) * logit_scale ** 0.5
    weight = torch.randn(v, d, generator=g) * logit_scale ** 0.5 / d ** 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.rand(n, generator=g) < ignored] = IGNORE
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def loss_and_grads(fn, hidden, weight, targets, **kw):
    loss = fn(hidden, weight, targets, **kw)
    return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """max |actual - expected| <= tol * max |expected| (elementwise errors measured against the tensor's scale)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    err = (actual - expected).abs().max().item()
    assert err <= tol * max(expected.abs().max().item(), 1e-30), (err, expected.abs().max().item())


@pytest.mark.parametrize("n,v,d,chunk", [(37, 53, 16, 5), (64, 97, 24, 64), (19, 31, 8, 1), (23, 41, 12, 100)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("logit_scale", [1.0, 1e4])
def test_fp32_matches_reference(n, v, d, chunk, reduction, logit_scale):
    hidden, weight, targets = make_inputs(n, v, d, logit_scale, seed=n * v + chunk)
    fused = loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk=chunk, reduction=reduction)
    ref = loss_and_grads(cross_entropy_reference, hidden, weight, targets, reduction=reduction)
    for a, b in zip(fused, ref):
        assert_rel_close(a, b, 2e-6)


def test_ignored_rows_get_no_gradient_and_a_custom_ignore_index():
    hidden, weight, targets = make_inputs(29, 43, 10, ignored=0.5)
    targets = torch.where(targets == IGNORE, 7, targets)  # 7 is now a real class, and the ignored id
    targets[::3] = 0
    loss, g_hidden, g_weight = loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk=4, ignore_index=0)
    ref = loss_and_grads(cross_entropy_reference, hidden, weight, targets, ignore_index=0)
    assert (g_hidden[::3] == 0).all() and (g_hidden[1::3] != 0).any()
    for a, b in zip((loss, g_hidden, g_weight), ref):
        assert_rel_close(a, b, 2e-6)


def test_all_rows_ignored_gives_nan_loss_and_zero_gradients_like_the_reference():
    hidden, weight, targets = make_inputs(9, 13, 4)
    targets[:] = IGNORE
    fused = loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk=4)
    ref = loss_and_grads(cross_entropy_reference, hidden, weight, targets)
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, equal_nan=True)
    assert fused[0].isnan() and (fused[1] == 0).all() and (fused[2] == 0).all()


@pytest.mark.parametrize("n,v,d,chunk", [(45, 67, 64, 8), (33, 129, 48, 33)])
def test_bf16_autocast_matches_the_autocast_reference(n, v, d, chunk):
    hidden, weight, targets = make_inputs(n, v, d, logit_scale=4.0, seed=chunk)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk=chunk)
        ref = loss_and_grads(cross_entropy_reference, hidden, weight, targets)
    fp32 = loss_and_grads(cross_entropy_reference, hidden, weight, targets)
    assert [t.dtype for t in fused] == [torch.float32] * 3  # the loss and the fp32 parameters' gradients
    assert_rel_close(fused[0], ref[0], 1e-5)  # the same bf16 logits, the same fp32 log-sum-exp
    assert not torch.allclose(fused[0], fp32[0], rtol=1e-5, atol=0)  # ... and not the fp32 logits
    for a, b in zip(fused[1:], ref[1:]):
        assert_rel_close(a, b, 2 ** -7)  # bf16 rounding of the gradient products


def test_weighted_sum_of_losses_sharing_the_weight():
    """loss = lm + 0.3 * mtp through the same head weight (the training loop's total): backward scales each
    loss's stored gradients by its own grad_output."""
    hidden, weight, targets = make_inputs(31, 47, 12)
    hidden2, _, targets2 = make_inputs(26, 47, 12, seed=5)

    def total(fn):
        return fn(hidden, weight, targets, chunk=6) + 0.3 * fn(hidden2, weight, targets2, chunk=6, reduction="sum")

    def ref_fn(h, w, t, chunk, **kw):
        return cross_entropy_reference(h, w, t, **kw)

    fused = torch.autograd.grad(total(linear_cross_entropy), (hidden, weight, hidden2))
    ref = torch.autograd.grad(total(ref_fn), (hidden, weight, hidden2))
    for a, b in zip(fused, ref):
        assert_rel_close(a, b, 2e-6)


def test_no_grad_and_frozen_weight():
    hidden, weight, targets = make_inputs(17, 23, 8)
    with torch.no_grad():
        value = linear_cross_entropy(hidden, weight, targets, chunk=5)
    assert not value.requires_grad
    assert_rel_close(value, cross_entropy_reference(hidden, weight, targets).detach(), 2e-6)
    frozen = weight.detach()
    (g_hidden,) = torch.autograd.grad(linear_cross_entropy(hidden, frozen, targets, chunk=5), (hidden,))
    (ref,) = torch.autograd.grad(cross_entropy_reference(hidden, frozen, targets), (hidden,))
    assert_rel_close(g_hidden, ref, 2e-6)


def test_keeps_nothing_of_size_tokens_by_vocab_for_backward():
    n, v, d = 96, 211, 8
    hidden, weight, targets = make_inputs(n, v, d)
    fused = saved_storages(lambda: linear_cross_entropy(hidden, weight, targets, chunk=16))
    assert sorted(shape for _, shape, _ in fused) == sorted([(n, d), (v, d)])  # the two gradients, nothing else
    plain = saved_storages(lambda: cross_entropy_reference(hidden, weight, targets))
    assert any(shape == (n, v) for _, shape, _ in plain)  # what the reference keeps: the [N, V] log-probabilities


@pytest.mark.parametrize("kw,match", [({"reduction": "none"}, "reduction"), ({"chunk": 0}, "chunk")])
def test_bad_arguments_fail_naming_them(kw, match):
    hidden, weight, targets = make_inputs(4, 5, 3)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(hidden, weight, targets, **kw)
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(hidden, weight[:, :2], targets)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(hidden, weight, targets[:3])


def test_training_losses_equal_the_logits_based_losses():
    """lm_losses (the head applied inside the fused loss, return_logits=False) against the model's logits and
    F.cross_entropy: the same next-token and MTP losses, the same gradient for every parameter (lm_head included,
    shared by the main head and the MTP head)."""
    import torch.nn.functional as F

    from openk3.config import get_preset
    from openk3.model import K3ForCausalLM
    from openk3.train.loop import lm_losses
    from train_tiny import TINY

    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("k3-tiny").with_overrides(TINY))
    batch = torch.randint(0, TINY["vocab_size"], (2, 13))
    total, lm, mtp = lm_losses(model, batch, mtp_weight=0.3)
    fused = torch.autograd.grad(total, list(model.parameters()), allow_unused=True)

    out = model(batch[:, :-1])
    ref_lm = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
    ref_mtp = F.cross_entropy(out.mtp_logits.flatten(0, 1), batch[:, 2:].flatten())
    ref = torch.autograd.grad(ref_lm + 0.3 * ref_mtp, list(model.parameters()), allow_unused=True)
    assert_rel_close(lm, ref_lm.detach(), 2e-6)
    assert abs(float(mtp) - float(ref_mtp.detach())) <= 2e-6 * float(ref_mtp.detach())
    for (name, _), a, b in zip(model.named_parameters(), fused, ref):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_rel_close(a, b, 1e-5)
