"""Short causal conv (full vs step vs the formula; the recomputing conv + SiLU Function vs the plain composition),
gates, norms."""

import math

import pytest
import torch
import torch.nn.functional as F

from openk3.ops.conv import (
    causal_conv1d,
    causal_conv1d_reference,
    causal_conv1d_step,
    conv_window_after,
    conv_windows,
)
from openk3.ops.gates import k3_gate, kimi_gate
from openk3.ops.norms import l2_norm, rms_norm
from saved_tensors import saved_storages


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


def _conv_run(fn, x, w, s0, dy, autocast):
    leaves = [t.clone().requires_grad_() for t in (x, w, s0)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y, s = fn(*leaves)
    torch.autograd.backward([y, s], [dy.to(y.dtype), torch.ones_like(s)])
    return [y.detach(), s.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize(("W", "T", "scale"), [(4, 1, 1.0), (4, 2, 30.0), (3, 17, 1.0), (1, 5, 1.0), (4, 13, 1e3)])
def test_conv_function_matches_reference(W, T, scale, autocast):
    """The conv + SiLU Function (keeps x, recomputes in backward) against the plain composition on fresh random
    inputs with a carried state (odd widths, T < W-1, large values where SiLU saturates): outputs, new state and
    the gradients of x, the kernel and the state identical to the bit, in fp32 and under CPU bf16 autocast (x bf16
    as the projections give it, fp32 kernel and state), where both run the same bf16 ops."""
    g = torch.Generator().manual_seed(W * 100 + T)
    B, C = 2, 7
    dtype = torch.bfloat16 if autocast else torch.float32
    x = (torch.randn(B, T, C, generator=g) * scale).to(dtype)
    w = torch.randn(C, 1, W, generator=g)
    s0 = torch.randn(B, C, W - 1, generator=g) * scale
    dy = torch.randn(B, T, C, generator=g)
    got = _conv_run(causal_conv1d, x, w, s0, dy, autocast)
    ref = _conv_run(causal_conv1d_reference, x, w, s0, dy, autocast)
    for name, a, b in zip(("y", "state", "dx", "dw", "dstate"), got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_conv_function_keeps_only_its_input():
    """Under bf16 autocast the Function keeps x and the (zero) state, no copy of the conv's input or its output;
    the plain composition keeps both, and autocast's bf16 copy of the kernel."""
    B, T, C, W = 2, 9, 6, 4
    x = torch.randn(B, T, C, dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(C, 1, W, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = saved_storages(causal_conv1d, x, w, exclude=[w])
        kept_ref = saved_storages(causal_conv1d_reference, x, w, exclude=[w])
    assert sorted(shape for _, shape, _ in kept) == sorted([(B, T, C), (B, C, W - 1)])
    bf16 = torch.bfloat16
    assert sorted(kept_ref) == sorted([(bf16, (B, C, W - 1 + T), 2 * B * C * (W - 1 + T)),
                                       (bf16, (B, C, T), 2 * B * C * T), (bf16, (C, 1, W), 2 * C * W)])


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


@pytest.mark.parametrize(("W", "T"), [(4, 1), (4, 2), (4, 3), (4, 9), (2, 5), (6, 4)])
def test_conv_windows_equal_slices_of_the_history(W, T):
    """The conv state after any number of each row's inputs (`conv_windows`: per-row ends on the device;
    `conv_window_after`: one host end) equals W-1 columns of the history [state | x^T], which neither forms: ends
    inside the state (fewer inputs than the window), at 0 and at T, in bf16 x with an fp32 state."""
    g = torch.Generator().manual_seed(W * 10 + T)
    B, C = 5, 7
    state = torch.randn(B, C, W - 1, generator=g)
    x = torch.randn(B, T, C, generator=g).to(torch.bfloat16)
    history = torch.cat([state, x.transpose(1, 2).float()], dim=-1)
    ends = torch.randint(0, T + 1, (B,), generator=g)
    ends[0], ends[-1] = 0, T
    want = torch.stack([history[b, :, int(e):int(e) + W - 1] for b, e in enumerate(ends)])
    got = conv_windows(state, x, ends)
    assert got.shape == (B, C, W - 1) and got.dtype == state.dtype and torch.equal(got, want)
    for end in range(T + 1):
        assert torch.equal(conv_window_after(state, x, end), history[..., end:end + W - 1])
    assert torch.equal(conv_windows(state, x[:, :0], torch.zeros(B, dtype=torch.long)), state)
