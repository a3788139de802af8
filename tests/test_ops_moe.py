"""Routing (sigmoid scores, correction bias for selection only, renormalised weights), expert compute and the
gated activations (SiTU-GLU, SwiGLU)."""

import pytest
import torch
import torch.nn.functional as F

from openk3.ops.activations import situ_glu, softcap, swiglu
from openk3.ops.moe import experts_forward, group_by_expert, sigmoid_topk_routing


def test_routing_without_bias():
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    r = sigmoid_topk_routing(logits, None, 3)
    s = torch.sigmoid(logits)
    assert torch.equal(r.scores, s)
    top = s.topk(3, dim=-1)
    assert torch.equal(r.indices.sort(-1).values, top.indices.sort(-1).values)
    assert torch.allclose(r.weights.sum(-1), torch.ones(50))
    assert torch.allclose(r.weights, s.gather(-1, r.indices) / s.gather(-1, r.indices).sum(-1, keepdim=True))


def test_bias_affects_selection_only():
    logits = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
    bias = torch.tensor([0.0, 0.0, 10.0, 0.0, -10.0, 0.0])  # expert 2 always picked, expert 4 never
    r = sigmoid_topk_routing(logits, bias, 2)
    assert (r.indices == 2).any(-1).all()
    assert not (r.indices == 4).any()
    s = torch.sigmoid(logits)
    assert torch.equal(r.scores, s)  # scores are unbiased
    sel = s.gather(-1, r.indices)
    assert torch.allclose(r.weights, sel / sel.sum(-1, keepdim=True))  # weights from unbiased scores
    # a bias that does not change the selection does not change the weights
    r0 = sigmoid_topk_routing(logits, None, 2)
    r1 = sigmoid_topk_routing(logits, torch.full((6,), 0.3), 2)
    assert torch.equal(r0.indices, r1.indices) and torch.allclose(r0.weights, r1.weights)


def test_scaling_and_no_renorm():
    logits = torch.randn(10, 5)
    r = sigmoid_topk_routing(logits, None, 2, renormalize=True, scaling=2.5)
    assert torch.allclose(r.weights.sum(-1), torch.full((10,), 2.5))
    r = sigmoid_topk_routing(logits, None, 2, renormalize=False)
    assert torch.allclose(r.weights, torch.sigmoid(logits).gather(-1, r.indices))


def test_experts_forward_matches_per_token_loop():
    """Outputs and the gradients of x, the expert weights and the combine weights; expert 4 gets no token."""
    g = torch.Generator().manual_seed(2)
    E, I, Din, Dout, N, k = 5, 7, 6, 4, 23, 2
    leaves = [torch.randn(N, Din, generator=g, dtype=torch.float64),
              torch.randn(E, 2 * I, Din, generator=g, dtype=torch.float64),
              torch.randn(E, Dout, I, generator=g, dtype=torch.float64)]
    r = sigmoid_topk_routing(torch.randn(N, E, generator=g), torch.tensor([0.0, 0, 0, 0, -10]), k)
    act = lambda a, b: situ_glu(a, b, 4.0, 25.0)
    ours = [t.clone().requires_grad_() for t in leaves + [r.weights.double()]]
    refs = [t.clone().requires_grad_() for t in leaves + [r.weights.double()]]
    out = experts_forward(ours[0], r.indices, ours[3], ours[1], ours[2], act)
    x, gate_up, down, w = refs
    ref = torch.zeros(N, Dout, dtype=torch.float64)
    for n in range(N):
        for j in range(k):
            e = r.indices[n, j]
            gu = gate_up[e] @ x[n]
            ref[n] += w[n, j] * (down[e] @ act(gu[:I], gu[I:]))
    assert torch.allclose(out, ref, atol=1e-5)  # combined in fp32
    dy = torch.randn(N, Dout, generator=g, dtype=torch.float64)
    out.backward(dy)
    ref.backward(dy)
    for a, b in zip(ours, refs):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)
    assert not (r.indices == 4).any() and torch.equal(ours[1].grad[4], torch.zeros_like(ours[1].grad[4]))


def test_group_by_expert():
    idx = torch.tensor([[2, 0], [2, 1], [0, 2]])
    order, counts = group_by_expert(idx, 4)
    assert counts.tolist() == [2, 1, 3, 0]
    assert idx.reshape(-1)[order].tolist() == [0, 0, 1, 2, 2, 2]


def test_situ_glu_formula_and_bounds():
    g = torch.linspace(-300, 300, 2001, dtype=torch.float64)
    u = torch.linspace(-400, 400, 2001, dtype=torch.float64).flip(0)
    out = situ_glu(g, u, 4.0, 25.0)
    ref = (4 * torch.tanh(g / 4) * torch.sigmoid(g)) * (25 * torch.tanh(u / 25))
    assert torch.allclose(out, ref)
    assert out.abs().max() <= 4 * 25
    big = situ_glu(torch.tensor([1e4]), torch.tensor([1e4]))
    assert torch.allclose(big, torch.tensor([100.0]))
    small = torch.tensor([1e-3])
    assert torch.allclose(softcap(small, 4.0), small, rtol=1e-6)  # near-linear near 0


def test_situ_glu_fp32_compute_for_bf16():
    g = torch.randn(100, dtype=torch.bfloat16) * 10
    u = torch.randn(100, dtype=torch.bfloat16) * 10
    out = situ_glu(g, u)
    assert out.dtype == torch.bfloat16
    ref = situ_glu(g.float(), u.float())
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_swiglu():
    g, u = torch.randn(10), torch.randn(10)
    assert torch.allclose(swiglu(g, u), F.silu(g) * u)


@pytest.mark.parametrize("k", [1, 4])
def test_topk_equals_num_experts_or_one(k):
    logits = torch.randn(7, 4)
    r = sigmoid_topk_routing(logits, torch.randn(4), k)
    assert r.indices.shape == (7, k)
    if k == 4:
        assert torch.equal(r.indices.sort(-1).values, torch.arange(4).expand(7, 4))
