"""Short causal conv (full vs step vs the formula), gates, norms."""

import math

import pytest
import torch
import torch.nn.functional as F

from openk3.ops.conv import causal_conv1d, causal_conv1d_step
from openk3.ops.gates import k3_gate, kimi_gate
from openk3.ops.norms import l2_norm, rms_norm


def conv_formula(x, w, state):
    """y_t[c] = silu(sum_w w[c, j] * x_{t-W+1+j}[c]) with the state's W-1 inputs before x."""
    B, T, C = x.shape
    W = w.shape[-1]
    full = torch.cat([state.transpose(1, 2), x], dim=1)  # [B, W-1+T, C]
    y = torch.zeros_like(x)
    for t in range(T):
        for j in range(W):
            y[:, t] += w[:, j] * full[:, t + j]
    return F.silu(y)


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 3, 9])
def test_conv_full_vs_step_vs_formula(W, T):
    g = torch.Generator().manual_seed(W * 10 + T)
    B, C = 2, 5
    x = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    w = torch.randn(C, 1, W, generator=g, dtype=torch.float64)
    s0 = torch.randn(B, C, W - 1, generator=g, dtype=torch.float64)
    y, s = causal_conv1d(x, w, s0)
    assert torch.allclose(y, conv_formula(x, w.squeeze(1), s0))
    state, ys = s0, []
    for t in range(T):
        yt, state = causal_conv1d_step(x[:, t], w, state)
        ys.append(yt)
    assert torch.allclose(torch.stack(ys, 1), y)
    assert torch.allclose(state, s)
    # no state = zeros before the first token
    y0, _ = causal_conv1d(x, w)
    assert torch.allclose(y0, conv_formula(x, w.squeeze(1), torch.zeros_like(s0)))


def test_conv_split_carries_state():
    x = torch.randn(1, 10, 3, dtype=torch.float64)
    w = torch.randn(3, 4, dtype=torch.float64)
    y, s = causal_conv1d(x, w)
    y1, s1 = causal_conv1d(x[:, :6], w)
    y2, s2 = causal_conv1d(x[:, 6:], w, s1)
    assert torch.allclose(torch.cat([y1, y2], 1), y) and torch.allclose(s2, s)


def test_k3_gate_bounds_and_formula():
    H, K = 3, 4
    f = torch.randn(2, 5, H, K) * 50
    A_log = torch.rand(H) * 3
    dt = torch.randn(H * K)
    g = k3_gate(f, A_log, dt, -5.0)
    ref = -5.0 * torch.sigmoid(A_log.exp().view(H, 1) * (f + dt.view(H, K)))
    assert torch.allclose(g, ref)
    assert g.dtype == torch.float32 and (g >= -5.0).all() and (g <= 0).all()
    g2 = k3_gate(f, A_log, dt, -2.0)
    assert (g2 >= -2.0).all()


def test_kimi_gate_formula():
    H, K = 2, 3
    f, A_log, dt = torch.randn(4, H, K), torch.randn(H), torch.randn(H, K)
    g = kimi_gate(f, A_log, dt)
    assert torch.allclose(g, -A_log.exp().view(H, 1) * F.softplus(f + dt))
    assert (g <= 0).all()


def test_norms():
    x = torch.randn(4, 7, dtype=torch.bfloat16)
    w = torch.rand(7)
    y = rms_norm(x, w, eps=1e-5)
    xf = x.float()
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w), atol=1e-2)
    z = l2_norm(torch.tensor([[3.0, 4.0]]))
    assert torch.allclose(z, torch.tensor([[3.0, 4.0]]) / math.sqrt(25 + 1e-6))
