"""Chunked KDA (WY/UT form) against the token recurrence, in fp64: outputs, final states and gradients."""

import pytest
import torch

from openk3.ops.gates import k3_gate, kimi_gate
from openk3.ops.kda import kda, kda_chunked, kda_recurrent
from openk3.ops.kda.chunked import _anchor_plan, _pair_matrices, _span_decays, kda_chunked_with_states


@pytest.fixture(autouse=True)
def _fp64_default():
    """Tensors made without an explicit dtype in this module are fp64 (restored afterwards)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def make_inputs(B, T, H, K, V, *, seed, gate="random", beta="random", state=False, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    k = k / k.norm(dim=-1, keepdim=True)  # the layer L2-normalises k
    if gate == "random":
        g = k3_gate(r(B, T, H, K), torch.zeros(H), torch.zeros(H * K)).to(dtype)  # in (-5, 0)
    elif gate == "bound":
        g = torch.full((B, T, H, K), -5.0, dtype=dtype)
    elif gate == "near0":
        g = -1e-7 * torch.rand(B, T, H, K, generator=gen, dtype=dtype)
    elif gate == "mixed":  # per channel, some at the bound, some near 0
        g = torch.where(torch.rand(B, T, H, K, generator=gen) < 0.5, -5.0, -1e-7).to(dtype)
    elif gate == "kimi":  # Kimi Linear's unbounded gate, A_log = log 16: one chunk decays by e^-100s
        g = kimi_gate(3 * r(B, T, H, K), torch.full((H,), 16.0).log(), torch.zeros(H * K)).to(dtype)
    elif gate == "extreme":  # per channel and token: -400, -100, -50 or near 0, mixed
        g = torch.tensor([-400.0, -100.0, -50.0, -1e-3, -1e-6])[torch.randint(5, (B, T, H, K), generator=gen)]
        g = g.to(dtype)
    elif gate == "spikes":  # whole tokens at -400 (the state is wiped), the others near 0
        g = -1e-4 * torch.rand(B, T, H, K, generator=gen, dtype=dtype)
        g[:, torch.rand(T, generator=gen) < 0.2] = -400.0
    elif gate == "-inf":  # alpha = 0 exactly in some channels and tokens (g = log 0), the others K3's
        g = k3_gate(r(B, T, H, K), torch.zeros(H), torch.zeros(H * K)).to(dtype)
        g[torch.rand(B, T, H, K, generator=gen) < 0.1] = float("-inf")
    if beta == "random":
        b = torch.rand(B, T, H, generator=gen, dtype=dtype)
    elif beta == "near0":
        b = torch.full((B, T, H), 1e-7, dtype=dtype)
    elif beta == "near1":
        b = torch.full((B, T, H), 1 - 1e-7, dtype=dtype)
    s0 = r(B, H, K, V) if state else None
    return q, k, v, g, b, s0


def assert_close(a, b, tol=1e-9):
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"max |diff| {err}"


SHAPES = [  # B, T, H, K, V
    (1, 1, 1, 4, 4),
    (2, 1, 3, 8, 5),
    (1, 7, 2, 8, 8),
    (2, 31, 2, 8, 6),
    (1, 32, 1, 16, 16),
    (2, 33, 3, 8, 12),
    (1, 70, 2, 16, 8),
    (3, 65, 1, 4, 4),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("state", [False, True])
def test_chunked_matches_recurrence(shape, state):
    q, k, v, g, b, s0 = make_inputs(*shape, seed=hash(shape) % 1000, state=state)
    o_ref, s_ref = kda_recurrent(q, k, v, g, b, initial_state=s0, output_final_state=True)
    o, s = kda_chunked(q, k, v, g, b, initial_state=s0, output_final_state=True)
    assert o.shape == shape[:3] + (shape[4],)
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed):
    """Fresh random (B, T, H, K, V), gate regime, beta regime and chunk size per seed."""
    rng = torch.Generator().manual_seed(100 + seed)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=rng))
    shape = (pick(1, 3), pick(1, 90), pick(1, 4), pick(1, 20), pick(1, 20))
    gate = ["random", "bound", "near0", "mixed"][seed % 4]
    beta = ["random", "near0", "near1"][seed % 3]
    q, k, v, g, b, s0 = make_inputs(*shape, seed=seed, gate=gate, beta=beta, state=seed % 2 == 0)
    o_ref, s_ref = kda_recurrent(q, k, v, g, b, initial_state=s0, output_final_state=True)
    o, s = kda_chunked(q, k, v, g, b, initial_state=s0, output_final_state=True, chunk_size=[8, 16, 32][seed % 3])
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("gate", ["bound", "near0", "mixed"])
@pytest.mark.parametrize("beta", ["random", "near0", "near1"])
def test_extreme_gates_and_betas(gate, beta):
    q, k, v, g, b, s0 = make_inputs(2, 45, 2, 8, 8, seed=3, gate=gate, beta=beta, state=True)
    o_ref, s_ref = kda_recurrent(q, k, v, g, b, initial_state=s0, output_final_state=True)
    for chunk in (16, 32, 64):
        o, s = kda_chunked(q, k, v, g, b, initial_state=s0, output_final_state=True, chunk_size=chunk)
        assert_close(o, o_ref)
        assert_close(s, s_ref)


def test_unbounded_kimi_gate_is_safe():
    """Very negative log decays (Kimi Linear's softplus gate has no bound) must not overflow the chunked form."""
    q, k, v, _, b, s0 = make_inputs(1, 40, 2, 8, 8, seed=5, state=True)
    g = -torch.rand(1, 40, 2, 8) * 60.0
    o_ref, s_ref = kda_recurrent(q, k, v, g, b, initial_state=s0, output_final_state=True)
    o, s = kda_chunked(q, k, v, g, b, initial_state=s0, output_final_state=True)
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("bounds", [[0, 1, 17, 50, 64], [0, 64], [0, 31, 33, 40, 41, 64], [0, 5, 5, 64]])
@pytest.mark.parametrize("state", [False, True])
def test_cu_seqlens_ragged(bounds, state):
    n = len(bounds) - 1
    q, k, v, g, b, _ = make_inputs(1, 64, 2, 8, 8, seed=len(bounds))
    s0 = torch.randn(n, 2, 8, 8) if state else None
    cu = torch.tensor(bounds)
    o_ref, s_ref = kda_recurrent(q, k, v, g, b, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    o, s = kda_chunked(q, k, v, g, b, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    assert_close(o, o_ref)
    assert_close(s, s_ref)
    # each span equals an independent run of that sequence alone
    for i in range(n):
        a, e = bounds[i], bounds[i + 1]
        if a == e:
            continue
        oi, si = kda_recurrent(q[:, a:e], k[:, a:e], v[:, a:e], g[:, a:e], b[:, a:e],
                               initial_state=None if s0 is None else s0[i : i + 1], output_final_state=True)
        assert_close(o[:, a:e], oi)
        assert_close(s[i : i + 1], si)


def test_split_sequence_carries_state():
    """Running T tokens at once equals running them in two pieces with the state carried over."""
    q, k, v, g, b, s0 = make_inputs(2, 50, 2, 8, 8, seed=9, state=True)
    o, s = kda_chunked(q, k, v, g, b, initial_state=s0, output_final_state=True)
    o1, s1 = kda_chunked(q[:, :23], k[:, :23], v[:, :23], g[:, :23], b[:, :23], initial_state=s0,
                         output_final_state=True)
    o2, s2 = kda_chunked(q[:, 23:], k[:, 23:], v[:, 23:], g[:, 23:], b[:, 23:], initial_state=s1,
                         output_final_state=True)
    assert_close(torch.cat([o1, o2], 1), o)
    assert_close(s2, s)


def outputs_and_grads(fn, inputs, dtype=torch.float64, **kwargs):
    """o, the final state and the gradients of a random linear loss of both w.r.t. q, k, v, g, beta (and the initial
    state when given), all in fp64; `inputs` as make_inputs returns them, cast to `dtype` first."""
    leaves = [None if t is None else t.to(dtype).clone().requires_grad_(True) for t in inputs]
    o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(1)
    w_o, w_s = torch.randn(o.shape, generator=gen), torch.randn(s.shape, generator=gen)
    ((o.double() * w_o).sum() + (s.double() * w_s).sum()).backward()
    return [o.double(), s.double()] + [t.grad.double() for t in leaves if t is not None]


@pytest.mark.parametrize("shape,state,gate", [
    ((2, 19, 2, 8, 6), True, "random"),
    ((1, 40, 3, 4, 4), False, "random"),
    ((1, 1, 2, 8, 8), True, "random"),
    ((2, 37, 2, 8, 5), True, "kimi"),
    ((1, 50, 2, 8, 8), True, "extreme"),
    ((2, 23, 1, 4, 4), False, "spikes"),
    ((1, 29, 2, 8, 4), True, "-inf"),
])
def test_gradients_agree(shape, state, gate):
    inputs = make_inputs(*shape, seed=11, state=state, gate=gate)
    ref = outputs_and_grads(kda_recurrent, inputs, scale=0.7)
    for a, b in zip(outputs_and_grads(kda_chunked, inputs, scale=0.7), ref):
        assert_close(a, b)


@pytest.mark.parametrize("gate", ["random", "kimi", "extreme", "spikes"])
def test_gradients_agree_varlen(gate):
    """Ragged sequences (cu_seqlens, one of length 1, padded chunks) with their initial states."""
    *inputs, _ = make_inputs(1, 47, 2, 8, 8, seed=12, gate=gate)
    cu = torch.tensor([0, 1, 18, 47])
    inputs.append(torch.randn(3, 2, 8, 8, generator=torch.Generator().manual_seed(2)))
    ref = outputs_and_grads(kda_recurrent, inputs, cu_seqlens=cu)
    for a, b in zip(outputs_and_grads(kda_chunked, inputs, cu_seqlens=cu), ref):
        assert_close(a, b)


@pytest.mark.parametrize("gate", ["random", "kimi", "extreme", "spikes", "-inf"])
def test_fp32_matches_fp64_reference(gate):
    """In fp32 the chunked form (bounded and unbounded gates alike) stays within fp32 rounding of the fp64
    recurrence, outputs, final state and gradients (the exponents are sums over spans, never differences of
    large cumsums: a -400 gate beside gates near 0 costs no precision)."""
    inputs = make_inputs(2, 45, 2, 16, 8, seed=13, gate=gate, state=True)
    ref = outputs_and_grads(kda_recurrent, inputs)
    for a, b in zip(outputs_and_grads(kda_chunked, inputs, dtype=torch.float32), ref):
        assert_close(a, b, tol=1e-5)


@pytest.mark.parametrize("C", [1, 2, 4, 8, 16, 32, 64])
def test_pair_matrices_from_anchors(C):
    """The block-anchored pair matrices equal their definition, sum_d x_id k_jd exp(G_id - G_jd) for j < i (and
    j <= i for q), on gates mixing -400 with values near 0."""
    gen = torch.Generator().manual_seed(C)
    q, k = torch.randn(2, 3, C, 8, generator=gen), torch.randn(2, 3, C, 8, generator=gen)
    g = torch.where(torch.rand(2, 3, C, 8, generator=gen) < 0.1, -400.0, -torch.rand(2, 3, C, 8, generator=gen))
    plan = _anchor_plan(C, g.dtype, g.device)
    decay_in, decay_out, row_decays, col_decays = _span_decays(g, plan)
    A_qk, A_kk = _pair_matrices(q, k, row_decays, col_decays, plan)
    G = g.cumsum(-2)
    i, j = torch.arange(C)[:, None], torch.arange(C)[None, :]
    decay = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill((j > i)[..., None], float("-inf")).exp()
    pairwise = lambda x: torch.einsum("...id,...ijd,...jd->...ij", x, decay, k)  # noqa: E731
    assert_close(A_qk, pairwise(q), tol=1e-12)
    assert_close(A_kk, pairwise(k).tril(-1), tol=1e-12)
    assert_close(decay_in, G.exp(), tol=1e-12)
    assert_close(decay_out, (G[..., -1:, :] - G).exp(), tol=1e-12)


def test_chunk_size_must_be_a_power_of_two():
    q, k, v, g, b, _ = make_inputs(1, 20, 1, 4, 4, seed=0)
    with pytest.raises(ValueError, match="chunk_size"):
        kda_chunked(q, k, v, g, b, chunk_size=12)


def test_dispatcher_and_scale():
    q, k, v, g, b, s0 = make_inputs(2, 21, 2, 8, 8, seed=13, state=True)
    ref = kda_recurrent(q, k, v, g, b, scale=0.3, initial_state=s0, output_final_state=True)
    for backend in ("recurrent", "chunked", "auto"):
        o, s = kda(q, k, v, g, b, scale=0.3, initial_state=s0, output_final_state=True, backend=backend)
        assert_close(o, ref[0])
        assert_close(s, ref[1])
    o, s = kda(q, k, v, g, b, backend="chunked")
    assert s is None
    assert_close(o, kda_recurrent(q, k, v, g, b)[0])


def test_fp32_and_bf16_inputs():
    q, k, v, g, b, s0 = make_inputs(1, 37, 2, 16, 16, seed=17, state=True)
    o_ref, s_ref = kda_recurrent(q, k, v, g, b, initial_state=s0, output_final_state=True)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        args = [t.to(dtype) for t in (q, k, v, g, b)]
        o, s = kda_chunked(*args, initial_state=s0.float(), output_final_state=True)
        assert o.dtype == dtype and s.dtype == torch.float32
        rel = (o.double() - o_ref).norm() / o_ref.norm()
        assert rel < tol, rel


def test_bad_shapes_name_the_argument():
    q, k, v, g, b, _ = make_inputs(1, 4, 2, 8, 8, seed=0)
    with pytest.raises(ValueError, match="beta"):
        kda(q, k, v, g, b[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        kda(q, k, v, g, b, initial_state=torch.zeros(1, 2, 8, 4))


def test_states_at_chunk_boundaries_from_one_pass():
    """kda_chunked_with_states: the states after 16 and 48 of 53 tokens equal the recurrence stopped there, and the
    output and final state equal a plain call; offsets off the chunk grid are refused, naming the rule."""
    q, k, v, g, b, s0 = make_inputs(2, 53, 2, 8, 4, seed=21, state=True)
    o, states, final = kda_chunked_with_states(q, k, v, g, b, (16, 48), initial_state=s0)
    ref_o, ref_final = kda_recurrent(q, k, v, g, b, initial_state=s0, output_final_state=True)
    torch.testing.assert_close(o, ref_o)
    torch.testing.assert_close(final, ref_final)
    for t, state in zip((16, 48), states):
        _, ref = kda_recurrent(q[:, :t], k[:, :t], v[:, :t], g[:, :t], b[:, :t], initial_state=s0,
                               output_final_state=True)
        torch.testing.assert_close(state, ref)
    for bad in ((5,), (16, 64), (0,)):
        with pytest.raises(ValueError, match="multiples of chunk_size=16"):
            kda_chunked_with_states(q, k, v, g, b, bad)


@pytest.mark.parametrize("gate", ["random", "extreme"])
def test_states_at_chunk_boundaries_gradients(gate):
    """kda_chunked_with_states: gradients through the output, the kept states and the final state (after a padded
    last chunk) equal those of the recurrence stopped at each offset."""
    inputs = make_inputs(2, 45, 2, 8, 4, seed=23, gate=gate, state=True)
    offsets = (16, 32)
    weights = torch.randn(len(offsets) + 1, 2, 2, 8, 4, generator=torch.Generator().manual_seed(3))

    def chunked(q, k, v, g, b, s0):
        o, states, final = kda_chunked_with_states(q, k, v, g, b, offsets, initial_state=s0)
        return o, [*states, final]

    def recurrent(q, k, v, g, b, s0):
        o, final = kda_recurrent(q, k, v, g, b, initial_state=s0, output_final_state=True)
        states = [kda_recurrent(q[:, :t], k[:, :t], v[:, :t], g[:, :t], b[:, :t], initial_state=s0,
                                output_final_state=True)[1] for t in offsets]
        return o, [*states, final]

    grads = []
    for run in (chunked, recurrent):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        o, states = run(*leaves)
        (o.sum() + sum((w * s).sum() for w, s in zip(weights, states))).backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert_close(a, b)


@pytest.mark.parametrize("backend", ["recurrent", "chunked", "triton"])
@pytest.mark.parametrize("offsets", [(16, 48), (5, 16, 53), (53,)])
def test_kda_returns_states_at_offsets(backend, offsets):
    """kda(..., state_offsets=...) from every backend: the fp32 states after those many tokens equal the recurrence
    stopped there; output and final state equal a plain call (chunk-aligned offsets in one pass, others by
    chained calls). The Triton kernels compute in fp32 (under the interpreter without CUDA)."""
    q, k, v, g, b, s0 = make_inputs(2, 53, 2, 16, 8, seed=22, state=True)
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    args = [x.float().to(dev) for x in (q, k, v, g, b)]
    o, final, states = kda(*args, initial_state=s0.float().to(dev), output_final_state=True, backend=backend,
                           state_offsets=offsets)
    o, final, states = o.cpu(), final.cpu(), [s.cpu() for s in states]
    ref_o, ref_final = kda_recurrent(q, k, v, g, b, initial_state=s0, output_final_state=True)
    assert len(states) == len(offsets) and all(s.dtype == torch.float32 for s in states)
    torch.testing.assert_close(o.double(), ref_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final.double(), ref_final, rtol=1e-4, atol=1e-5)
    for t, state in zip(offsets, states):
        _, ref = kda_recurrent(q[:, :t], k[:, :t], v[:, :t], g[:, :t], b[:, :t], initial_state=s0,
                               output_final_state=True)
        torch.testing.assert_close(state.double(), ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="state_offsets"):
        kda(*args, backend=backend, state_offsets=(0,))
