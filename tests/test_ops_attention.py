"""MLA: the absorbed form on the latent cache equals the expanded form, and both equal plain softmax attention."""

import pytest
import torch

from openk3.ops.attention import mla_attention_absorbed, mla_attention_expanded, mla_expand_kv, mla_mask

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
