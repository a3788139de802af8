"""The one-pass KDA forward (ops/kda/triton/one_pass.py), its chains forming every chunk term themselves or reading
the first pass from `prepare_pairs`, against the fp64 recurrence and the two-kernel forward it would replace:
outputs, final states and prefix-cache checkpoints, both gate modes, fused activations (K3's and Kimi Linear's
gates), varlen batches with boundaries mid-chunk, V split over blocks with a partial one, K not a power of two,
extreme gates and betas. On CPU under TRITON_INTERPRET=1 (tests/conftest.py), small shapes."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.kda import kda_recurrent
from openk3.ops.kda.triton import chunk_fwd, one_pass
from openk3.ops.kda.triton.activations import kda_activations_reference
from openk3.ops.kda.triton.chunk import checkpoint_slots
from openk3.ops.kda.triton.chunk_fwd import chunk_kda_fwd, gate_spec
from openk3.ops.kda.triton.layout import chunk_layout
from test_kda_triton import DEV, TOL, UNBOUNDED, _Poisoned, make, rel


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Every buffer the modules allocate starts as NaN: an element a kernel forgets fails the checks."""
    for module in (one_pass, chunk_fwd):
        monkeypatch.setattr(module, "torch", _Poisoned())


@pytest.fixture(params=[False, True], ids=["chains alone", "pair kernel"])
def pair_kernel(request):
    return request.param


def flat(*xs):
    return [x.reshape(-1, *x.shape[2:]).contiguous() for x in xs]


def run_both(q, k, v, g, beta, h0, cu, gate, pair_kernel, block_v=None, checkpoints=None, scale=None):
    """(one-pass, two-kernel) forwards on [B,T,H,*] inputs: each (o [B*T,H,V], final state, checkpoints)."""
    B, T, H, K = q.shape
    lay = chunk_layout(B, T, cu, DEV)
    scale = K**-0.5 if scale is None else scale
    args = (*flat(q, k, v, g), beta.reshape(B * T, H).contiguous(), scale, h0, True, lay)
    ours = one_pass.kda_one_pass_fwd(*args, gate, checkpoints, pair_kernel=pair_kernel, block_v=block_v)
    o, ht, _, ckpt = chunk_kda_fwd(*args, False, gate, checkpoints)
    return ours, (o, ht, ckpt)


def recurrence(q, k, v, g, beta, h0, cu):
    o, ht = kda_recurrent(*(x.double() for x in (q, k, v, g, beta)), initial_state=None if h0 is None else h0.double(),
                          output_final_state=True, cu_seqlens=cu)
    return o.reshape(-1, *o.shape[2:]), ht


@pytest.mark.parametrize("T, gate_min, h0, block_v, dtype", [(1, -5.0, True, None, torch.bfloat16),
                                                             (17, None, False, None, torch.float32),
                                                             (40, -5.0, False, 16, torch.bfloat16),
                                                             (33, None, True, 32, torch.float32)])
def test_one_pass_matches_recurrence_and_two_kernels(T, gate_min, h0, block_v, dtype, pair_kernel):
    """Dense batches in both gate modes (bounded: K3's floor; any gate: no floor), with and without an initial
    state, V = 48 in one block, three, or a full and a partial one."""
    B, H, K, V = 2, 2, 16, 48
    q, k, v, g, beta = make(B, T, H, K, V, dtype, seed=T)
    state = torch.randn(B, H, K, V).to(DEV) if h0 else None
    (o, ht, _), (o2, ht2, _) = run_both(q, k, v, g, beta, state, None, gate_spec(gate_min), pair_kernel, block_v)
    ro, rht = recurrence(q, k, v, g.clamp_min(gate_min or -1e30), beta, state, None)
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert rel(o, ro) < TOL[dtype]["o"] and rel(ht, rht) < TOL[dtype]["o"]
    assert rel(o, o2) < 1e-5 and rel(ht, ht2) < 1e-5


@pytest.mark.parametrize("gate_min", [None, -5.0])
def test_varlen_checkpoints_and_odd_k(gate_min, pair_kernel):
    """Sequences of 5, 1, 24 and 70 tokens in one flat batch (boundaries mid-chunk, a 1-token sequence), K = 24
    (a padded channel tile), initial states per sequence; then one sequence with prefix-cache checkpoints at
    chunk boundaries, equal to the two-kernel forward's."""
    q, k, v, g, beta = make(1, 100, 2, 24, 20, torch.float32, seed=11)
    cu = torch.tensor([0, 5, 6, 30, 100], dtype=torch.int32, device=DEV)
    state = torch.randn(4, 2, 24, 20).to(DEV)
    (o, ht, _), _ = run_both(q, k, v, g, beta, state, cu, gate_spec(gate_min), pair_kernel)
    ro, rht = recurrence(q, k, v, g.clamp_min(gate_min or -1e30), beta, state, cu)
    assert rel(o, ro) < 1e-4 and rel(ht, rht) < 1e-4

    slots = checkpoint_slots((16, 48, 64, 100), 100, DEV)
    (o, ht, ckpt), (o2, ht2, ckpt2) = run_both(q, k, v, g, beta, state[:1], None, gate_spec(gate_min), pair_kernel,
                                                 16, slots)
    assert ckpt.shape == (3, 1, 2, 24, 20) and rel(ckpt, ckpt2) < 1e-5 and rel(o, o2) < 1e-5
    for n, t in enumerate((16, 48, 64)):  # the state after t tokens, from the recurrence over them alone
        _, expected = recurrence(*(x[:, :t] for x in (q, k, v, g.clamp_min(gate_min or -1e30), beta)), state[:1],
                                 None)
        assert rel(ckpt[n], expected) < 1e-4


@pytest.mark.parametrize("gate, cu", [("k3", None), ("kimi", (0, 7, 40))])
def test_fused_activations(gate, cu, pair_kernel):
    """Raw q, k, gate and beta logits (the layer's projections): the same as the recurrence on the reference
    activations, K3's bounded gate and Kimi Linear's unbounded one."""
    gen = torch.Generator().manual_seed(5)
    B, T, H, K, V = (1 if cu else 2), 40, 2, 16, 16
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=gen)).to(DEV)
    q, k, f, b = r(B, T, H, K), r(B, T, H, K), r(B, T, H, K, scale=3.0), r(B, T, H)
    v = r(B, T, H, V)
    A_log, dt_bias = torch.log(1 + 15 * torch.rand(H, generator=gen)).to(DEV), r(H, K, scale=0.3)
    spec = gate_spec(None, A_log, dt_bias.reshape(-1).contiguous(), kimi=gate == "kimi", g_min=-5.0)
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    (o, ht, _), (o2, ht2, _) = run_both(q, k, v, f, b, None, cu, spec, pair_kernel)
    qa, ka, ga, ba = kda_activations_reference(q.double(), k.double(), f.double(), b.double(), A_log.double(),
                                               dt_bias.double(), gate=gate, g_min=-5.0)
    ro, rht = recurrence(qa, ka, v, ga, ba, None, cu)
    assert rel(o, ro) < 1e-4 and rel(ht, rht) < 1e-4
    assert rel(o, o2) < 1e-5 and rel(ht, ht2) < 1e-5


@pytest.mark.parametrize("name", ["-40", "spikes to -1e30"])
def test_unbounded_and_extreme_inputs(name, pair_kernel):
    """Without a floor, per-token decays far past the bounded mode's range stay exact; betas near 0 and 1 and gates
    at the floor with a declared bound too."""
    gen = torch.Generator().manual_seed(len(name))
    q, k, v, g, beta = make(1, 45, 2, 16, 16, torch.float32, seed=len(name))
    g = UNBOUNDED[name](lambda *s: torch.rand(*s, generator=gen), g.shape).to(DEV)
    cu = torch.tensor([0, 9, 30, 45], dtype=torch.int32, device=DEV)
    state = torch.randn(3, 2, 16, 16).to(DEV)
    (o, ht, _), _ = run_both(q, k, v, g, beta, state, cu, gate_spec(None), pair_kernel)
    ro, rht = recurrence(q, k, v, g, beta, state, cu)
    assert rel(o, ro) < 1e-4 and rel(ht, rht) < 1e-4
    for gate, beta_mode in (("bound", "high"), ("zero", "low")):
        q, k, v, g, beta = make(1, 40, 1, 32, 16, torch.float32, gate, beta_mode, seed=5)
        state = torch.randn(1, 1, 32, 16).to(DEV)
        (o, ht, _), _ = run_both(q, k, v, g, beta, state, None, gate_spec(-5.0), pair_kernel)
        ro, rht = recurrence(q, k, v, g, beta, state, None)
        assert rel(o, ro) < 1e-4 and rel(ht, rht) < 1e-4
