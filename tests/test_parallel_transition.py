"""What KCP computes and exchanges, on one process: KDA as an affine map of its incoming state (chunked form against
the per-token composition, in fp64), the fp32 chain for bf16 inputs, the gradient of a span's outputs with respect to
its incoming state (backward exchange), and the token layout of a split stream."""

import pytest
import torch

from openk3.ops.gates import k3_gate
from openk3.ops.kda import kda, kda_recurrent
from openk3.ops.kda.transition import (
    compose_maps,
    kda_initial_state_grad,
    kda_transition,
    kda_transition_chunked,
    kda_transition_reference,
    piece_tokens,
)
from openk3.parallel.layout import SequenceSplit


def inputs(B, T, H, K, V, *, seed, gate="random", dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    k = r(B, T, H, K)
    k = k / k.norm(dim=-1, keepdim=True)
    g = {"random": k3_gate(r(B, T, H, K) * 3, torch.zeros(H), torch.zeros(H * K)).to(dtype),
         "floor": torch.full((B, T, H, K), -5.0, dtype=dtype),
         "near0": -1e-4 * torch.rand(B, T, H, K, generator=gen, dtype=dtype),
         "unbounded": -20 * torch.rand(B, T, H, K, generator=gen, dtype=dtype)}[gate]
    return k, r(B, T, H, V), g, torch.rand(B, T, H, generator=gen, dtype=dtype)


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("T, chunk", [(1, 16), (16, 16), (17, 16), (37, 8)])
@pytest.mark.parametrize("gate", ["random", "floor", "near0", "unbounded"])
def test_transition_equals_token_by_token(T, chunk, gate):
    """The chunk-map form, and the augmented-state KDA pass (here on the recurrent backend), in fp64."""
    k, v, g, beta = inputs(2, T, 2, 8, 5, seed=T + chunk, gate=gate)
    S_ref, M_ref = kda_transition_reference(k, v, g, beta)
    for S, M in (kda_transition_chunked(k, v, g, beta, chunk_size=chunk), kda_transition(k, v, g, beta,
                                                                                         backend="recurrent")):
        assert rel(S, S_ref) < 1e-12 and (M - M_ref).abs().max() < 1e-12


def test_transition_on_the_triton_backend():
    """The augmented-state pass on the Triton kernels (the interpreter on CPU), fp32, values and gradients."""
    pytest.importorskip("triton")
    k, v, g, beta = inputs(1, 37, 2, 16, 16, seed=5, gate="near0", dtype=torch.float32)
    leaves = [t.clone().requires_grad_() for t in (k, v, g, beta)]
    wS, wM = torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16)
    results = []
    for fn in (lambda *a: kda_transition(*a, backend="triton"), kda_transition_reference):
        S, M = fn(*leaves)
        results.append((S, M, *torch.autograd.grad((S * wS).sum() + (M * wM).sum(), leaves)))
    for a, b in zip(*results):
        assert rel(a.detach(), b.detach()) < 1e-4


@pytest.mark.parametrize("gate, gate_min, dtype", [("near0", None, torch.float32), ("random", -5.0, torch.float32),
                                                    ("near0", -5.0, torch.bfloat16)])
def test_transition_without_grad_runs_the_state_only_pass(gate, gate_min, dtype, monkeypatch):
    """Under no_grad (KCP's forward exchange) the Triton route is the state recurrence alone (no full KDA pass:
    `kda` must not be called), in both gate modes and for bf16 inputs; fp32 results against the fp64 composition."""
    pytest.importorskip("triton")
    from openk3.ops.kda import transition

    def full_pass(*args, **kwargs):
        raise AssertionError("the full forward ran")

    monkeypatch.setattr(transition, "kda", full_pass)
    k, v, g, beta = inputs(2, 21, 2, 16, 12, seed=21, gate=gate, dtype=dtype)
    S_ref, M_ref = kda_transition_reference(*(t.double() for t in (k, v, g, beta)))
    with torch.no_grad():
        S, M = kda_transition(k, v, g, beta, backend="triton", gate_min=gate_min)
    assert S.dtype == M.dtype == torch.float32
    assert rel(S.double(), S_ref) < 1e-5 and (M.double() - M_ref).abs().max() < 1e-5


@pytest.mark.parametrize("T", [5, 33])
def test_transition_is_kda_as_an_affine_map(T):
    """kda from any incoming state S0 ends at M S0 + S_ext, and the gradients of (S_ext, M) match the reference's."""
    k, v, g, beta = inputs(1, T, 3, 4, 6, seed=T, gate="near0")
    S0 = torch.randn(1, 3, 4, 6, dtype=torch.float64)
    q = torch.randn_like(k)
    _, final = kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, backend="recurrent")
    S, M = kda_transition_chunked(k, v, g, beta)
    assert rel(M @ S0 + S, final) < 1e-12

    leaves = [t.clone().requires_grad_() for t in (k, v, g, beta)]
    wS, wM = torch.randn_like(S), torch.randn_like(M)
    grads = []
    for fn in (kda_transition_chunked, kda_transition_reference):
        S, M = fn(*leaves)
        grads.append(torch.autograd.grad((S * wS).sum() + (M * wM).sum(), leaves))
    for a, b in zip(*grads):
        assert rel(a, b) < 1e-10


def test_bf16_inputs_keep_the_chain_in_fp32():
    k, v, g, beta = inputs(1, 300, 2, 16, 16, seed=0, gate="near0", dtype=torch.bfloat16)
    S_ref, M_ref = kda_transition_reference(*(t.double() for t in (k, v, g, beta)))
    for backend in ("chunked", "recurrent"):
        S, M = kda_transition(k, v, g, beta, backend=backend)
        assert S.dtype == M.dtype == torch.float32
        assert rel(S.double(), S_ref) < 1e-5 and rel(M.double(), M_ref) < 1e-5


def test_compose_maps_in_order():
    M = torch.randn(5, 3, 3, dtype=torch.float64)
    b = torch.randn(5, 3, 2, dtype=torch.float64)
    total_M, total_b = torch.eye(3, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.float64)
    for i in range(5):  # map 0 first
        total_M, total_b = M[i] @ total_M, M[i] @ total_b + b[i]
    got_M, got_b = compose_maps(M, b)
    assert rel(got_M, total_M) < 1e-14 and rel(got_b, total_b) < 1e-14


def _initial_state_grad_reference(q, k, v, g, beta, do, cu_seqlens, gate_min):
    """Autograd through the token-by-token recurrence from a zero initial-state leaf, fp64."""
    q, k, v, g, beta, do = (t.double() for t in (q, k, v, g, beta, do))
    if gate_min is not None:
        g = g.clamp_min(gate_min)
    N = k.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    h0 = torch.zeros(N, *k.shape[2:], v.shape[-1], dtype=torch.float64, requires_grad=True)
    o, _ = kda_recurrent(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_seqlens)
    return torch.autograd.grad(o, h0, do)[0]


@pytest.mark.parametrize("B, T, cu, gate, gate_min", [
    (2, 19, None, "random", None),
    (1, 37, (0, 21, 37), "unbounded", None),  # two sequences, neither a multiple of 16 tokens; the any-gate kernels
    (1, 45, (0, 1, 40, 45), "floor", -5.0),  # the bounded kernels; a 1-token sequence
])
def test_initial_state_grad_triton_and_autograd_against_the_recurrence(B, T, cu, gate, gate_min):
    """The Triton route (prepare + reverse pass, the interpreter on CPU) and the autograd route (chunked), fp32,
    both against autograd through the recurrence; odd sizes, several 16-token chunks per sequence."""
    pytest.importorskip("triton")
    k, v, g, beta = inputs(B, T, 2, 16, 12, seed=T, gate=gate, dtype=torch.float32)
    gen = torch.Generator().manual_seed(T + 1)
    q = torch.randn(B, T, 2, 16, generator=gen)
    do = 100 * torch.randn(B, T, 2, 12, generator=gen)  # large, so the result is not near the fp32 floor
    cu_seqlens = None if cu is None else torch.tensor(cu)
    expected = _initial_state_grad_reference(q, k, v, g, beta, do, cu_seqlens, gate_min)
    results = {backend: kda_initial_state_grad(q, k, v, g, beta, do, cu_seqlens=cu_seqlens, backend=backend,
                                               gate_min=gate_min) for backend in ("triton", "chunked")}
    for got in results.values():
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert rel(got.double(), expected) < 1e-5
    assert rel(results["triton"], results["chunked"]) < 1e-5


@pytest.mark.parametrize("B, T, piece", [(2, 96, 32), (2, 101, 32), (1, 70, 48), (1, 40, 16)])
def test_transition_in_pieces(B, T, piece):
    """The state-only pass cut into pieces (a dense batch of pieces when they divide T, varlen pieces otherwise),
    their maps composed, against the fp64 composition token by token; and against one chain."""
    pytest.importorskip("triton")
    k, v, g, beta = inputs(B, T, 2, 16, 12, seed=T + piece, gate="near0", dtype=torch.float32)
    S_ref, M_ref = kda_transition_reference(*(t.double() for t in (k, v, g, beta)))
    with torch.no_grad():
        S, M = kda_transition(k, v, g, beta, backend="triton", piece=piece)
        S1, M1 = kda_transition(k, v, g, beta, backend="triton", piece=T)
    assert S.shape == (B, 2, 16, 12) and M.shape == (B, 2, 16, 16) and S.dtype == M.dtype == torch.float32
    assert rel(S.double(), S_ref) < 1e-5 and rel(M.double(), M_ref) < 1e-5
    assert rel(S, S1) < 1e-5 and rel(M, M1) < 1e-5


@pytest.mark.parametrize("B, T, cu, piece", [(2, 96, None, 32), (2, 101, None, 32), (1, 101, (0, 3, 70, 101), 16),
                                             (1, 50, (0, 50), 48)])
def test_initial_state_grad_in_pieces(B, T, cu, piece):
    """The reverse pass from [0 | I] per piece gives [Y | M^T]; the pieces composed last first equal the recurrence's
    initial-state gradient (dense and varlen pieces, a 3-token sequence shorter than a piece)."""
    pytest.importorskip("triton")
    k, v, g, beta = inputs(B, T, 2, 16, 12, seed=T + piece, gate="random", dtype=torch.float32)
    gen = torch.Generator().manual_seed(piece)
    q = torch.randn(B, T, 2, 16, generator=gen)
    do = 100 * torch.randn(B, T, 2, 12, generator=gen)
    cu_seqlens = None if cu is None else torch.tensor(cu)
    expected = _initial_state_grad_reference(q, k, v, g, beta, do, cu_seqlens, None)
    got = kda_initial_state_grad(q, k, v, g, beta, do, cu_seqlens=cu_seqlens, backend="triton", piece=piece)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert rel(got.double(), expected) < 1e-5


def test_reverse_pass_from_the_identity_returns_the_transposed_transition():
    """initial_state_grad_triton from [0 | I] with dO's extra columns zero: [dS0 | M^T] (M: kda_transition's)."""
    pytest.importorskip("triton")
    from openk3.ops.kda.triton import initial_state_grad_triton

    k, v, g, beta = inputs(1, 45, 2, 16, 12, seed=9, gate="near0", dtype=torch.float32)
    q, do = torch.randn(1, 45, 2, 16), torch.randn(1, 45, 2, 12)
    start = torch.cat([torch.zeros(1, 2, 16, 12), torch.eye(16).expand(1, 2, 16, 16)], dim=-1)
    both = initial_state_grad_triton(q, k, v, g, beta, do, final_state_grad=start)
    with torch.no_grad():
        _, M = kda_transition(k, v, g, beta, backend="triton", piece=45)
    assert rel(both[..., 12:], M.mT) < 1e-5
    assert rel(both[..., :12], initial_state_grad_triton(q, k, v, g, beta, do)) < 1e-6
    with pytest.raises(ValueError, match="final_state_grad must be"):
        initial_state_grad_triton(q, k, v, g, beta, do, final_state_grad=start[..., :8])


def test_piece_sizes():
    """Few chains: a power of two of pieces, whole 64-token chunks; enough chains or short sequences: no pieces."""
    assert piece_tokens([65536], 8) == 2048  # 32 pieces of 8 heads: 256 chains
    assert piece_tokens([131072], 8) == 4096
    assert piece_tokens([65536] * 2, 8) == 4096
    assert piece_tokens([65536], 32) is None and piece_tokens([65536] * 4, 8) is None  # enough chains already
    assert piece_tokens([1500], 8) is None and piece_tokens([2048], 8) == 1024  # pieces of >= 1024 tokens
    size = piece_tokens([100_003], 8)
    assert size % 64 == 0 and -(-100_003 // size) <= 32
    with pytest.raises(ValueError, match="piece must be a positive"):
        kda_transition(*inputs(1, 8, 1, 4, 4, seed=0, dtype=torch.float32), backend="triton", piece=0)


def test_initial_state_grad_is_the_adjoint_of_the_initial_state():
    """fp64, chunked: o is affine in S0, so <o(S0) - o(0), dO> = <dS0, S0> for any S0 (no autograd in the check)."""
    k, v, g, beta = inputs(1, 29, 3, 4, 6, seed=3, gate="random")
    gen = torch.Generator().manual_seed(4)
    q, do = torch.randn_like(k), torch.randn(1, 29, 3, 6, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 10, 29])
    S0 = torch.randn(2, 3, 4, 6, generator=gen, dtype=torch.float64)
    o1, _ = kda(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu, backend="chunked")
    o0, _ = kda(q, k, v, g, beta, cu_seqlens=cu, backend="chunked")
    dS0 = kda_initial_state_grad(q, k, v, g, beta, do, cu_seqlens=cu, backend="chunked")
    assert dS0.dtype == torch.float64
    lhs, rhs = ((o1 - o0) * do).sum(), (dS0 * S0).sum()
    assert abs(lhs - rhs) < 1e-12 * abs(rhs)
    for n in range(2):  # each sequence's state reaches only its own outputs
        S = torch.zeros_like(S0)
        S[n] = S0[n]
        o, _ = kda(q, k, v, g, beta, initial_state=S, cu_seqlens=cu, backend="chunked")
        assert abs(((o - o0) * do).sum() - (dS0[n] * S0[n]).sum()) < 1e-12 * abs(rhs)


def test_initial_state_grad_rejects_a_mismatched_do():
    k, v, g, beta = inputs(1, 5, 1, 4, 3, seed=0)
    with pytest.raises(ValueError, match="do must have v's shape"):
        kda_initial_state_grad(k, k, v, g, beta, v[..., :2], backend="chunked")


def test_sequence_split_bookkeeping():
    """Documents [0,5) [5,35) [35,50) over ranks [0,9) [9,11) [11,35) [35,50)."""
    split = SequenceSplit((0, 5, 35, 50), (0, 9, 11, 35, 50))
    assert [split.local_cu_seqlens(r) for r in range(4)] == [[0, 5, 9], [0, 2], [0, 24], [0, 15]]
    assert [split.continues_from(r) for r in range(4)] == [False, True, True, False]
    assert [split.continues_to(r) for r in range(4)] == [True, True, False, False]
    assert [split.spans(r) for r in range(4)] == [False, True, False, False]
    assert [list(split.state_chain(r)) for r in range(4)] == [[], [0], [0, 1], []]
    assert [list(split.later_chain(r)) for r in range(4)] == [[1, 2], [2], [], []]
    assert split.tail_start(0) == 5 and split.head_start(2) == 5
    assert split.positions(1).tolist() == [4, 5] and split.doc_lengths(1).tolist() == [30, 30]
    assert SequenceSplit.even((0, 10, 30), 4).bounds == (0, 7, 15, 22, 30)


@pytest.mark.parametrize("cu, bounds, message", [
    ((0, 5, 5, 9), (0, 4, 9), "cu_seqlens"),
    ((0, 9), (0, 4, 4, 9), "every rank holds a token"),
    ((0, 9), (0, 4, 8), "rank bounds"),
])
def test_sequence_split_rejects_bad_layouts(cu, bounds, message):
    with pytest.raises(ValueError, match=message):
        SequenceSplit(cu, bounds)
