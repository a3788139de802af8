"""KDA Triton kernels vs the fp64 recurrence (SPEC-K3 §2); on CPU they run under TRITON_INTERPRET=1.

Small shapes only (the interpreter is slow); bench/kda_sweep.py is the full GPU sweep. Every buffer the
kernels allocate is NaN-poisoned, so an element a kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

# On a machine without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton.
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("without CUDA the Triton kernels run only under TRITON_INTERPRET=1 (set by tests/conftest.py)")

from openk3.ops.kda import kda, kda_recurrent  # noqa: E402
from openk3.ops.kda.triton import (  # noqa: E402
    activations,
    causal_conv_step,
    causal_conv_step_reference,
    chunk,
    chunk_bwd,
    chunk_fwd,
    decode,
    kda_activations,
    kda_activations_reference,
    kda_decode,
    kda_decode_reference,
    kda_final_state_triton,
    kda_triton,
    kda_triton_fused,
)
from openk3.ops.kda.triton import decode as decode_ops  # noqa: E402
from openk3.ops.kda.triton.layout import chunk_layout  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(o=1e-4, grad=1e-4, gate=1e-4), torch.bfloat16: dict(o=5e-3, grad=8e-3, gate=2e-2)}


class _Poisoned:
    """`torch` as the kernel modules see it, with empty/empty_like returning NaN-filled (or -1) tensors."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _fill(x):
        return x.fill_(float("nan")) if x.is_floating_point() else x.fill_(-1)

    def empty(self, *a, **kw):
        return self._fill(torch.empty(*a, **kw))

    def empty_like(self, *a, **kw):
        return self._fill(torch.empty_like(*a, **kw))


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    for mod in (chunk, chunk_fwd, chunk_bwd, decode, activations):
        monkeypatch.setattr(mod, "torch", _Poisoned())


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), "non-finite values (unwritten or overflowed elements)"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(B, T, H, K, V, dtype, gate="mix", beta_mode="mix", seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    u = lambda *s: torch.rand(*s, generator=gen)
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    g = {"mix": -5 * u(B, T, H, K), "bound": torch.full((B, T, H, K), -5.0), "zero": -1e-4 * u(B, T, H, K)}[gate]
    beta = {"mix": u(B, T, H), "low": 1e-3 * u(B, T, H), "high": 1 - 1e-3 * u(B, T, H)}[beta_mode]
    return [x.to(dtype).to(DEV) for x in (q, k, r(B, T, H, V), g, beta)]


def compare(inputs, dtype, h0=None, cu=None, gate_min=None, dg_atol=0.0, gate_tol=None):
    """Forward, final state and all gradients of kda_triton vs fp64 kda_recurrent (on g clamped at gate_min).
    dg_atol: an absolute allowance for dg, where the true dg is ~0 (no initial state and T = 1: exactly 0);
    gate_tol: a tolerance for dg and dbeta other than TOL's."""
    xs = [x.clone().requires_grad_() for x in inputs] + ([h0.clone().requires_grad_()] if h0 is not None else [])
    kw = dict(output_final_state=True, cu_seqlens=cu)
    o, ht = kda_triton(*xs[:5], initial_state=xs[5] if h0 is not None else None, gate_min=gate_min, **kw)
    ys = [x.detach().double().requires_grad_() for x in xs]
    g_ref = ys[3] if gate_min is None else ys[3].clamp_min(gate_min)
    ro, rht = kda_recurrent(*ys[:3], g_ref, ys[4], initial_state=ys[5] if h0 is not None else None, **kw)
    assert o.dtype == inputs[2].dtype and ht.dtype == torch.float32
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(ro.shape, generator=gen, dtype=torch.float64).to(DEV)
    dht = torch.randn(rht.shape, generator=gen, dtype=torch.float64).to(DEV)
    torch.autograd.backward([o, ht], [do.to(o.dtype), dht.float()])
    torch.autograd.backward([ro, rht], [do, dht])
    tol = TOL[dtype]
    assert rel(o, ro) < tol["o"]
    assert rel(ht, rht) < tol["o"]
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], xs, ys):
        assert a.grad.dtype == a.dtype
        bound = (gate_tol or tol["gate"]) if name in ("g", "beta") else tol["grad"]
        if name == "g" and dg_atol:
            assert (a.grad.double() - b.grad).abs().max() < dg_atol + bound * b.grad.abs().max(), name
        else:
            assert rel(a.grad, b.grad) < bound, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 15, 17, 33])
def test_chunked_matches_recurrence(T, dtype):
    """Both gate modes: any gate (no floor declared) and the bounded kernels (K3's floor)."""
    B, H, K, V = 2, 2, 16, 32
    inputs = make(B, T, H, K, V, dtype, seed=T)
    h0 = torch.randn(B, H, K, V).to(DEV) if T % 2 else None
    compare(inputs, dtype, h0, gate_min=None if T % 3 else -5.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_varlen(dtype):
    """Boundaries mid-chunk, a 1-token sequence, one shorter and one longer than a chunk; V = 48 spans two
    V blocks of the state passes, the second one partly masked."""
    cu = torch.tensor([0, 5, 6, 30, 100], dtype=torch.int32, device=DEV)
    inputs = make(1, 100, 2, 16, 48, dtype, seed=3)
    compare(inputs, dtype, torch.randn(4, 2, 16, 48).to(DEV), cu)


@pytest.mark.parametrize("gate,beta_mode", [("bound", "high"), ("zero", "low"), ("bound", "low"), ("zero", "high")])
@pytest.mark.parametrize("gate_min", [None, -5.0])
def test_extreme_gates_and_betas(gate, beta_mode, gate_min):
    h0 = torch.randn(1, 1, 32, 16).to(DEV)
    compare(make(1, 40, 1, 32, 16, torch.float32, gate, beta_mode, seed=5), torch.float32, h0, gate_min=gate_min)


UNBOUNDED = {  # per-token log decays a softplus gate can produce, and beyond
    "-10": lambda u, s: torch.full(s, -10.0),
    "-40": lambda u, s: torch.full(s, -40.0),
    "-1e3": lambda u, s: torch.full(s, -1e3),
    "log-uniform": lambda u, s: -torch.exp(16 * u(*s) - 9),  # e^-9 .. e^7 ~ 1e3
    "spikes to -1e30": lambda u, s: torch.where(u(*s) < 0.15, -1e30, -0.05 * u(*s)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(UNBOUNDED))
def test_unbounded_gates(name, dtype):
    """Without a declared floor any finite g is exact: per-token decays far below the bounded mode's range, whole
    chunks summing to -1.6e4 and beyond, varlen with boundaries mid-chunk (Kimi Linear's gate)."""
    gen = torch.Generator().manual_seed(len(name))
    inputs = make(1, 45, 2, 16, 16, dtype, seed=len(name))
    g = UNBOUNDED[name](lambda *s: torch.rand(*s, generator=gen), inputs[3].shape).to(dtype).to(DEV)
    inputs[3] = g
    cu = torch.tensor([0, 9, 30, 45], dtype=torch.int32, device=DEV)
    compare(inputs, dtype, torch.randn(3, 2, 16, 16).to(DEV), cu)


def test_declared_floor_clamps_every_backend():
    """gate_min is a promise the kernels rely on, so a g below it is clamped there (never inf / NaN), alike in
    every backend; the clamped gates get no gradient."""
    inputs = make(1, 33, 2, 16, 16, torch.float32, seed=21)
    inputs[3] = inputs[3] * 8  # down to -40, far below the floor
    outs = {}
    for backend in ("triton", "chunked", "recurrent"):
        xs = [x.clone().requires_grad_() for x in inputs]
        o, _ = kda(*xs, backend=backend, gate_min=-5.0)
        o.square().sum().backward()
        outs[backend] = (o, xs[3].grad)
    for backend in ("triton", "chunked"):
        assert rel(outs[backend][0], outs["recurrent"][0]) < 1e-4
        assert rel(outs[backend][1], outs["recurrent"][1]) < 1e-4
    assert torch.equal(outs["triton"][1][inputs[3] < -5], torch.zeros_like(outs["triton"][1][inputs[3] < -5]))
    with pytest.raises(ValueError, match="gate_min"):
        kda(*inputs, gate_min=1.0)


def _to_tf32(x: np.ndarray) -> np.ndarray:
    """fp32 -> tf32 (10 mantissa bits, round to nearest even), as the GPU's tensor cores read fp32 operands."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return np.where((bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000), bits, rounded).view(np.float32)


@pytest.fixture
def gpu_tf32_products(monkeypatch):
    """Make the interpreter's tl.dot(..., input_precision="tf32") round its fp32 operands to tf32 as the GPU does
    (the interpreter multiplies them in full fp32): rounding-sensitive algebra then fails here as it would there."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if "TF32" in str(input_precision).upper() and "X3" not in str(input_precision).upper():
            a, b = (interpreter.TensorHandle(_to_tf32(x.data), x.dtype) if x.data.dtype == np.float32 else x
                    for x in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.mark.parametrize("T,h0", [(1, False), (47, True)])
@pytest.mark.parametrize("gate_min", [None, -5.0])
def test_dg_at_the_gate_floor_with_tf32_products(T, h0, gate_min, gpu_tf32_products):
    """Every gate at K3's floor g = -5 (e^-75 within a chunk), bf16 inputs, tf32 products: dg within the bf16
    gradient tolerance, like dq, dk, dv (it was 0.1-0.15 relative error before Aqk's diagonal left the dG
    products; fla: 0.003). With no initial state and T = 1 the true dg is 0: checked absolutely."""
    inputs = make(1, T, 2, 32, 32, torch.bfloat16, gate="bound", seed=T)
    state = torch.randn(1, 2, 32, 32).to(DEV) if h0 else None
    compare(inputs, torch.bfloat16, state, gate_min=gate_min, dg_atol=1e-6 if T == 1 else 0.0,
            gate_tol=TOL[torch.bfloat16]["grad"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate_min", [None, -5.0])
def test_causal_to_the_bit(dtype, gate_min):
    """Changing every input after position t leaves outputs at <= t bit-identical (also across sequences), in both
    gate modes."""
    T, t = 80, 37
    a = make(1, T, 2, 16, 16, dtype, gate="bound", seed=7)
    b = make(1, T, 2, 16, 16, dtype, gate="zero", seed=8)
    mixed = [torch.cat([x[:, : t + 1], y[:, t + 1 :]], dim=1) for x, y in zip(a, b)]
    for cu in (None, torch.tensor([0, 20, 55, T], dtype=torch.int32, device=DEV)):
        o1, _ = kda_triton(*a, cu_seqlens=cu, gate_min=gate_min)
        o2, _ = kda_triton(*mixed, cu_seqlens=cu, gate_min=gate_min)
        assert torch.equal(o1[:, : t + 1], o2[:, : t + 1])
        assert not torch.equal(o1[:, t + 1 :], o2[:, t + 1 :])


def test_schedule_orders_chunks_for_the_state_pass():
    """By position from each sequence's start; rows past the real chunks are empty and last."""
    lay = chunk_layout(1, 40, torch.tensor([0, 5, 40]), "cpu")
    assert lay.schedule.tolist() == [[0, 0, 5], [1, 5, 21], [2, 21, 37], [3, 37, 40]]
    dense = chunk_layout(2, 20, None, "cpu")  # two sequences of two chunks each
    assert dense.schedule[:, 0].tolist() == [0, 2, 1, 3]
    # built without reading cu_seqlens on the host: 40 // 16 + 3 rows for 3 real chunks, the 2 extra ones empty
    padded = chunk_layout(1, 40, torch.tensor([0, 16, 32, 40]), "cpu")
    assert padded.n_chunks == 5
    assert padded.schedule.tolist() == [[0, 0, 16], [1, 16, 32], [2, 32, 40], [3, 0, 0], [4, 0, 0]]


@pytest.mark.parametrize("gate_min, h0, cu", [
    (-5.0, True, None),  # the bounded kernels, two sequences of 37 tokens (3 chunks, the last partial)
    (-5.0, False, (0, 1, 20, 37)),  # a 1-token sequence, boundaries mid-chunk
    (None, True, (0, 1, 20, 37)),  # the any-gate kernels, steep gates down to -30
    (None, False, None),
])
def test_final_state_alone_matches_the_full_forward(gate_min, h0, cu):
    """kda_final_state_triton (no q-side terms, no outputs) against the full forward's final state from the same
    kernels: equal to fp32 rounding, in both gate modes, with and without an initial state, dense and varlen."""
    B = 2 if cu is None else 1
    q, k, v, g, beta = make(B, 37, 2, 16, 12, torch.float32, seed=37 + (cu is None))
    if gate_min is None:
        g = g * 6
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    N = B if cu is None else len(cu) - 1
    state = torch.randn(N, 2, 16, 12).to(DEV) if h0 else None
    with torch.no_grad():
        _, expected = kda_triton(q, k, v, g, beta, initial_state=state, output_final_state=True, cu_seqlens=cu,
                                 gate_min=gate_min)
        got = kda_final_state_triton(k, v, g, beta, initial_state=state, cu_seqlens=cu, gate_min=gate_min)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert rel(got, expected) < 1e-6


@pytest.mark.parametrize("h0, cu", [(True, None), (False, (0, 1, 20, 37)), (True, (0, 16, 37))])
def test_backward_replays_the_forward_states_bit_for_bit(h0, cu):
    """chunk_bwd.replay_states, from what the forward saves, equals the state before every chunk that the
    forward's own pass held (its fp32 checkpoints at every chunk, in the saved terms' dtype), to the bit: the
    backward reads the same states it would have read had the forward kept them."""
    B = 2 if cu is None else 1
    q, k, v, g, beta = (x.reshape(B * 37, *x.shape[2:]).contiguous()
                        for x in make(B, 37, 2, 16, 12, torch.float32, seed=5))
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    lay = chunk_layout(B, 37 if cu is None else B * 37, cu_t, DEV)
    N = lay.n_seqs
    state = torch.randn(N, 2, 16, 12).to(DEV) if h0 else None
    chunks = -(-37 // chunk_fwd.CHUNK)
    slots = (torch.arange(chunks, dtype=torch.int32, device=DEV), chunks)
    _, _, saved, ckpt = chunk_fwd.chunk_kda_fwd(q, k, v, g, beta, 0.25, state, False, lay, True,
                                                chunk_fwd.gate_spec(-5.0), checkpoints=slots)
    h0_saved, pvs, _, _, KG, _, GC, *_ = saved
    hs = chunk_bwd.replay_states(h0_saved, pvs, KG, GC, lay, q.dtype)
    starts, offsets = lay.chunk_offsets.tolist(), lay.cu_seqlens.tolist()
    for n in range(N):
        for c in range(-(-(offsets[n + 1] - offsets[n]) // chunk_fwd.CHUNK)):
            assert torch.equal(hs[starts[n] + c], ckpt[c, n].to(hs.dtype)), (n, c)


def test_final_state_wider_than_v_takes_zero_values():
    """A state wider than v ([N,H,K,V+7]) evolves as if v were zero-padded: the full forward on [v | 0]."""
    q, k, v, g, beta = make(1, 40, 2, 16, 12, torch.float32, seed=40)
    cu = torch.tensor([0, 23, 40], dtype=torch.int32, device=DEV)
    state = torch.randn(2, 2, 16, 19).to(DEV)
    padded = torch.cat([v, torch.zeros_like(v[..., :7])], dim=-1)
    _, expected = kda_triton(q, k, padded, g, beta, initial_state=state, output_final_state=True, cu_seqlens=cu)
    got = kda_final_state_triton(k, v, g, beta, initial_state=state, cu_seqlens=cu)
    assert got.shape == (2, 2, 16, 19) and rel(got, expected) < 1e-6


def test_final_state_alone_rejects_gradients_and_narrow_states():
    q, k, v, g, beta = make(1, 5, 1, 16, 8, torch.float32)
    with pytest.raises(RuntimeError, match="not differentiable"):
        kda_final_state_triton(k, v.requires_grad_(), g, beta)
    with pytest.raises(ValueError, match="initial_state"):
        kda_final_state_triton(k, v.detach(), g, beta, initial_state=torch.zeros(1, 1, 16, 4))


def test_dispatch_and_no_grad():
    inputs = make(1, 17, 2, 16, 16, torch.float32, seed=9)
    with torch.no_grad():
        o, ht = kda(*inputs, backend="triton", output_final_state=True)
    ro, rht = kda_recurrent(*(x.double() for x in inputs), output_final_state=True)
    assert rel(o, ro) < 1e-4 and rel(ht, rht) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference_and_recurrence(dtype):
    N, H, K, V, P = 3, 2, 16, 32, 6
    slots = torch.tensor([4, -1, 1], dtype=torch.int32, device=DEV)
    pool = torch.randn(P, H, K, V, device=DEV)
    pool_ref = pool.clone()
    steps = make(N, 3, H, K, V, dtype, seed=11)
    for t in range(3):
        q, k, v, g, beta = (x[:, t] for x in steps)
        o = kda_decode(q, k, v, g, beta, pool, slots)
        o_ref = kda_decode_reference(q, k, v, g, beta, pool_ref, slots)
        assert rel(o, o_ref) < (1e-5 if dtype == torch.float32 else 8e-3)  # bf16 o: one rounding apart
        assert rel(pool, pool_ref) < 1e-5
        assert torch.equal(o[1], torch.zeros_like(o[1]))
    # three decode steps = the recurrence over three tokens from the pooled states
    live = [0, 2]
    h0 = torch.randn(P, H, K, V, device=DEV)
    pool = h0.clone()
    for t in range(3):
        kda_decode(*(x[:, t] for x in steps), pool, slots)
    ref_in = [x[live].double() for x in steps]
    _, rht = kda_recurrent(*ref_in, initial_state=h0[slots[live].long()].double(), output_final_state=True)
    assert rel(pool[slots[live].long()], rht) < 1e-5
    assert torch.equal(pool[[0, 2, 3, 5]], h0[[0, 2, 3, 5]])  # untouched slots


# T-token decode (speculative verification, SPEC-K3 §11) against T one-token launches: the same fp32 arithmetic in
# registers instead of through the pool, so fp32 values agree to SEQ_TOL; bf16 outputs to one bf16 rounding.
SEQ_TOL = {torch.float32: 1e-6, torch.bfloat16: 4e-3}
SENTINEL = 7.0  # padding rows of states_out must keep it


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_tokens_match_sequential_steps(T, dtype):
    """One launch over T tokens = T one-token launches: outputs, final pool, and snapshot t = the pool after t+1
    launches; a padding row gets zero outputs and no state writes."""
    N, H, K, V, P = 3, 2, 12, 70, 5  # V = 70: two V blocks, both masked
    slots = torch.tensor([3, -1, 0], dtype=torch.int32, device=DEV)
    pool = torch.randn(P, H, K, V, device=DEV)
    q, k, v, g, beta = make(N, T, H, K, V, dtype, seed=20 + T)
    step_pool, step_o, step_pools = pool.clone(), [], []
    for t in range(T):
        step_o.append(kda_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], step_pool, slots))
        step_pools.append(step_pool.clone())
    states = torch.full((N, T - 1, H, K, V), SENTINEL, device=DEV)
    o = kda_decode(q, k, v, g, beta, pool, slots, states_out=states)
    assert o.shape == v.shape and o.dtype == dtype
    assert rel(o, torch.stack(step_o, dim=1)) < SEQ_TOL[dtype] and rel(pool, step_pool) < SEQ_TOL[torch.float32]
    for t in range(T - 1):
        assert rel(states[[0, 2], t], step_pools[t][[3, 0]]) < SEQ_TOL[torch.float32]
    assert torch.equal(o[1], torch.zeros_like(o[1])) and (states[1] == SENTINEL).all()


@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_tokens_match_reference(save, dtype):
    N, T, H, K, V, P = 3, 3, 2, 12, 19, 6
    slots = torch.tensor([-1, 5, 2], dtype=torch.int32, device=DEV)
    pool = torch.randn(P, H, K, V, device=DEV)
    pool_ref = pool.clone()
    q, k, v, g, beta = make(N, T, H, K, V, dtype, gate="bound", beta_mode="high", seed=31)
    states, states_ref = (torch.full((N, T - 1, H, K, V), SENTINEL, device=DEV) if save else None for _ in "ab")
    o = kda_decode(q, k, v, g, beta, pool, slots, 0.3, states)
    o_ref = kda_decode_reference(q, k, v, g, beta, pool_ref, slots, 0.3, states_ref)
    assert rel(o, o_ref) < (1e-5 if dtype == torch.float32 else 8e-3) and rel(pool, pool_ref) < 1e-5
    assert torch.equal(pool[[0, 1, 3, 4]], pool_ref[[0, 1, 3, 4]])  # untouched slots
    if save:
        assert rel(states[1:], states_ref[1:]) < 1e-5 and (states[0] == SENTINEL).all()


@pytest.mark.parametrize("gate", ["k3", "kimi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.filterwarnings("error::RuntimeWarning")  # e.g. an exp overflowing under the Triton interpreter
def test_activations_match_reference(gate, dtype):
    """Fused l2norm / gate / beta sigmoid, forward and every gradient (A_log and dt_bias too); the gate's argument
    exp(A_log) (f + dt_bias) spans about [-100, 133] here, past where 1 / (1 + exp(-z)) overflows fp32 (-88.7)."""
    gen = torch.Generator().manual_seed(13)
    B, T, H, K = 2, 5, 3, 16
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=gen)).to(DEV)
    raw = [r(B, T, H, K).to(dtype), r(B, T, H, K).to(dtype), r(B, T, H, K, scale=3.0).to(dtype),
           r(B, T, H).to(dtype), torch.log(1 + 15 * torch.rand(H, generator=gen)).to(DEV), r(H, K, scale=0.3)]
    xs = [x.clone().requires_grad_() for x in raw]
    ys = [x.detach().double().requires_grad_() for x in raw]
    out, ref = kda_activations(*xs, gate=gate), kda_activations_reference(*ys, gate=gate)
    assert out[2].dtype == torch.float32 and (out[2] <= 0).all()
    if gate == "k3":
        assert (out[2] >= -5).all()
    grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(DEV) for o in ref]
    torch.autograd.backward(out, [g.to(o.dtype) for g, o in zip(grads, out)])
    torch.autograd.backward(ref, grads)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, b in zip(out, ref):
        assert rel(a, b) < tol
    for a, b in zip(xs, ys):
        assert rel(a.grad, b.grad) < tol


@pytest.mark.parametrize("gate,dtype,cu", [("k3", torch.float32, None), ("kimi", torch.float32, [0, 7, 40]),
                                           ("k3", torch.bfloat16, [0, 21, 40])])
def test_fused_activations_match_composition(gate, dtype, cu):
    """kda_triton_fused on raw inputs = the fp64 recurrence on the reference activations: outputs, final state and
    the gradients of every raw input (A_log, dt_bias and the initial state too)."""
    gen = torch.Generator().manual_seed(17)
    B, T, H, K, V = (1 if cu else 2), 40, 2, 16, 32
    r = lambda *s, scale=1.0: scale * torch.randn(*s, generator=gen)
    raw = [r(B, T, H, K, scale=3.0), r(B, T, H, K), r(B, T, H, V), r(B, T, H, K, scale=2.0), r(B, T, H)]
    raw = [x.to(dtype).to(DEV) for x in raw]
    params = [torch.log(1 + 3 * torch.rand(H, generator=gen)).to(DEV), r(H, K, scale=0.3).to(DEV)]
    h0 = r(len(cu) - 1 if cu else B, H, K, V).to(DEV)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    xs = [x.clone().requires_grad_() for x in raw + params + [h0]]
    ys = [x.detach().double().requires_grad_() for x in raw + params + [h0]]
    o, ht = kda_triton_fused(*xs[:7], gate=gate, initial_state=xs[7], output_final_state=True, cu_seqlens=cu_t)
    q, k, g, beta = kda_activations_reference(ys[0], ys[1], ys[3], ys[4], ys[5], ys[6], gate=gate)
    ro, rht = kda_recurrent(q, k, ys[2], g, beta, initial_state=ys[7], output_final_state=True, cu_seqlens=cu_t)
    do = torch.randn(ro.shape, generator=gen, dtype=torch.float64).to(DEV)
    dht = torch.randn(rht.shape, generator=gen, dtype=torch.float64).to(DEV)
    torch.autograd.backward([o, ht], [do.to(o.dtype), dht.float()])
    torch.autograd.backward([ro, rht], [do, dht])
    tol = TOL[dtype]
    assert rel(o, ro) < tol["o"] and rel(ht, rht) < tol["o"]
    for name, a, b in zip(["q", "k", "v", "f", "b", "A_log", "dt_bias", "h0"], xs, ys):
        assert a.grad.dtype == a.dtype and a.grad.shape == a.shape
        assert rel(a.grad, b.grad) < (tol["gate"] if name in ("f", "b", "A_log", "dt_bias") else tol["grad"]), name


def test_fused_rejects_unknown_gate():
    x = torch.zeros(1, 2, 1, 16, device=DEV)
    with pytest.raises(ValueError, match="gate must be one of"):
        kda_triton_fused(x, x, x, x, x[..., 0], x[0, 0, :, 0], x[0, 0], gate="softplus")


@pytest.mark.parametrize("bias", [True, False])
def test_conv_step_matches_reference(bias):
    N, D, W, P = 3, 40, 4, 5
    slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEV)
    x = torch.randn(N, D, device=DEV)
    state = torch.randn(P, D, W - 1, device=DEV)
    weight, b = torch.randn(D, W, device=DEV), (torch.randn(D, device=DEV) if bias else None)
    s1, s2 = state.clone(), state.clone()
    y1 = causal_conv_step(x, s1, weight, b, slots)
    y2 = causal_conv_step_reference(x, s2, weight, b, slots)
    assert rel(y1, y2) < 1e-6 and torch.equal(s1, s2)
    y3 = causal_conv_step(x[[0]], state[[2]].clone(), weight, b, activation=None)
    window = torch.cat([state[2], x[0, :, None]], dim=-1)
    ref = (window * weight).sum(-1) + (b if bias else 0)
    assert rel(y3[0], ref) < 1e-6


def conv_inputs(N, T, D, W, P, bias, x_dtype, state_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEV)
    return r(N, T, D).to(x_dtype), r(P, D, W - 1).to(state_dtype), r(D, W), (r(D) if bias else None)


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("bias,x_dtype,state_dtype", [(True, torch.float32, torch.float32),
                                                      (False, torch.bfloat16, torch.bfloat16),
                                                      (True, torch.float32, torch.bfloat16)])
def test_conv_tokens_match_sequential_steps(T, W, bias, x_dtype, state_dtype):
    """One launch over T tokens = T one-token launches: outputs, final windows (a bf16 window holds each token
    rounded, as the one-token pool does), window snapshots; a padding row is left alone."""
    N, D, P = 3, 150, 4  # D = 150: two channel blocks, the second masked
    slots = torch.tensor([1, -1, 3], dtype=torch.int32, device=DEV)
    x, state, weight, b = conv_inputs(N, T, D, W, P, bias, x_dtype, state_dtype, seed=40 + T + W)
    step_state, step_y, step_states = state.clone(), [], []
    for t in range(T):
        step_y.append(causal_conv_step(x[:, t], step_state, weight, b, slots))
        step_states.append(step_state.clone())
    snaps = torch.full((N, T - 1, D, W - 1), SENTINEL, dtype=state_dtype, device=DEV)
    y = causal_conv_step(x, state, weight, b, slots, states_out=snaps)
    assert y.shape == x.shape and y.dtype == x_dtype
    assert rel(y, torch.stack(step_y, dim=1)) < SEQ_TOL[x_dtype] and torch.equal(state, step_state)
    for t in range(T - 1):
        assert torch.equal(snaps[[0, 2], t], step_states[t][[1, 3]])
    assert torch.equal(y[1], torch.zeros_like(y[1])) and (snaps[1] == SENTINEL).all()


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("save", [True, False])
def test_conv_tokens_match_reference(W, bias, save):
    N, T, D, P = 3, 3, 40, 5
    slots = torch.tensor([4, 0, -1], dtype=torch.int32, device=DEV)
    x, state, weight, b = conv_inputs(N, T, D, W, P, bias, torch.float32, torch.float32, seed=50 + W)
    s1, s2 = state.clone(), state.clone()
    snaps, snaps_ref = (torch.full((N, T - 1, D, W - 1), SENTINEL, device=DEV) if save else None for _ in "ab")
    y1 = causal_conv_step(x, s1, weight, b, slots, "silu", snaps)
    y2 = causal_conv_step_reference(x, s2, weight, b, slots, "silu", snaps_ref)
    assert rel(y1, y2) < 1e-6 and torch.equal(s1, s2)
    if save:
        assert torch.equal(snaps, snaps_ref) and (snaps[2] == SENTINEL).all()
    y3 = causal_conv_step(x, state.clone()[:N], weight, b, activation=None)  # slots None: row n is state n
    y4 = causal_conv_step_reference(x, state.clone()[:N], weight, b, activation=None)
    assert rel(y3, y4) < 1e-6


@pytest.mark.parametrize("argument", ["states_out", "num_tokens"])
def test_optional_arguments_reject_wrong_shape_or_dtype(argument):
    N, T, H, K, V, D, W = 2, 3, 1, 8, 8, 8, 4
    slots = torch.arange(N, dtype=torch.int32, device=DEV)
    q, k, v, g, beta = make(N, T, H, K, V, torch.float32)
    pool = torch.zeros(N, H, K, V, device=DEV)
    x, conv, weight = torch.zeros(N, T, D, device=DEV), torch.zeros(N, D, W - 1, device=DEV), torch.ones(D, W)
    counts = (torch.ones(N + 1, dtype=torch.int32), torch.ones(N, 1, dtype=torch.int32), torch.ones(N))
    bad_kda = {"states_out": (torch.zeros(N, T, H, K, V), torch.zeros(N, T - 1, H, K, V, dtype=torch.bfloat16)),
               "num_tokens": counts}[argument]
    bad_conv = {"states_out": (torch.zeros(N, T - 1, D, W), torch.zeros(N, T - 1, D, W - 1, dtype=torch.float16)),
                "num_tokens": counts}[argument]
    for bad in bad_kda:
        with pytest.raises(ValueError, match=argument):
            kda_decode(q, k, v, g, beta, pool, slots, **{argument: bad.to(DEV)})
    for bad in bad_conv:
        with pytest.raises(ValueError, match=argument):
            causal_conv_step(x, conv, weight.to(DEV), **{argument: bad.to(DEV)})


@pytest.mark.parametrize("ragged", [False, True])
def test_multi_token_ops_compile_whole(ragged):
    """Both ops with T = 3 tokens and snapshots, all real or `ragged` (num_tokens): opcheck (the schemas declare
    every tensor they write, states_out included; the fake registrations match), and traced in one graph
    (fullgraph: no break) they give the eager values."""
    N, T, H, K, W, P = 3, 3, 2, 8, 4, 4
    D, V = 3 * H * K, K
    gen = torch.Generator().manual_seed(60)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEV)
    slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEV)
    n_real = torch.tensor([1, 3, 2], device=DEV) if ragged else None
    x, g, beta, weight = r(N, T, D), -torch.rand(N, T, H, K, generator=gen).to(DEV), r(N, T, H).sigmoid(), r(D, W)

    def verify(x, g, beta, conv, pool, conv_snaps, snaps):
        y = causal_conv_step(x, conv, weight, None, slots, states_out=conv_snaps, num_tokens=n_real)
        q, k, v = y.view(N, T, 3, H, K).unbind(2)
        return kda_decode(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, beta, pool, slots, states_out=snaps,
                          num_tokens=n_real)

    buffers = [r(P, D, W - 1), r(P, H, K, V), torch.zeros(N, T - 1, D, W - 1, device=DEV),
               torch.zeros(N, T - 1, H, K, V, device=DEV)]
    q, k, v = (F.normalize(r(N, T, H, K), dim=-1) for _ in range(3))
    torch.library.opcheck(decode_ops._kda_decode_op, (q, k, v, g, beta, buffers[1].clone(), slots, None,
                                                      buffers[3].clone(), n_real))
    torch.library.opcheck(decode_ops._causal_conv_step_op, (x, buffers[0].clone(), weight, None, slots, "silu",
                                                            buffers[2].clone(), n_real))
    eager = [b.clone() for b in buffers]
    o = torch.compile(verify, fullgraph=True, backend="aot_eager")(x, g, beta, *buffers)
    o_ref = verify(x, g, beta, *eager)
    assert rel(o, o_ref) < 1e-6
    for a, b in zip(buffers, eager):
        assert rel(a, b) < 1e-6



# Rows of one launch with different numbers of real tokens, each padded at its end (short prefill chunks in one
# static step): row 0 has three real tokens, row 1 one, row 2 is a padding slot, row 3 has none, row 4 all T = 4.
RAGGED_SLOTS, RAGGED_TOKENS = [3, 1, -1, 0, 5], [3, 1, 2, 0, 4]


def ragged_rows():
    slots = torch.tensor(RAGGED_SLOTS, dtype=torch.int32, device=DEV)
    num_tokens = torch.tensor(RAGGED_TOKENS, device=DEV)  # int64: the ops take any integer dtype
    real = (torch.arange(4, device=DEV) < num_tokens[:, None]) & (slots[:, None] >= 0)  # [N,T] real tokens
    return slots, num_tokens, real


def nan_padding(real, *xs):
    """xs [N,T,...] with NaN at the padding tokens: what padding holds must not matter."""
    return [x.masked_fill(~real.view(*real.shape, *[1] * (x.dim() - 2)), float("nan")) for x in xs]


def own_steps(step, state, slots, num_tokens, T):
    """Each row's own number of one-token calls: step(t, slots_t, state) for t < T, token t's slot -1 (padding) in
    the rows where it is not real. Returns the outputs [N,T,...] and the state after each token."""
    outs, after = [], []
    for t in range(T):
        outs.append(step(t, torch.where(t < num_tokens, slots, -1), state))
        after.append(state.clone())
    return torch.stack(outs, dim=1), after


def same_state(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise under the interpreter; on a GPU within fp32 rounding (its compiler may contract the T-step loop
    otherwise than the one-token kernel, as the full-T tests allow)."""
    return torch.equal(a, b) if DEV == "cpu" else rel(a, b) < SEQ_TOL[torch.float32]


def check_ragged(y, step_y, snaps, step_after, slots, num_tokens, real, y_tol):
    """Outputs of real tokens as the one-token calls give them, padded ones exactly zero; snapshot t of row n (t <
    num_tokens[n] - 1) = row n's state after t + 1 tokens; a padding slot's snapshots untouched."""
    assert rel(y[real], step_y[real]) < y_tol and torch.equal(y[~real], torch.zeros_like(y[~real]))
    for n, slot in enumerate(slots.tolist()):
        for t in range(int(num_tokens[n]) - 1 if slot >= 0 else 0):
            assert same_state(snaps[n, t], step_after[t][slot]), (n, t)
    assert (snaps[slots < 0] == SENTINEL).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_num_tokens_match_own_steps(dtype):
    """num_tokens: each row's pool state after the launch is (to the bit on CPU) what its own number of one-token calls
    leaves (a row of zero tokens: untouched); real outputs as theirs, padded outputs zero; snapshots as far as
    they are specified; all whatever the padding tokens hold (NaN here)."""
    N, T, H, K, V, P = 5, 4, 2, 12, 70, 6  # V = 70: two V blocks, both masked
    slots, num_tokens, real = ragged_rows()
    pool = torch.randn(P, H, K, V, device=DEV)
    q, k, v, g, beta = nan_padding(real, *make(N, T, H, K, V, dtype, seed=70))
    step_pool = pool.clone()
    step_o, after = own_steps(lambda t, sl, pl: kda_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], pl, sl),
                              step_pool, slots, num_tokens, T)
    snaps = torch.full((N, T - 1, H, K, V), SENTINEL, device=DEV)
    o = kda_decode(q, k, v, g, beta, pool, slots, None, snaps, num_tokens)
    assert same_state(pool, step_pool)
    check_ragged(o, step_o, snaps, after, slots, num_tokens, real, SEQ_TOL[dtype])


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("bias,dtype", [(True, torch.float32), (False, torch.bfloat16)])
def test_conv_num_tokens_match_own_steps(W, bias, dtype):
    """As for kda_decode: the final window is the one after the row's real tokens (with W = 4 and 1 or 3 of them:
    old taps and new tokens mixed), to the bit."""
    N, T, D, P = 5, 4, 150, 6  # D = 150: two channel blocks, the second masked
    slots, num_tokens, real = ragged_rows()
    x, state, weight, b = conv_inputs(N, T, D, W, P, bias, dtype, dtype, seed=80 + W)
    x, = nan_padding(real, x)
    step_state = state.clone()
    step_y, after = own_steps(lambda t, sl, st: causal_conv_step(x[:, t], st, weight, b, sl), step_state, slots,
                              num_tokens, T)
    snaps = torch.full((N, T - 1, D, W - 1), SENTINEL, dtype=dtype, device=DEV)
    y = causal_conv_step(x, state, weight, b, slots, "silu", snaps, num_tokens)
    assert same_state(state.float(), step_state.float())
    check_ragged(y, step_y, snaps, after, slots, num_tokens, real, SEQ_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_num_tokens_match_reference(dtype):
    """Both kernels with num_tokens (int32 here) against their references: outputs, pools, snapshots of real
    tokens; the conv with W = 3 and fp32 windows."""
    N, T, H, K, V, D, W, P = 5, 4, 2, 12, 19, 40, 3, 6
    out_tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16 outputs: one rounding apart
    slots, num_tokens, real = ragged_rows()
    num_tokens = num_tokens.to(torch.int32)
    pool = torch.randn(P, H, K, V, device=DEV)
    pool_ref = pool.clone()
    q, k, v, g, beta = nan_padding(real, *make(N, T, H, K, V, dtype, gate="bound", beta_mode="high", seed=90))
    snaps, snaps_ref = (torch.full((N, T - 1, H, K, V), SENTINEL, device=DEV) for _ in "ab")
    o = kda_decode(q, k, v, g, beta, pool, slots, 0.3, snaps, num_tokens)
    o_ref = kda_decode_reference(q, k, v, g, beta, pool_ref, slots, 0.3, snaps_ref, num_tokens)
    assert rel(o, o_ref) < out_tol and rel(pool, pool_ref) < 1e-5
    assert torch.equal(o[~real], torch.zeros_like(o[~real])) and torch.equal(o_ref[~real], o[~real])
    specified = real[:, 1:]  # snapshot t is specified where token t + 1 is real
    assert rel(snaps[specified], snaps_ref[specified]) < 1e-5
    x, state, weight, b = conv_inputs(N, T, D, W, P, True, dtype, torch.float32, seed=91)
    x, = nan_padding(real, x)
    s1, s2 = state.clone(), state.clone()
    conv_snaps, conv_snaps_ref = (torch.full((N, T - 1, D, W - 1), SENTINEL, device=DEV) for _ in "ab")
    y1 = causal_conv_step(x, s1, weight, b, slots, "silu", conv_snaps, num_tokens)
    y2 = causal_conv_step_reference(x, s2, weight, b, slots, "silu", conv_snaps_ref, num_tokens)
    assert rel(y1, y2) < out_tol and torch.equal(s1, s2)
    assert torch.equal(conv_snaps[specified], conv_snaps_ref[specified])


