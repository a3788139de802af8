"""Routing (sigmoid scores, correction bias for selection only, renormalised weights), expert compute and the
gated activations (SiTU-GLU, SwiGLU)."""

import pytest
import torch
import torch.nn.functional as F

from openk3.ops import moe as moe_ops
from openk3.ops.activations import glu_activation, situ_glu, softcap, swiglu
from openk3.ops.moe import (
    combine_rows,
    combine_rows_reference,
    experts_forward,
    experts_forward_gathered,
    group_by_expert,
    grouped_glu_mlp,
    grouped_glu_mlp_gemm,
    grouped_glu_mlp_loop,
    grouped_layout,
    grouped_mm_usable,
    sigmoid_topk_routing,
)
from saved_tensors import saved_bytes, saved_storages


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


@pytest.mark.parametrize("E", [3, 256, 257, 40000])  # the sort's keys: uint8 up to 256 experts, then int16, int64
def test_group_by_expert_is_a_stable_sort(E):
    g = torch.Generator().manual_seed(E)
    idx = torch.randint(0, E, (97, 5), generator=g)
    idx[0, 0], idx[-1, -1] = 0, E - 1  # the extreme ids
    order, counts = group_by_expert(idx, E)
    assert torch.equal(order, torch.argsort(idx.reshape(-1), stable=True))
    assert torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=E))


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


def experts_forward_before_grouped_gemm(x, indices, weights, gate_up, down, act):
    """experts_forward as it was before the grouped-GEMM path (bincount, loop over experts): the CPU path must keep
    its numbers to the bit."""
    N, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sizes = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // k
    outs = []
    for xe, w1, w2, n in zip(x[token_of].split(sizes), gate_up.unbind(0), down.unbind(0), sizes):
        if n:
            gate, up = F.linear(xe, w1).chunk(2, dim=-1)
            outs.append(F.linear(act(gate, up), w2))
    y = torch.cat(outs)
    out = torch.zeros(N, down.shape[1])
    out.index_add_(0, token_of, y * weights.reshape(-1)[order].unsqueeze(-1))
    return out


def moe_case(E, I, Din, Dout, N, k, seed, dtype=torch.float32, dead=()):
    """x [N,Din], gate_up [E,2I,Din], down [E,Dout,I] and a routing in which the experts in `dead` get no token."""
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(N, Din, generator=g) * 2, torch.randn(E, 2 * I, Din, generator=g) / Din**0.5,
              torch.randn(E, Dout, I, generator=g) / I**0.5]
    bias = torch.zeros(E)
    bias[list(dead)] = -10.0
    return [t.to(dtype) for t in leaves], sigmoid_topk_routing(torch.randn(N, E, generator=g), bias, k)


def grads_of(fn, leaves, dy):
    leaves = [t.clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out.backward(dy)
    return [out] + [t.grad for t in leaves]


def test_cpu_experts_unchanged_to_the_bit():
    """On CPU experts_forward takes the loop: outputs and fp32 gradients identical to the previous implementation."""
    (x, gate_up, down), r = moe_case(E=6, I=10, Din=12, Dout=9, N=37, k=3, seed=3, dead=(1, 5))
    act = glu_activation("situ")
    dy = torch.randn(37, 9, generator=torch.Generator().manual_seed(4))
    leaves = [x, gate_up, down, r.weights]
    new = grads_of(lambda x, a, b, w: experts_forward(x, r.indices, w, a, b, act), leaves, dy)
    old = grads_of(lambda x, a, b, w: experts_forward_before_grouped_gemm(x, r.indices, w, a, b, act), leaves, dy)
    for a, b in zip(new, old):
        assert torch.equal(a, b)


@pytest.mark.parametrize("N,k", [(1, 1), (1, 3), (7, 2), (13, 5)])
def test_gathered_experts_equal_the_sorted_path(N, k):
    """The gathered path (decode at batch 1) against the sorted one on the same rows, fp32, SiTU-GLU, an expert
    with no token and large inputs; and the dispatch: one token without autograd takes it."""
    (x, gate_up, down), r = moe_case(E=6, I=10, Din=12, Dout=9, N=N, k=k, seed=N + k, dead=(1,))
    x = x * 30  # into SiTU-GLU's softcapped range
    act = glu_activation("situ")
    with torch.no_grad():
        got = experts_forward_gathered(x, r.indices, r.weights, gate_up, down, act)
    want = sorted_path(x, r, gate_up, down, act)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if N == 1:
        calls = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(moe_ops, "experts_forward_gathered", lambda *a: calls.append(1) or got)
            with torch.no_grad():
                experts_forward(x, r.indices, r.weights, gate_up, down, act)
            experts_forward(x, r.indices, r.weights, gate_up, down, act)  # with autograd: the sorted path
        assert calls == [1]


def test_one_token_gathers_small_experts_or_few_of_many():
    """Gathering reads k experts three times: for small experts (GATHER_MAX_BYTES), or when 3 k < E, where the grouped
    GEMM's groups of at least 8 rows read all E (kimi-linear-48b: 8 experts of 14 MiB among 256) unless the row kernel
    runs; never for two tokens."""
    big = 14 << 20
    assert moe_ops.gathers(1, 4, 8, 1 << 20) and moe_ops.gathers(1, 4, 8, 1 << 20, row_kernel=True)
    assert moe_ops.gathers(1, 8, 256, big) and not moe_ops.gathers(1, 8, 256, big, row_kernel=True)
    assert not moe_ops.gathers(1, 8, 24, big) and not moe_ops.gathers(2, 8, 256, big)


def sorted_path(x, r, gate_up, down, act):
    """`experts_forward`'s sorted path (autograd on, which the fast paths leave alone; nothing requires grad)."""
    with torch.enable_grad():
        return experts_forward(x, r.indices, r.weights, gate_up, down, act)


@pytest.mark.parametrize("E,N,k", [(6, 2, 3), (6, 7, 2), (5, 13, 1), (8, 64, 4)])
def test_dense_experts_equal_the_sorted_path(E, N, k):
    """The dense path (decode batches that pick >= E rows: every expert on every token, the picked outputs
    combined) against the sorted one, fp32, SiTU-GLU, an expert nobody picks, large inputs; and the dispatch:
    without autograd such a batch takes it, a batch picking fewer rows than experts and autograd do not."""
    (x, gate_up, down), r = moe_case(E=E, I=10, Din=12, Dout=9, N=N, k=k, seed=E + N + k, dead=(1,))
    x = x * 30  # into SiTU-GLU's softcapped range
    act = glu_activation("situ")
    with torch.no_grad():
        got = moe_ops.experts_forward_dense(x, r.indices, r.weights, gate_up, down, act)
    torch.testing.assert_close(got, sorted_path(x, r, gate_up, down, act), rtol=1e-5, atol=1e-5)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_ops, "experts_forward_dense", lambda *a: calls.append(len(a[0])) or got)
        with torch.no_grad():
            experts_forward(x, r.indices, r.weights, gate_up, down, act)
            (xs, _, _), rs = moe_case(E=E, I=10, Din=12, Dout=9, N=2, k=1, seed=1)
            experts_forward(xs, rs.indices, rs.weights, gate_up, down, act)  # 2 rows < E experts: sorted
        sorted_path(x, r, gate_up, down, act)
    assert calls == [N]


def reference_grouped_mm(a, b, offs):
    """torch._grouped_mm's 2-D x 3-D contract written as a loop: rows offs[g-1]:offs[g] of a times b[g]."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))])


@pytest.mark.parametrize("mm", ["torch", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_path_matches_loop(mm, dtype):
    """The grouped path (padded layout, two grouped GEMMs, packed GLU) against the loop: outputs and gradients of
    the rows and both weights, with empty experts first, in the middle and last, and an odd row count. It runs
    torch's own CPU grouped-GEMM kernel (16-byte row strides: widths multiples of 8) and a plain loop in its place."""
    E, I, Din, Dout, N, k = 7, 16, 24, 8, 29, 2
    (x, gate_up, down), r = moe_case(E, I, Din, Dout, N, k, seed=5, dtype=dtype, dead=(0, 3, 6))
    order, counts = group_by_expert(r.indices, E)
    assert counts[[0, 3, 6]].eq(0).all()
    x_sorted = x[order // k]
    act = glu_activation("situ")
    dy = torch.randn(N * k, Dout, generator=torch.Generator().manual_seed(6)).to(dtype)
    kw = {} if mm == "torch" else {"mm": reference_grouped_mm}
    grouped = grads_of(lambda x, a, b: grouped_glu_mlp_gemm(x, counts, a, b, act, **kw), [x_sorted, gate_up, down], dy)
    loop = grads_of(lambda x, a, b: grouped_glu_mlp_loop(x, counts, a, b, act), [x_sorted, gate_up, down], dy)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(grouped, loop):
        assert a.dtype == b.dtype and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **tol)
    for e in (0, 3, 6):  # experts without tokens get exactly zero gradient
        assert torch.equal(grouped[2][e], torch.zeros_like(grouped[2][e]))
        assert torch.equal(grouped[3][e], torch.zeros_like(grouped[3][e]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_moved_by_gathers_equal_index_select_to_the_bit(dtype):
    """The padded layout's row moves (`_MoveRows`: backward a gather by the inverse map) against index_select,
    whose backward is an index_add: outputs and gradients bitwise, empty experts included."""
    from openk3.ops.moe import _MoveRows

    g = torch.Generator().manual_seed(11)
    counts = torch.tensor([0, 5, 1, 0, 9, 3])
    M, D = int(counts.sum()), 7
    layout = grouped_layout(counts, M, 4)
    x = torch.randn(M, D, generator=g).to(dtype).requires_grad_()
    d_pad = torch.randn(layout.capacity, D, generator=g).to(dtype)
    ours = _MoveRows.apply(x, layout.source, layout.dest, True)
    ref = torch.cat([x, x.new_zeros(1, D)]).index_select(0, layout.source)
    assert torch.equal(ours, ref)
    assert torch.equal(*(torch.autograd.grad(out, x, d_pad)[0] for out in (ours, ref)))
    y = torch.randn(layout.capacity, D, generator=g).to(dtype).requires_grad_()
    d_rows = torch.randn(M, D, generator=g).to(dtype)
    ours, ref = _MoveRows.apply(y, layout.dest, layout.source, False), y.index_select(0, layout.dest)
    assert torch.equal(ours, ref)
    assert torch.equal(*(torch.autograd.grad(out, y, d_rows)[0] for out in (ours, ref)))


def test_grouped_layout_properties():
    g = torch.Generator().manual_seed(7)
    for align in (4, 8):
        for _ in range(5):
            E = int(torch.randint(1, 9, (1,), generator=g))
            counts = torch.randint(0, 12, (E,), generator=g) * torch.randint(0, 2, (E,), generator=g)
            M = int(counts.sum())
            lay = grouped_layout(counts, M, align)
            ends = lay.offsets.tolist()
            starts = [0] + ends[:-1]
            sizes = [e - s for s, e in zip(starts, ends)]
            assert lay.offsets.dtype == torch.int32 and ends[-1] == lay.capacity
            assert all(s % align == 0 and n >= align for s, n in zip(starts, sizes))  # aligned, never empty
            assert len(set(lay.dest.tolist())) == M  # rows do not collide
            expert = torch.repeat_interleave(torch.arange(E), counts)
            row = torch.arange(M) - (counts.cumsum(0) - counts)[expert]  # rank of each row inside its expert
            assert lay.dest.tolist() == [starts[e] + int(j) for e, j in zip(expert.tolist(), row)]


def test_grouped_path_shapes_without_host_reads():
    """On the meta device (no values exist, and the checks mirror the CUDA kernel's: bf16 operands, 16-byte
    strides) the whole grouped path, forward and backward, runs: it never reads counts or indices on the host."""
    with torch.device("meta"):
        E, k, N = 8, 2, 13
        r = sigmoid_topk_routing(torch.randn(N, E), torch.zeros(E), k)
        x = torch.randn(N, 16, dtype=torch.bfloat16, requires_grad=True)
        gate_up = torch.randn(E, 64, 16, requires_grad=True)
        down = torch.randn(E, 24, 32, requires_grad=True)
        order, counts = group_by_expert(r.indices, E)
        y = grouped_glu_mlp_gemm(x[order // k], counts, gate_up, down, glu_activation("situ"))
        assert y.shape == (N * k, 24) and y.dtype == torch.bfloat16
        y.float().sum().backward()
        assert x.grad.shape == x.shape and gate_up.grad.shape == gate_up.shape and down.grad.shape == down.shape


def test_grouped_dispatch_on_cpu_is_the_loop():
    (x, gate_up, down), r = moe_case(E=4, I=8, Din=8, Dout=8, N=9, k=2, seed=8)
    assert not grouped_mm_usable(x, gate_up, down)
    order, counts = group_by_expert(r.indices, 4)
    act = glu_activation("situ")
    assert torch.equal(grouped_glu_mlp(x[order // 2], counts, gate_up, down, act),
                       grouped_glu_mlp_loop(x[order // 2], counts, gate_up, down, act))


@pytest.mark.parametrize("dtype,acc", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                       (torch.float64, torch.float64)])
def test_combine_rows_equals_autograd_reference(dtype, acc):
    """combine_rows (its own backward, keeping y in its dtype) against the same expression in autograd's hands:
    outputs and the gradients of y and w identical to the bit; odd sizes, tokens hit 0-4 times, values from 1e-30
    to 1e15, w with and without a gradient."""
    g = torch.Generator().manual_seed(11)
    M, D, N = 37, 13, 11
    scale = torch.logspace(-30, 15, D, dtype=torch.float64)
    y = (torch.randn(M, D, generator=g, dtype=torch.float64) * scale).to(dtype)
    w = torch.rand(M, 1, generator=g) * 3
    token_of = torch.randint(0, N - 1, (M,), generator=g)  # token N-1 gets no row
    dy = torch.randn(N, D, generator=g, dtype=acc)
    for w_grad in (True, False):
        runs = []
        for fn in (combine_rows, combine_rows_reference):
            leaves = [y.clone().requires_grad_(), w.clone().requires_grad_(w_grad)]
            out = fn(leaves[0], leaves[1], token_of, N, acc)
            out.backward(dy)
            runs.append([out, leaves[0].grad, leaves[1].grad])
        assert runs[0][0].dtype == acc and runs[0][1].dtype == dtype
        assert torch.equal(runs[0][0][N - 1], torch.zeros(D, dtype=acc))
        for a, b in zip(*runs):
            assert (a is None and b is None) or torch.equal(a, b)


def test_combine_rows_keeps_bf16_rows_only():
    """For backward, combine_rows keeps the bf16 rows, the weights and the index: a third of the reference's
    bytes for the rows (which keeps their fp32 copy and the fp32 products)."""
    M, D = 40, 64
    y = torch.randn(M, D, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(M, 1, requires_grad=True)
    token_of = torch.randint(0, 10, (M,))
    ours = saved_bytes(lambda: combine_rows(y, w, token_of, 10, torch.float32))
    theirs = saved_bytes(lambda: combine_rows_reference(y, w, token_of, 10, torch.float32))
    assert ours == M * D * 2 + M * 4 + M * 8
    assert theirs - ours == 2 * M * D * 4 - M * D * 2


def test_grouped_gemm_path_keeps_no_copy_of_the_rows():
    """Under bf16 autocast the grouped path keeps the padded rows for the first GEMM and the gate/up product
    (bf16, capacity rows each; the GLU and its output are recomputed from the product in backward) and integer
    indices: no second copy of the sorted rows, no GLU output."""
    E, I, Din, Dout, N, k = 4, 16, 24, 8, 21, 2
    (x, gate_up, down), r = moe_case(E, I, Din, Dout, N, k, seed=12)
    order, counts = group_by_expert(r.indices, E)
    x_sorted = x[order // k].to(torch.bfloat16).requires_grad_()
    gate_up.requires_grad_(), down.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = saved_storages(lambda: grouped_glu_mlp_gemm(x_sorted, counts, gate_up, down, glu_activation("situ")),
                              exclude=[gate_up, down])
    capacity = grouped_layout(counts, N * k, 8).capacity
    # an empty storage holds no bytes (torch 2.11's grouped GEMM saves one)
    floats = sorted((shape, dtype) for dtype, shape, nbytes in kept
                    if dtype.is_floating_point and shape[0] != E and nbytes)
    assert floats == [((capacity, Din), torch.bfloat16), ((capacity, 2 * I), torch.bfloat16)]
    assert all(dtype in (torch.int32, torch.int64) for dtype, _, _ in kept if not dtype.is_floating_point)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sorted_path_without_autograd_sums_rows_in_place(dtype):
    """Without autograd the sorted path puts the expert rows back in (token, slot) order and sums each token's k
    (no atomic adds): the values of the autograd path's `combine_rows` up to the order of the k additions, over
    an expert nobody picks and tokens picking their experts in any order."""
    (x, gate_up, down), r = moe_case(E=7, I=12, Din=20, Dout=16, N=37, k=3, seed=11, dead=(2,))
    x, gate_up, down = (t.to(dtype) for t in (x, gate_up, down))
    act = glu_activation("swiglu")
    mlp = lambda rows, counts: grouped_glu_mlp_loop(rows, counts, gate_up, down, act)  # noqa: E731
    with torch.no_grad():
        got = moe_ops.experts_forward_sorted(x, r.indices, r.weights, 7, mlp)
    want = moe_ops.experts_forward_sorted(x, r.indices, r.weights, 7, mlp)
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
