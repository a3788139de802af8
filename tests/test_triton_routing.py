"""Sigmoid top-k routing in one Triton pass (`ops.triton_routing`) against `sigmoid_topk_routing`'s PyTorch form:
weights, indices and scores, with and without the selection bias and renormalisation, k not a power of two, k = E,
expert counts that are not powers of two, saturated logits; and how `sigmoid_topk_routing` takes it (all of the
routing without autograd, the picks with it). On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py),
its outputs NaN-poisoned."""

from __future__ import annotations

import pytest
import torch

from openk3.ops import moe as moe_ops
from openk3.ops import triton_routing
from test_ops_fused import DEV, _Poisoned


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(triton_routing, "torch", _Poisoned())


def reference(logits, bias, k, renormalize, scaling, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(moe_ops, "use_triton", lambda t, compiled=False: False)
        return moe_ops.sigmoid_topk_routing(logits, bias, k, renormalize=renormalize, scaling=scaling)


@pytest.mark.parametrize(("N", "E", "k", "with_bias", "renormalize", "scale"), [
    (5, 8, 2, True, True, 1.0), (3, 6, 3, True, False, 1.0), (4, 70, 5, False, True, 1.0), (2, 7, 7, True, True, 1.0),
    (6, 32, 4, True, True, 30.0),  # saturated sigmoids: the bias decides
    (300, 70, 5, True, True, 1.0), (1000, 8, 3, False, False, 1.0),  # several programs, the last one partial
    (601, 70, 5, True, True, 1.0), (5000, 8, 3, True, False, 1.0),  # tiles of 4 and 32 tokens, the last partial
])
def test_routing_kernel_matches_reference(N, E, k, with_bias, renormalize, scale, monkeypatch):
    g = torch.Generator().manual_seed(N * E + k)
    logits = (torch.randn(N, E, generator=g) * scale).to(DEV)
    bias = (torch.randn(E, generator=g) * 0.1).to(DEV) if with_bias else None
    want = reference(logits, bias, k, renormalize, 2.5, monkeypatch)
    weights, indices, scores = triton_routing.sigmoid_topk_routing_triton(logits, bias, k, renormalize, 2.5)
    assert torch.equal(indices, want.indices)
    torch.testing.assert_close(scores, want.scores, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weights, want.weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("with_bias", [False, True])
def test_sigmoid_topk_routing_takes_the_kernel_with_and_without_autograd(with_bias, monkeypatch):
    """Without autograd the kernel does all of the routing; with it only the picks, the weights then come from
    differentiable scores: the reference's weights and gradients (an odd expert count, k not a power of two)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 11, generator=g).to(DEV)
    bias = (torch.randn(11, generator=g) * 0.1).to(DEV) if with_bias else None
    upstream = torch.randn(7, 3, generator=g).to(DEV)
    want_logits = logits.clone().requires_grad_()
    want = reference(want_logits, bias, 3, True, 2.5, monkeypatch)
    (want.weights * upstream).sum().backward()
    calls = []
    kernel = triton_routing.sigmoid_topk_routing_triton
    monkeypatch.setattr(triton_routing, "sigmoid_topk_routing_triton", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setattr(moe_ops, "use_triton", lambda t, compiled=False: True)
    with torch.no_grad():
        fast = moe_ops.sigmoid_topk_routing(logits, bias, 3, scaling=2.5)
    trained = moe_ops.sigmoid_topk_routing(logits.requires_grad_(), bias, 3, scaling=2.5)
    (trained.weights * upstream).sum().backward()
    assert calls == [1, 1] and not fast.weights.requires_grad
    for got in (fast, trained):
        assert torch.equal(got.indices, want.indices)
        torch.testing.assert_close(got.weights, want.weights.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(logits.grad, want_logits.grad, rtol=1e-6, atol=1e-7)


def test_routing_kernel_stays_whole_in_compiled_code(monkeypatch):
    """Inside torch.compile (Dynamo's tracing with aot_eager here; the compiled decode step on a GPU) the kernel is
    a custom op: no graph break, and the reference's routing."""
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(2)).to(DEV)
    bias = torch.linspace(-0.1, 0.1, 12).to(DEV)
    want = reference(logits, bias, 3, True, 1.5, monkeypatch)
    monkeypatch.setattr(moe_ops, "use_triton", lambda t, compiled=False: compiled)  # the GPU's answer in compiled code
    torch._dynamo.reset()
    route = torch.compile(lambda x: moe_ops.sigmoid_topk_routing(x, bias, 3, scaling=1.5), backend="aot_eager",
                          fullgraph=True)
    with torch.no_grad():
        got = route(logits)
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-6, atol=1e-7)
