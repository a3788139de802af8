"""Absorbed MLA decode over paged latents: the Triton kernel (under TRITON_INTERPRET=1 on CPU) against the plain
PyTorch reference, and the reference against the contiguous absorbed attention of `openk3.ops.attention`."""

import pytest
import torch

from openk3.ops.attention import mla_attention_absorbed
from openk3.ops.paged_mla import (
    MAX_SPLITS,
    PROGRAMS_PER_PROCESSOR,
    combine_splits,
    combine_splits_triton,
    paged_mla_decode,
    paged_mla_decode_reference,
    split_count,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # without CUDA the kernel runs under TRITON_INTERPRET=1


def paged_setup(lengths, page_size, latent_dim, slice_dim, heads, seed, spare_pages=3, dtype=torch.float32):
    """Random latents for each sequence scattered over randomly permuted physical pages (page 0 unused), block
    tables with extra pages past each sequence's end (never read), and the same latents contiguous."""
    g = torch.Generator().manual_seed(seed)
    width = latent_dim + slice_dim
    need = [-(-n // page_size) + spare_pages for n in lengths]
    num_pages = 1 + sum(need)
    pool = torch.randn(num_pages, page_size, width, generator=g).to(dtype)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(lengths) + 2, max(need), dtype=torch.int32)
    rows = torch.randperm(len(lengths) + 2, generator=g)[: len(lengths)]  # sequences in arbitrary table rows
    contiguous = []
    for i, (n, k) in enumerate(zip(lengths, need)):
        pages, perm = perm[:k], perm[k:]
        tables[rows[i], :k] = torch.tensor(pages, dtype=torch.int32)
        contiguous.append(torch.cat([pool[p] for p in pages])[:n])
    q = torch.randn(len(lengths), heads, width, generator=g).to(dtype) * 2
    to = lambda t: t.to(DEV)
    return to(q), to(pool), to(tables), to(rows), to(torch.tensor(lengths)), [to(c) for c in contiguous]


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("lengths,page_size", [([1, 4, 5, 6, 17, 40], 5), ([1, 33, 64, 65], 32), ([7], 48)])
def test_kernel_matches_reference(lengths, page_size, splits):
    """Odd lengths (not page multiples, one token, exactly one page), spare pages in the tables, more splits than
    tiles (empty splits), heads fewer than a head block, an odd latent width."""
    q, pool, tables, rows, lens, _ = paged_setup(lengths, page_size, latent_dim=24, slice_dim=8, heads=3, seed=splits)
    want = paged_mla_decode_reference(q, pool, tables, rows, lens, 24, scale=0.3)
    got = paged_mla_decode(q, pool, tables, rows, lens, 24, scale=0.3, num_splits=splits, min_split=32)
    assert got.shape == (len(lengths), 3, 24) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def several_queries(q_single: torch.Tensor, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    N, H, D = q_single.shape
    return (torch.randn(N, T, H, D, generator=g) * 2).to(q_single.device, q_single.dtype)


def test_reference_with_several_queries_is_each_query_alone():
    """Query t of a sequence attends its first lengths + t positions: the [N,T,H,D] reference equals T calls of the
    one-query reference with those lengths; padding queries (past num_tokens) give 0."""
    q1, pool, tables, rows, lens, _ = paged_setup([9, 30, 64], 8, latent_dim=16, slice_dim=8, heads=3, seed=5)
    q = several_queries(q1, 4, seed=6)
    real = torch.tensor([4, 1, 3], device=q.device)
    got = paged_mla_decode_reference(q, pool, tables, rows, lens - 3, 16, scale=0.4, num_tokens=real)
    for t in range(4):
        want = paged_mla_decode_reference(q[:, t], pool, tables, rows, lens - 3 + t, 16, scale=0.4)
        want = want * (t < real).view(-1, 1, 1)
        torch.testing.assert_close(got[:, t], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T,heads,latent,splits", [(4, 3, 24, 0), (4, 3, 24, 3), (7, 5, 24, 2), (3, 20, 512, 0),
                                                   (2, 1, 16, 5)])
def test_kernel_with_several_queries_matches_reference(T, heads, latent, splits):
    """T queries a sequence read its past once (row blocks of several queries' heads; at R = 512 the 60 rows take
    two blocks), causal among themselves, odd lengths over page boundaries, padding queries past num_tokens (one
    sequence all but one), more splits than its positions hold, one query's past a single position."""
    lengths = [1, 5, 17, 40, 70]
    q1, pool, tables, rows, lens, _ = paged_setup([n + T for n in lengths], 8, latent_dim=latent, slice_dim=8,
                                                  heads=heads, seed=T + heads)
    q = several_queries(q1, T, seed=T)
    lens = torch.tensor(lengths, device=q.device)  # positions the first query attends
    real = torch.tensor([T, 1, T - 1, T, max(1, T - 2)], device=q.device)
    want = paged_mla_decode_reference(q, pool, tables, rows, lens, latent, scale=0.3, num_tokens=real)
    got = paged_mla_decode(q, pool, tables, rows, lens, latent, scale=0.3, num_splits=splits, min_split=32,
                           num_tokens=real)
    assert got.shape == (5, T, heads, latent) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    whole = paged_mla_decode(q, pool, tables, rows, lens, latent, scale=0.3, num_splits=splits, min_split=32)
    torch.testing.assert_close(whole, paged_mla_decode_reference(q, pool, tables, rows, lens, latent, scale=0.3),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("queries", [1, 5])
def test_split_count_by_queries_and_a_long_sequence(queries):
    """The op's own split count (0): a long sequence at a small batch spreads over many splits, each at least
    `min_split` positions; the short ones use their first splits only (the rest are empty)."""
    lengths = [700, 1, 65, 300, 33][:queries]
    q, pool, tables, rows, lens, _ = paged_setup(lengths, 64, latent_dim=16, slice_dim=8, heads=2, seed=queries)
    want = paged_mla_decode_reference(q, pool, tables, rows, lens, 16, scale=0.2)
    for min_split in (32, 256):
        got = paged_mla_decode(q, pool, tables, rows, lens, 16, scale=0.2, min_split=min_split)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_split_count_fills_the_device_and_stays_in_bounds():
    cpu = torch.device("cpu")
    assert split_count(1, 1, cpu) == PROGRAMS_PER_PROCESSOR
    assert split_count(10**6, 1, cpu) == 1
    assert all(1 <= split_count(n, b, cpu) <= MAX_SPLITS for n in (1, 3, 64) for b in (1, 2))


def test_kernel_refuses_bad_split_arguments():
    q, pool, tables, rows, lens, _ = paged_setup([5], 8, latent_dim=16, slice_dim=0, heads=1, seed=0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_mla_decode(q, pool, tables, rows, lens, 16, scale=1.0, num_splits=-1)
    with pytest.raises(ValueError, match="min_split"):
        paged_mla_decode(q, pool, tables, rows, lens, 16, scale=1.0, min_split=40)
    with pytest.raises(ValueError, match="q must be"):
        paged_mla_decode(q[0], pool, tables, rows, lens, 16, scale=1.0)
    with pytest.raises(ValueError, match="sequences a launch"):
        paged_mla_decode(q.expand(70000, -1, -1), pool, tables, rows, lens, 16, scale=1.0)


def test_kernel_extreme_scores_and_more_heads_than_a_block():
    """Large logits (a near one-hot softmax) and 20 heads (two head blocks); no slice (r = 0 is padded away)."""
    q, pool, tables, rows, lens, _ = paged_setup([3, 50], 16, latent_dim=16, slice_dim=0, heads=20, seed=7)
    q = q * 30
    want = paged_mla_decode_reference(q, pool, tables, rows, lens, 16, scale=1.0)
    got = paged_mla_decode(q, pool, tables, rows, lens, 16, scale=1.0, num_splits=2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_reference_is_the_absorbed_attention_of_the_last_position():
    """With q = [q_nope W_UK | q_slice] and W_UV applied after, the paged reference equals `mla_attention_absorbed`
    on the contiguous latents for a query at the last position of each (ragged) sequence."""
    H, n, r, v, R = 3, 8, 4, 6, 12
    lengths = [1, 9, 20]
    g = torch.Generator().manual_seed(3)
    _, pool, tables, rows, lens, contiguous = (x.cpu() if torch.is_tensor(x) else [c.cpu() for c in x]
                                               for x in paged_setup(lengths, 8, R, r, H, seed=4))
    kv_b = torch.randn(H * (n + v), R, generator=g) / R**0.5
    q_full = torch.randn(len(lengths), H, n + r, generator=g)
    w = kv_b.view(H, n + v, R)
    w_uk, w_uv = w[:, :n], w[:, n:]
    q_absorbed = torch.cat([torch.einsum("bhn,hnr->bhr", q_full[..., :n], w_uk), q_full[..., n:]], dim=-1)
    o_latent = paged_mla_decode_reference(q_absorbed, pool, tables, rows, lens, R, scale=(n + r) ** -0.5)
    got = torch.einsum("bhr,hvr->bhv", o_latent, w_uv)
    L = max(lengths)
    padded = torch.zeros(len(lengths), L, R + r)
    for i, c in enumerate(contiguous):
        padded[i, : len(c)] = c
    want = mla_attention_absorbed(q_full[:, None], padded, kv_b, nope_dim=n, v_dim=v, scale=(n + r) ** -0.5,
                                  lengths=lens - 1)[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("N,S,H,R", [(1, 64, 32, 512), (3, 5, 20, 24), (2, 1, 1, 7), (2, 7, 3, 200), (64, 5, 32, 512),
                                         (2, 15, 5, 130), (2, 16, 5, 130), (1, 300, 3, 130), (1, 512, 8, 256)])
def test_combine_splits_kernel_matches_reference(N, S, H, R):
    """The one-launch merge against `combine_splits`, in both forms (the splits walked, below
    COMBINE_ALL_SPLITS_FROM, and all at once): empty splits (lse -inf, zero partials) first and between, lse spread
    over +-80 (exp of the differences near fp32's limits), heads past a block, odd widths, more splits than a
    program's tile. An empty split's partial is never written by the kernel: NaN there must not be read."""
    g = torch.Generator().manual_seed(N * S + H)
    out = torch.randn(N, S, H, R, generator=g)
    lse = torch.randn(N, S, H, generator=g) * 40
    lse[:, 0] = 80.0
    if S > 2:
        lse[:, 1::2] = float("-inf")
        out[:, 1::2] = float("nan")
    got = combine_splits_triton(out.to(DEV), lse.to(DEV)).cpu()
    torch.testing.assert_close(got, combine_splits(out, lse), rtol=1e-5, atol=1e-5)


def test_combine_splits_ignores_empty_splits():
    out = torch.randn(2, 3, 4, 5)
    lse = torch.randn(2, 3, 4)
    lse[:, 1] = float("-inf")
    out[:, 1] = float("nan")
    merged = combine_splits(out, lse)
    w = torch.softmax(lse, dim=1)
    torch.testing.assert_close(merged, (out.nan_to_num() * w.unsqueeze(-1)).sum(1))
