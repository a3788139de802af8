"""MLA: the absorbed form on the latent cache equals the expanded form, and both equal plain softmax attention; the
training path runs a fused SDPA kernel (no T x T tensor) and its gradients match the written-out attention."""

import functools

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import TorchDispatchMode

from openk3.config import get_preset
from openk3.model import GatedMLA
from openk3.ops.attention import (
    NO_CUDNN,
    causal_sdpa,
    mla_attention_absorbed,
    mla_attention_expanded,
    mla_expand_kv,
    mla_mask,
    past_and_own_attention,
)

H, N, R, V, RD = 3, 8, 12, 6, 4  # heads, nope dim, kv_lora_rank, v dim, slice dim


def setup(B, T, L, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, N + RD, generator=g, dtype=dtype)
    cache = torch.randn(B, L, R + RD, generator=g, dtype=dtype)
    kv_b = torch.randn(H * (N + V), R, generator=g, dtype=dtype) / R**0.5
    return q, cache, kv_b


def naive(q, cache, kv_b, lengths):
    """Softmax attention written out per sequence and query, with k = [W_UK c | k_slice], v = W_UV c."""
    B, T, Hh, _ = q.shape
    k, v = mla_expand_kv(cache, kv_b, Hh, N, V)  # [B,H,L,*]
    out = torch.zeros(B, T, Hh, V, dtype=q.dtype)
    for b in range(B):
        for i in range(T):
            n_keys = int(lengths[b]) + i + 1
            s = torch.einsum("hd,hld->hl", q[b, i], k[b, :, :n_keys]) * (N + RD) ** -0.5
            out[b, i] = torch.einsum("hl,hlv->hv", s.softmax(-1), v[b, :, :n_keys])
    return out


def test_expand_kv_layout():
    _, cache, kv_b = setup(1, 1, 5)
    k, v = mla_expand_kv(cache, kv_b, H, N, V)
    h = 1
    w = kv_b.view(H, N + V, R)[h]
    assert torch.allclose(k[0, h, :, :N], cache[0, :, :R] @ w[:N].T)
    assert torch.allclose(k[0, h, :, N:], cache[0, :, R:])  # shared, un-rotated slice
    assert torch.allclose(v[0, h], cache[0, :, :R] @ w[N:].T)


@pytest.mark.parametrize("T", [1, 6])
def test_no_past_causal(T):
    q, cache, kv_b = setup(2, T, T, seed=T)
    lengths = torch.zeros(2, dtype=torch.long)
    ref = naive(q, cache, kv_b, lengths)
    for fn in (mla_attention_expanded, mla_attention_absorbed):
        out = fn(q, cache, kv_b, nope_dim=N, v_dim=V)
        assert torch.allclose(out, ref, atol=1e-10), fn.__name__
        out = fn(q, cache, kv_b, nope_dim=N, v_dim=V, lengths=lengths)
        assert torch.allclose(out, ref, atol=1e-10), fn.__name__


@pytest.mark.parametrize("T", [1, 3])
def test_ragged_past(T):
    lengths = torch.tensor([0, 5, 2, 9])
    L = int(lengths.max()) + T + 2  # extra padded rows must be ignored
    q, cache, kv_b = setup(4, T, L, seed=7)
    ref = naive(q, cache, kv_b, lengths)
    exp = mla_attention_expanded(q, cache, kv_b, nope_dim=N, v_dim=V, lengths=lengths)
    absb = mla_attention_absorbed(q, cache, kv_b, nope_dim=N, v_dim=V, lengths=lengths)
    assert torch.allclose(exp, ref, atol=1e-10)
    assert torch.allclose(absb, ref, atol=1e-10)
    assert torch.allclose(exp, absb, atol=1e-10)


@pytest.mark.parametrize("pad_v", [None, True, False])
@pytest.mark.parametrize("T", [1, 5])
def test_equal_past_without_lengths_is_the_bottom_right_causal_mask(T, pad_v, monkeypatch):
    """lengths=None with L > T (every sequence had L - T tokens: a chunk after a prefix) equals the explicit
    lengths, with v padded or not."""
    from openk3.ops import attention

    monkeypatch.setattr(attention, "causal_sdpa", functools.partial(causal_sdpa, pad_v=pad_v))
    q, cache, kv_b = setup(3, T, T + 6, seed=9)
    ref = naive(q, cache, kv_b, torch.full((3,), 6))
    for backends in (None, NO_CUDNN):  # the serving path restricts the kernels (CPU: the math fallback either way)
        out = mla_attention_expanded(q, cache, kv_b, nope_dim=N, v_dim=V, backends=backends)
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    with pytest.raises(ValueError, match="must hold the T=5 new tokens"):
        mla_attention_expanded(*setup(1, 5, 4, seed=1), nope_dim=N, v_dim=V)


def test_fp32_agreement_and_padding_garbage_ignored():
    lengths = torch.tensor([3, 7])
    q, cache, kv_b = setup(2, 1, 12, seed=3, dtype=torch.float32)
    a = mla_attention_absorbed(q, cache, kv_b, nope_dim=N, v_dim=V, lengths=lengths)
    cache2 = cache.clone()
    cache2[0, 4:] = 1e4  # rows past lengths[b] + T are padding
    cache2[1, 8:] = -3e3
    b = mla_attention_expanded(q, cache2, kv_b, nope_dim=N, v_dim=V, lengths=lengths)
    c = mla_attention_absorbed(q, cache2, kv_b, nope_dim=N, v_dim=V, lengths=lengths)
    assert torch.allclose(a, c, atol=1e-5, rtol=1e-5)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_mask():
    m = mla_mask(torch.tensor([0, 2]), 2, 5)
    assert m.shape == (2, 1, 2, 5)
    assert m[0, 0, 0].tolist() == [True, False, False, False, False]
    assert m[1, 0, 1].tolist() == [True, True, True, True, False]


@pytest.mark.parametrize("pad_v", [None, True, False])
def test_training_path_gradients_match_naive(pad_v, monkeypatch):
    """The expanded (training) path with v padded to the q/k head dim or not: outputs and the gradients of q, the
    latent cache and kv_b against the attention written out per query (fp64, odd T)."""
    from openk3.ops import attention

    monkeypatch.setattr(attention, "causal_sdpa", functools.partial(causal_sdpa, pad_v=pad_v))
    q, cache, kv_b = setup(2, 11, 11, seed=5)
    dy = torch.randn(2, 11, H, V, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    runs = []
    for fn in (lambda *a: mla_attention_expanded(*a, nope_dim=N, v_dim=V), lambda *a: naive(*a, torch.zeros(2))):
        leaves = [t.clone().requires_grad_() for t in (q, cache, kv_b)]
        out = fn(*leaves)
        out.backward(dy)
        runs.append([out] + [t.grad for t in leaves])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


class ShapeRecorder(TorchDispatchMode):
    """Records the name and output shapes of every aten op that runs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, tuple | list) else [out]:
            if isinstance(o, torch.Tensor):
                self.ops.append((str(func), tuple(o.shape)))
        return out


def test_training_path_forms_no_t_by_t_tensor():
    """A Gated MLA layer's forward and backward without a cache (the training path): one fused SDPA op each way and
    no tensor with two trailing T-sized dims anywhere (q/k head dim 48 != v head dim 32 here, as in K3)."""
    cfg = get_preset("k3-tiny")
    layer = GatedMLA(cfg, 3)
    T = 37
    x = torch.randn(2, T, cfg.hidden_size, requires_grad=True)
    with ShapeRecorder() as rec:
        layer(x).square().sum().backward()
    assert not [op for op in rec.ops if op[1][-2:] == (T, T)]
    assert any("flash_attention" in name and "backward" in name for name, _ in rec.ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,L,scale", [(1, 2, 0.2), (37, 101, 0.2), (64, 64 + 1, 0.2), (19, 300, 8.0)])
def test_past_and_own_flash_calls_merged_equal_bottom_right_causal_attention(dtype, T, L, scale):
    """The serving prefill's long-context attention (two flash calls, past unmasked and own block causal, merged by
    their log-sum-exps; torch's CPU flash kernel stands in for the CUDA one) against SDPA with the bottom-right
    causal mask in fp64, odd sizes, and scores large enough (scale 8) that one key takes almost all the weight."""
    gen = torch.Generator().manual_seed(T * L)
    q, k = (torch.randn(2, 3, n, 24, generator=gen).to(dtype) for n in (T, L))
    v = torch.randn(2, 3, L, 16, generator=gen).to(dtype)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale,
                                                            attn_mask=causal_lower_right(T, L))
    got = past_and_own_attention(q, k, v, scale)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
