"""The fused fp32 islands (SiTU-GLU, RMSNorm + residual, RMSNorm + sigmoid gate) in Triton against their PyTorch
references, forward and backward; on CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py). Buffers the
kernels allocate are NaN-poisoned, so an element a kernel forgets to write fails the comparison."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("without CUDA the Triton kernels run only under TRITON_INTERPRET=1 (set by tests/conftest.py)")

from openk3.model.common import RMSNorm  # noqa: E402
from openk3.ops import triton_glu, triton_norm  # noqa: E402
from openk3.ops.activations import glu_activation, situ_glu  # noqa: E402
from openk3.ops.norms import add_rms_norm, gated_rms_norm, rms_norm  # noqa: E402
from saved_tensors import saved_storages  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's sigmoid overflows exp(-x) to inf for x = -1e4 on the way to the right answer, 0
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


class _Poisoned:
    """`torch` as the kernel modules see it, with empty() filled with NaN (floats) or -1 (integers)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *a, **kw):
        t = torch.empty(*a, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else -1)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    for mod in (triton_glu, triton_norm):
        monkeypatch.setattr(mod, "torch", _Poisoned())


def grads(fn, inputs, dys):
    """Outputs of fn and the gradients of its inputs for output cotangents dys, all in fp64 for comparing."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, dys)
    return [o.detach().double() for o in outs] + [t.grad.double() for t in leaves]


def assert_close_rel(got, want, tol):
    for a, b in zip(got, want):
        assert torch.isfinite(a).all(), "non-finite values (an unwritten element?)"
        err = (a - b).norm() / b.norm().clamp_min(1e-30)
        assert err <= tol, float(err)


def gate_up_values(rows, cols, seed):
    """Gate/up values over many scales, with exact zeros and saturating extremes (|x| up to 1e4)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, cols)
    x[0, : cols // 2] = 0.0
    x[-1, ::3] = 1e4
    x[-1, 1::3] = -1e4
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(5, 37), (3, 1100)])
def test_situ_glu_triton_matches_reference(dtype, rows, cols):
    """Split (dense FFN) and packed (experts) entry points: outputs and gradients against the fp64 reference,
    widths not a power of two and wider than one program's block."""
    gate, up = gate_up_values(rows, cols, 0), gate_up_values(rows, cols, 1).flip(0)
    g = torch.Generator().manual_seed(2)
    dy = torch.randn(rows, cols, generator=g)
    ref = grads(lambda a, b: situ_glu(a, b, 4.0, 25.0), [gate.double(), up.double()], [dy.double()])
    cast = lambda t: t.to(device=DEV, dtype=dtype)
    split = grads(triton_glu.situ_glu_triton, [cast(gate), cast(up)], [cast(dy)])
    packed = grads(triton_glu.situ_glu_packed_triton, [torch.cat([cast(gate), cast(up)], -1)], [cast(dy)])
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    # the reference in fp64 on the values the kernel actually saw (bf16-rounded inputs)
    if dtype == torch.bfloat16:
        ref = grads(lambda a, b: situ_glu(a, b, 4.0, 25.0), [cast(gate).double().cpu(), cast(up).double().cpu()],
                    [cast(dy).double().cpu()])
    assert_close_rel([t.cpu() for t in split], ref, tol)
    out, dh = packed
    assert torch.equal(out, split[0]) and torch.equal(dh, torch.cat(split[1:], -1))
    assert out.abs().max() <= 100.0


def test_situ_glu_triton_3d_and_views():
    """[B,T,2I] inputs, and gate/up given as strided halves of one tensor (as the dense FFN never does, but may)."""
    h = gate_up_values(6, 2 * 19, 3).view(2, 3, 38).to(DEV)
    out = triton_glu.situ_glu_triton(h[..., :19], h[..., 19:])
    assert out.shape == (2, 3, 19) and out.is_contiguous()
    torch.testing.assert_close(out.cpu(), situ_glu(h[..., :19].cpu(), h[..., 19:].cpu()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(triton_glu.situ_glu_packed_triton(h), out)


def test_glu_activation_on_cpu_is_the_reference():
    act = glu_activation("situ", 3.0, 20.0)
    gate, up = gate_up_values(4, 10, 4), gate_up_values(4, 10, 5)
    assert torch.equal(act(gate, up), situ_glu(gate, up, 3.0, 20.0))
    assert torch.equal(act.packed(torch.cat([gate, up], -1)), situ_glu(gate, up, 3.0, 20.0))
    with pytest.raises(ValueError, match="activation"):
        glu_activation("gelu")


def norm_rows(rows, cols, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-2, 3, rows).unsqueeze(-1)
    x[1] = 0.0  # a zero row: rstd = 1/sqrt(eps)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_triton_matches_reference(dtype, monkeypatch):
    """Outputs and the gradients of x and the weight (fp32 math, x's dtype out) against rms_norm in fp64, with rows
    from 1e-2 to 1e3 in scale, a zero row, D not a power of two, and backward programs that each walk several rows
    (the last one partly past the end)."""
    monkeypatch.setattr(triton_norm, "MAX_BWD_PROGRAMS", 4)
    rows, D = 13, 45
    x = norm_rows(rows, D, 0, dtype).view(1, rows, D)
    w = torch.rand(D, generator=torch.Generator().manual_seed(1)) + 0.5
    dy = torch.randn(1, rows, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = grads(lambda a, b: triton_norm.rms_norm_triton(a, b, 1e-5), [x.to(DEV), w.to(DEV)], [dy.to(DEV)])
    ref = grads(lambda a, b: rms_norm(a, b, 1e-5), [x.double(), w.double()], [dy.double()])
    assert_close_rel([t.cpu() for t in got], ref, 1e-5 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.bfloat16, torch.bfloat16)])
def test_add_rms_norm_triton_matches_reference(dtypes):
    """(norm(x + r), x + r) with both outputs used downstream: values and the gradients of x, r (each in its own
    dtype) and the weight, against add_rms_norm; mixed dtypes promote like the PyTorch add."""
    rows, D = 9, 70
    x, r = norm_rows(rows, D, 3, dtypes[0]), norm_rows(rows, D, 4, dtypes[1]).flip(0)
    w = torch.rand(D, generator=torch.Generator().manual_seed(5)) + 0.5
    s_dtype = torch.result_type(x, r)
    dy, ds = (torch.randn(rows, D, generator=torch.Generator().manual_seed(s)).to(s_dtype) for s in (6, 7))
    fused = lambda a, b, c: triton_norm.add_rms_norm_triton(a, b, c, 1e-5)
    got = grads(fused, [x.to(DEV), r.to(DEV), w.to(DEV)], [dy.to(DEV), ds.to(DEV)])
    want = grads(lambda a, b, c: add_rms_norm(a, b, c, 1e-5), [x, r, w], [dy, ds])
    leaves = [t.detach().clone().requires_grad_() for t in (x, r)]
    y, s = triton_norm.add_rms_norm_triton(*[t.to(DEV) for t in leaves], w.to(DEV))
    assert y.dtype == s.dtype == s_dtype
    (y.float().sum() + s.float().sum()).backward()
    assert leaves[0].grad.dtype == dtypes[0] and leaves[1].grad.dtype == dtypes[1]
    if s_dtype == torch.float32:  # the sum itself: the same rounding as PyTorch's add (Triton's interpreter
        assert torch.equal(got[1].cpu(), want[1])  # truncates to bf16 where the GPU rounds to nearest)
    else:
        torch.testing.assert_close(got[1].cpu(), want[1], rtol=2**-7, atol=0)
    assert_close_rel([t.cpu() for t in got], want, 1e-5 if s_dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)])
def test_gated_rms_norm_triton_matches_reference(dtypes, monkeypatch):
    """RMSNorm(x) * sigmoid(z) (the KDA output's norm and gate): the output (x's dtype) and the gradients of x, z
    (each in its own dtype) and the weight against gated_rms_norm in fp64, with rows from 1e-2 to 1e3 in scale, a
    zero row, gate inputs at +-1e4 (sigmoid saturated) and 0, D not a power of two, backward programs that each
    walk several rows."""
    monkeypatch.setattr(triton_norm, "MAX_BWD_PROGRAMS", 4)
    rows, D = 11, 37
    x = norm_rows(rows, D, 10, dtypes[0]).view(rows, 1, D)
    z = gate_up_values(rows, D, 11).to(dtypes[1]).view(rows, 1, D)
    w = torch.rand(D, generator=torch.Generator().manual_seed(12)) + 0.5
    dy = torch.randn(rows, 1, D, generator=torch.Generator().manual_seed(13)).to(dtypes[0])
    fused = lambda a, b, c: triton_norm.gated_rms_norm_triton(a, b, c, 1e-5)
    got = grads(fused, [x.to(DEV), z.to(DEV), w.to(DEV)], [dy.to(DEV)])
    ref = grads(lambda a, b, c: gated_rms_norm(a, b, c, 1e-5), [x.double(), z.double(), w.double()], [dy.double()])
    assert_close_rel([t.cpu() for t in got], ref, 1e-5 if dtypes[0] == torch.float32 else 8e-3)
    leaves = [t.to(DEV).requires_grad_() for t in (x, z)]
    y = triton_norm.gated_rms_norm_triton(*leaves, w.to(DEV))
    y.float().sum().backward()
    assert (y.dtype, leaves[0].grad.dtype, leaves[1].grad.dtype) == (dtypes[0], *dtypes)
    with pytest.raises(ValueError, match="gate input z"):
        triton_norm.gated_rms_norm_triton(x, z[:, :, :-1], w)


def test_gated_rms_norm_triton_keeps_its_inputs_and_rstd():
    """Kept for backward: x and z as given (bf16) and rstd per row, where the reference's autograd graph keeps
    fp32 copies and products (at least four fp32 [rows, D] tensors)."""
    rows, D = 6, 16
    x, z = (torch.randn(rows, D, dtype=torch.bfloat16, device=DEV).requires_grad_() for _ in range(2))
    w = torch.ones(D, device=DEV, requires_grad=True)
    kept = saved_storages(triton_norm.gated_rms_norm_triton, x, z, w, exclude=[w])
    assert sorted((str(dtype), n) for dtype, _, n in kept) == sorted([("torch.bfloat16", 2 * rows * D)] * 2
                                                                     + [("torch.float32", 4 * rows)])
    kept_ref = saved_storages(gated_rms_norm, x, z, w, exclude=[w])
    assert sum(dtype == torch.float32 and n == 4 * rows * D for dtype, _, n in kept_ref) >= 4


def test_rms_norm_module_on_cpu_is_the_reference():
    norm = RMSNorm(12, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, r = norm_rows(5, 12, 8, torch.float32), norm_rows(5, 12, 9, torch.float32)
    assert torch.equal(norm(x), rms_norm(x, norm.weight, 1e-6))
    y, s = norm.add_forward(x, r)
    assert torch.equal(s, x + r) and torch.equal(y, rms_norm(x + r, norm.weight, 1e-6))
    with pytest.raises(ValueError, match="weight"):
        triton_norm.rms_norm_triton(x, torch.ones(5))
