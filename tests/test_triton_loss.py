"""The cross-entropy rows kernel (`ops.triton_loss`) against its PyTorch form (`ops.loss.rows_reference`), and
`linear_cross_entropy` with the kernel taking the rows against `cross_entropy_reference`: vocabulary sizes below,
at and across the kernel's block, ignored rows, both reductions, bf16 and fp32 logits, large logits and a row of
ties. On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py), its outputs poisoned with NaN."""

from __future__ import annotations

import pytest
import torch

from openk3.ops import loss as loss_ops
from openk3.ops import triton_loss
from openk3.ops.loss import cross_entropy_reference, linear_cross_entropy, rows_reference
from test_ops_fused import DEV, _Poisoned

# the interpreter's numpy warns where a tail block's masked lanes (-inf) meet a row's running maximum (-inf)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(triton_loss, "torch", _Poisoned())


def logit_rows(rows: int, V: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=gen) * torch.tensor([0.5, 4.0, 30.0])[torch.arange(rows) % 3].unsqueeze(1)
    x[0] = 1.25  # all ties
    if rows > 4:
        x[4] += 3e4  # far from zero: exp only after the max is taken out
    return x


@pytest.mark.parametrize("V", [1, 5, 2048, 2048 + 77, 3 * 2048 + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("write_grad", [True, False])
def test_kernel_rows_match_the_reference(V, dtype, write_grad):
    rows = 7
    x = logit_rows(rows, V, seed=V).to(dtype)
    targets = torch.randint(0, V, (rows,), generator=torch.Generator().manual_seed(1))
    targets[2] = -100  # ignored
    scale = torch.tensor(1 / 6)
    ref_loss, ref_grad = rows_reference(x.clone(), targets, scale, -100, write_grad, torch.float32)
    logits = x.to(DEV)
    got_loss = triton_loss.ce_rows_triton(logits, targets.to(DEV), scale.to(DEV), -100, write_grad)
    torch.testing.assert_close(got_loss.cpu(), ref_loss, rtol=1e-5, atol=1e-5)
    assert got_loss[2] == 0
    if write_grad:
        tol = 1e-6 if dtype == torch.float32 else 4e-3
        torch.testing.assert_close(logits.cpu().float(), ref_grad.float(), rtol=tol, atol=tol)
        assert torch.all(logits[2] == 0)
    else:
        assert torch.equal(logits.cpu(), x)  # read only


def test_kernel_needs_unit_stride():
    x = torch.randn(8, 4).to(DEV)
    with pytest.raises(ValueError, match="unit stride"):
        triton_loss.ce_rows_triton(x.t(), torch.zeros(4, dtype=torch.long, device=DEV), torch.tensor(1.0, device=DEV),
                                   -100, True)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [None, 6])
def test_linear_cross_entropy_on_the_kernel(monkeypatch, reduction, chunk):
    """The whole loss with the kernel taking every chunk's rows (fp32, as `use_triton` picks it on a GPU): loss and
    both gradients equal the plain computation's; the weight gradient accumulates across chunks in fp32."""
    monkeypatch.setattr(loss_ops, "use_triton", lambda t, compiled=False: True)
    gen = torch.Generator().manual_seed(3)
    n, v, d = 23, 2048 + 9, 16
    hidden = torch.randn(n, d, generator=gen).to(DEV).requires_grad_()
    weight = (torch.randn(v, d, generator=gen) * 0.5).to(DEV).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen).to(DEV)
    targets[5] = -100

    def run(fn, **kw):
        value = fn(hidden, weight, targets, reduction=reduction, **kw)
        return (value.detach(), *torch.autograd.grad(value, (hidden, weight)))

    got = run(linear_cross_entropy, chunk=chunk)
    ref = run(cross_entropy_reference)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


def test_default_chunk_holds_the_same_bytes_of_logits(monkeypatch):
    """CHUNK_LOGITS_BYTES of logits per chunk: fp32 copies in the PyTorch form, the matmul's dtype on the kernel."""
    x = torch.zeros(1)
    tokens = loss_ops.CHUNK_LOGITS_BYTES // (32768 * 4)  # fp32 logits of a 32k vocabulary
    assert tokens > 1 and loss_ops.default_chunk(x, 32768, torch.bfloat16) == tokens  # CPU: fp32 copies
    monkeypatch.setattr(loss_ops, "use_triton", lambda t, compiled=False: True)
    assert loss_ops.default_chunk(x, 32768, torch.bfloat16) == 2 * tokens
    assert loss_ops.default_chunk(x, 32768, torch.float32) == tokens
    assert loss_ops.default_chunk(x, 10**9, torch.float32) == 1
