"""The KDA short conv + SiLU in Triton (`ops.triton_conv`) against the plain composition and the recomputing
`_ConvSiLU`, forward and the gradients of x, the kernel and the state; `causal_conv1d`'s choice between them; what
the Triton Function keeps for backward. On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), with
the buffers they allocate NaN-poisoned so an element a kernel forgets to write fails the comparison."""

from __future__ import annotations

import math

import pytest
import torch

import openk3.ops.conv as conv
from openk3.ops import triton_conv
from saved_tensors import saved_storages
from test_ops_fused import DEV, _Poisoned, assert_close_rel, grads

# the interpreter's sigmoid overflows exp(-x) to inf for large negative x on the way to the right answer, 0
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(triton_conv, "torch", _Poisoned())


def conv_inputs(B, T, C, W, scale, seed, with_state=True):
    """x [B,T,C], kernel [C,W], state [B,C,W-1] (or None) and dy, fresh random; x and the state at `scale` (1e3:
    SiLU saturated both ways), the kernel at O(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g) * scale
    w = torch.randn(C, W, generator=g)
    state = torch.randn(B, C, W - 1, generator=g) * scale if with_state else None
    return x, w, state, torch.randn(B, T, C, generator=g)


CASES = [  # (B, T, C, W, scale, with_state): T = 1, T < W-1, odd C (not a multiple of the tile), extreme values,
    # T a multiple of the (monkeypatched) tile with W = 3 (the dstate tile wider than W-1)
    (2, 1, 3, 4, 1.0, True), (1, 2, 70, 4, 1.0, True), (2, 5, 3, 2, 1.0, False), (1, 37, 70, 4, 1.0, True),
    (1, 37, 3, 4, 1.0, False), (2, 5, 70, 2, 1e3, True), (1, 37, 3, 4, 1e3, True), (2, 16, 33, 3, 1.0, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("B", "T", "C", "W", "scale", "with_state"), CASES)
def test_conv_silu_triton_matches_reference(B, T, C, W, scale, with_state, dtype, monkeypatch):
    """y and the gradients of x, the kernel and the state: against the plain composition in fp64 (autograd) on the
    operands the conv sees (rounded to the compute dtype), and against `_ConvSiLU` in the same dtypes. fp32: x,
    kernel and state fp32; bf16: as under autocast (x bf16 from the projections, fp32 kernel and state, the conv
    in bf16). Small tiles, so the time and channel tiles split: dx's and dw's shifted reads cross tile edges, and pass
1's programs take several time tiles each."""
    monkeypatch.setattr(triton_conv, "BLOCK_T", 8)
    monkeypatch.setattr(triton_conv, "BLOCK_C", 32)
    monkeypatch.setattr(triton_conv, "BWD_BLOCK_T", 8)
    monkeypatch.setattr(triton_conv, "BWD_BLOCK_C", 32)
    # pass 1: programs of 12 steps (rows rounded up to a whole number of tiles) over 4-step tiles: several tiles
    # a program, the last program short
    for name, value in [("BWD_G_BLOCK_T", 4), ("BWD_G_BLOCK_C", 32), ("BWD_G_ROWS", 10), ("BWD_G_WARPS", 1)]:
        monkeypatch.setattr(triton_conv, name, value)
    x, w, state, dy = conv_inputs(B, T, C, W, scale, seed=B * 1000 + T * 10 + W)
    x, dy = x.to(dtype), dy.to(dtype)
    leaves = [x, w] + ([state] if with_state else [])
    split = lambda args: (args[0], args[1], args[2] if with_state else None)  # noqa: E731

    got = grads(lambda *a: triton_conv.conv_silu_triton(*split(a), dtype), [t.to(DEV) for t in leaves], [dy.to(DEV)])
    got = [t.cpu() for t in got]
    as_seen = [t.to(dtype).double() for t in leaves]  # the operands as the conv rounds them
    ref = grads(lambda *a: conv.causal_conv1d_reference(*split(a))[0], as_seen, [dy.to(dtype).double()])
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6  # bf16: pre and y each rounded (the interpreter truncates)
    assert_close_rel(got, ref, tol)

    zeros = torch.zeros(B, C, W - 1)
    recompute = grads(lambda *a: conv._ConvSiLU.apply(a[0], a[1], a[2] if with_state else zeros, dtype), leaves,
                      [dy])
    assert_close_rel(got, recompute, tol)

    on_dev = [t.detach().to(DEV).requires_grad_() for t in leaves]
    y = triton_conv.conv_silu_triton(*split(on_dev), dtype)
    y.float().sum().backward()
    assert y.dtype == x.dtype
    assert all(t.grad.dtype == t.dtype for t in on_dev)


def test_conv_silu_triton_state_none_is_zeros():
    """No state: the same outputs and gradients (of x and the kernel) as an explicit zero state."""
    x, w, _, dy = conv_inputs(2, 6, 5, 4, 1.0, seed=7, with_state=False)
    zeros = torch.zeros(2, 5, 3)
    none = grads(lambda a, b: triton_conv.conv_silu_triton(a, b), [x.to(DEV), w.to(DEV)], [dy.to(DEV)])
    given = grads(lambda a, b: triton_conv.conv_silu_triton(a, b, zeros.to(DEV)), [x.to(DEV), w.to(DEV)],
                  [dy.to(DEV)])
    assert all(torch.equal(a, b) for a, b in zip(none, given))
    with pytest.raises(ValueError, match="state must be"):
        triton_conv.conv_silu_triton(x, w, zeros[..., :2])


@pytest.mark.parametrize("with_state", [False, True])
def test_causal_conv1d_picks_triton_where_use_triton_says(with_state, monkeypatch):
    """`causal_conv1d` runs the Triton Function when `use_triton` says yes (forced, for CPU tensors), with the
    same new state and the reference's values and gradients; `_ConvSiLU` otherwise."""
    B, T, C, W = 2, 5, 6, 4
    x, w, state, dy = (t if t is None else t.to(DEV) for t in conv_inputs(B, T, C, W, 1.0, seed=11,
                                                                          with_state=with_state))
    w = w.view(C, 1, W)  # nn.Conv1d's layout, as the model passes it
    leaves = [x, w] + ([state] if with_state else [])

    def run(*a):
        y, new_state = conv.causal_conv1d(a[0], a[1], a[2] if with_state else None)
        run.grad_fn = type(y.grad_fn).__name__
        return y, new_state

    ds = torch.randn(B, C, W - 1, device=DEV)
    monkeypatch.setattr(conv, "use_triton", lambda t: True)
    got = grads(run, leaves, [dy, ds])
    assert run.grad_fn == "_ConvSiLUTritonBackward"
    monkeypatch.setattr(conv, "use_triton", lambda t: False)
    want = grads(run, leaves, [dy, ds])
    assert run.grad_fn == "_ConvSiLUBackward"
    assert torch.equal(got[1], want[1])  # the new state: the same copy either way
    assert_close_rel(got, want, 1e-5)


@pytest.mark.parametrize("with_state", [False, True])
def test_conv_silu_triton_keeps_only_its_inputs(with_state, monkeypatch):
    """Under bf16 autocast, through `causal_conv1d` on the Triton path: x and the state as given (none when there
    is none), no copy of the conv's input or output (bench/activation_memory.py counts this Function)."""
    B, T, C, W = 2, 9, 6, 4
    x = torch.randn(B, T, C, dtype=torch.bfloat16, device=DEV).requires_grad_()
    w = torch.randn(C, 1, W, device=DEV, requires_grad=True)
    state = torch.randn(B, C, W - 1, device=DEV, requires_grad=True) if with_state else None
    monkeypatch.setattr(conv, "use_triton", lambda t: True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        kept = saved_storages(conv.causal_conv1d, x, w, state, exclude=[w])
    want = [(torch.bfloat16, (B, T, C), 2 * B * T * C)] + ([(torch.float32, (B, C, W - 1), 4 * B * C * (W - 1))]
                                                            if with_state else [])
    assert sorted(kept, key=str) == sorted(want, key=str)


@pytest.mark.parametrize(("B", "T", "C", "W", "with_state", "unused"), [
    (2, 5, 12, 4, True, None), (1, 21, 66, 4, False, None), (2, 16, 96, 3, True, 1),  # a group the loss ignores
])
def test_conv_silu_triton_groups_are_the_channel_thirds(B, T, C, W, with_state, unused, monkeypatch):
    """groups=3 (the KDA layer's q, k, v): three contiguous tensors equal to the bit to the thirds of the one-output
    form, and the gradients of x, the kernel and the state equal to the bit to those of the one-output form with
    the three gradients side by side (a third the loss does not use: its gradient is zeros), with small channel
    tiles that divide C / 3 = 4, 22, 32 (the width the grouped form narrows a tile to), in both forms: the same
    kernels but for their addresses (on a GPU other tile widths compile to other instruction orders)."""
    tile = math.gcd(32, C // 3)
    for name, value in [("BLOCK_T", 8), ("BLOCK_C", tile), ("BWD_G_BLOCK_T", 4), ("BWD_G_BLOCK_C", tile)]:
        monkeypatch.setattr(triton_conv, name, value)
    inputs = conv_inputs(B, T, C, W, 1.0, seed=C, with_state=with_state)
    x, w, state, dy = (t if t is None else t.to(DEV) for t in inputs)
    leaves = [x, w] + ([state] if with_state else [])
    G = C // 3
    dys = [dy[..., i * G:(i + 1) * G].contiguous() for i in range(3)]
    if unused is not None:
        dy = dy.clone()
        dy[..., unused * G:(unused + 1) * G] = 0

    def grouped(*a):
        ys = triton_conv.conv_silu_triton(a[0], a[1], a[2] if with_state else None, groups=3)
        assert all(y.is_contiguous() and y.shape == (B, T, G) for y in ys)
        return tuple(y for i, y in enumerate(ys) if i != unused)

    got = grads(grouped, leaves, [d for i, d in enumerate(dys) if i != unused])
    want = grads(lambda *a: triton_conv.conv_silu_triton(a[0], a[1], a[2] if with_state else None), leaves, [dy])
    n_out = 3 - (unused is not None)
    thirds = [want[0][..., i * G:(i + 1) * G] for i in range(3) if i != unused]
    assert all(torch.equal(a, b) for a, b in zip(got[:n_out], thirds))
    assert all(torch.equal(a, b) for a, b in zip(got[n_out:], want[1:]))
    with pytest.raises(ValueError, match="groups must be"):
        triton_conv.conv_silu_triton(x[..., :C - 1], w[:C - 1], groups=3)


@pytest.mark.parametrize(("T", "W", "groups"), [(37, 4, 1), (37, 4, 3), (16, 3, 1), (5, 2, 3)])
def test_conv_silu_triton_resets_at_document_starts(T, W, groups, monkeypatch):
    """With `starts` (packed documents), y and the gradients of x and the kernel equal the fp64 reference's masked
    sum (`ops.conv`), which equals each document alone (tests/test_packing.py): documents of 1, odd and more than
    a tile of tokens, boundaries inside and at the edges of the small tiles, extreme values."""
    for name, value in [("BLOCK_T", 8), ("BLOCK_C", 32), ("BWD_BLOCK_T", 8), ("BWD_BLOCK_C", 32),
                        ("BWD_G_BLOCK_T", 4), ("BWD_G_BLOCK_C", 32), ("BWD_G_ROWS", 10), ("BWD_G_WARPS", 1)]:
        monkeypatch.setattr(triton_conv, name, value)
    B, C = 2, 66
    x, w, _, dy = conv_inputs(B, T, C, W, 1e3 if T == 5 else 1.0, seed=T * W + groups, with_state=False)
    g = torch.Generator().manual_seed(T)
    cuts = [sorted({0, *torch.randint(1, T, (T // 4,), generator=g).tolist()}) for _ in range(B)]
    cuts[0] = sorted({0, 1, 2, 8, *cuts[0]} & set(range(T)))  # a one-token document, a start on a tile edge
    starts = torch.stack([torch.tensor([max(c for c in row if c <= t) for t in range(T)]) for row in cuts])

    def triton_fn(a, b):
        ys = triton_conv.conv_silu_triton(a, b, None, torch.float32, groups, starts=starts.to(DEV))
        return torch.cat(ys, -1) if groups == 3 else ys

    got = [t.cpu() for t in grads(triton_fn, [x.to(DEV), w.to(DEV)], [dy.to(DEV)])]
    ref = grads(lambda a, b: conv.causal_conv1d_reference(a, b, starts=starts)[0], [x.double(), w.double()],
                [dy.double()])
    assert_close_rel(got, ref, 1e-5)
    with pytest.raises(ValueError, match="without a state"):
        triton_conv.conv_silu_triton(x, w, torch.zeros(B, C, W - 1), starts=starts)


def test_causal_conv1d_passes_document_starts_to_the_triton_kernels(monkeypatch):
    """`causal_conv1d(..., starts=)` on the Triton path (forced for CPU tensors) == on `_ConvSiLU`: the q|k|v
    thirds, the gradients and the new state (the last document's inputs only)."""
    B, T, C, W = 2, 11, 6, 4
    x, w, _, dy = (t if t is None else t.to(DEV) for t in conv_inputs(B, T, C, W, 1.0, seed=5, with_state=False))
    starts = torch.tensor([[0, 0, 0, 3, 3, 3, 3, 3, 3, 9, 10], [0] * 6 + [6] * 5], device=DEV)
    dys = list(dy.split(C // 3, dim=-1))

    def run(a, b):
        ys, new_state = conv.causal_conv1d(a, b.view(C, 1, W), None, groups=3, starts=starts)
        run.grad_fn = type(ys[0].grad_fn).__name__
        return (*ys, new_state)

    ds = torch.randn(B, C, W - 1, device=DEV)
    monkeypatch.setattr(conv, "use_triton", lambda t: True)
    got = grads(run, [x, w], dys + [ds])
    assert run.grad_fn == "_ConvSiLUTritonBackward"
    monkeypatch.setattr(conv, "use_triton", lambda t: False)
    want = grads(run, [x, w], dys + [ds])
    assert run.grad_fn != "_ConvSiLUTritonBackward"  # views of _ConvSiLU's one output
    assert_close_rel(got, want, 1e-5)
