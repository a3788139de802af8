"""Muon's elementwise passes as two multi-tensor Triton launches (`ops.triton_muon`) against their PyTorch form:
momentum, Nesterov update into the block batch and the decayed update, for every block layout ("cols:H" reorders
the elements), sizes around the kernel's chunk, one-element tensors, fp32 and bf16 batches, addresses that are not
16-byte aligned and extreme magnitudes; and MuonAdamW's fused step against its PyTorch step over several steps.
On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from openk3.ops import triton_muon
from openk3.train import optim
from openk3.train.optim import BlockBatches, MuonAdamW, to_blocks
from test_ops_fused import DEV

BLOCK = triton_muon.BLOCK
# (shape, split): several heads of odd width, a tensor of exactly one chunk, one just past a chunk, one element
CASES = [((12, 10), "rows:3"), ((10, 12), "cols:4"), ((7, 3 * 5), "cols:3"), ((3, 5, 7), "experts"),
         ((1, 1), "whole"), ((BLOCK // 64, 64), "whole"), ((BLOCK // 32 + 1, 32), "cols:2"), ((9, 13), "whole")]


def _heads(split: str) -> int:
    return int(split.split(":")[1]) if split.startswith("cols:") else 1


def _tensors(seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(s, generator=g) * scale).to(DEV) for s, _ in CASES]
    bufs = [(torch.randn(s, generator=g) * scale).to(DEV) for s, _ in CASES]
    return grads, bufs


@pytest.mark.parametrize(("out_dtype", "scale"), [(torch.float32, 1.0), (torch.bfloat16, 1.0),
                                                  (torch.float32, 1e30), (torch.float32, 1e-30)])
def test_momentum_into_blocks_matches_torch(out_dtype, scale):
    grads, bufs = _tensors(3, scale)
    splits = [s for _, s in CASES]
    mus = [0.95, 0.5, 0.0, 0.9, 0.95, 0.99, 0.3, 0.95]
    want_bufs = [mu * b + g for g, b, mu in zip(grads, bufs, mus)]
    want = [to_blocks(g + mu * b, s).to(out_dtype) for g, b, mu, s in zip(grads, want_bufs, mus, splits)]
    # one batch, so that the parts sit at offsets that are not 16-byte aligned; NaN where nothing is written
    batches = BlockBatches([to_blocks(g, s).shape for g, s in zip(grads, splits)], [g.device for g in grads],
                           out_dtype)
    for part in batches.parts:
        part.fill_(float("nan"))
    triton_muon.momentum_into_blocks(grads, bufs, batches.parts, [_heads(s) for s in splits], mus)
    # absolute room for cancellation (g + mu b near 0), where a fused multiply-add rounds differently
    for got, expected in zip(bufs, want_bufs):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * scale)
    for got, expected in zip(batches.parts, want):
        torch.testing.assert_close(got, expected, rtol=1e-6 if out_dtype == torch.float32 else 8e-3,
                                   atol=1e-6 * scale)


@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16])
def test_apply_block_updates_matches_torch(update_dtype):
    params, updates = _tensors(5)
    splits = [s for _, s in CASES]
    blocks = [to_blocks(u, s).contiguous().to(update_dtype) for u, s in zip(updates, splits)]
    lrs = [0.02 * (i + 1) for i in range(len(CASES))]
    decays = [1.0 if i % 3 == 0 else 1 - 0.1 * lr for i, lr in enumerate(lrs)]
    want = []
    for p, b, s, lr, decay in zip(params, blocks, splits, lrs, decays):
        w = p.clone()
        to_blocks(w, s).mul_(decay).add_(b.float(), alpha=-lr)
        want.append(w)
    triton_muon.apply_block_updates(params, blocks, [_heads(s) for s in splits], lrs, decays)
    for got, expected in zip(params, want):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_supports_only_plain_contiguous_tensors_of_one_dtype():
    a, b = torch.randn(4, 6), torch.randn(6, 4)
    assert triton_muon.supports([a, b])
    assert not triton_muon.supports([a, b.t()])  # not contiguous
    assert not triton_muon.supports([a, b.double()])  # not one dtype (and float64 has no kernel)
    assert not triton_muon.supports([a.double(), b.double()])
    assert not triton_muon.supports([a.int(), b.int()])


def _model_like_params(seed: int):
    """Parameters and splits with the block layouts of k3's Muon groups (two groups share a block shape)."""
    g = torch.Generator().manual_seed(seed)
    specs = [((3, 16, 8), "experts"), ((2, 16, 8), "experts"), ((12, 8), "rows:3"), ((8, 12), "cols:3"),
             ((20, 7), "whole")]
    return [(nn.Parameter(torch.randn(s, generator=g).to(DEV)), split) for s, split in specs]


def _steps(fused: bool, steps: int = 3):
    params = _model_like_params(11)
    groups = [dict(params=[p], algorithm="muon", split=split, weight_decay=0.1 * (i % 2), lr=0.02 + 0.01 * i,
                   momentum=0.95 - 0.1 * (i % 2)) for i, (p, split) in enumerate(params)]
    opt = MuonAdamW(groups, lr=0.05, fused=fused)
    g = torch.Generator().manual_seed(12)
    for _ in range(steps):
        for p, _ in params:
            p.grad = torch.randn(p.shape, generator=g).to(DEV)
        opt.step()
    return [p.detach() for p, _ in params], [opt.state[p]["momentum_buffer"] for p, _ in params]


def test_fused_muon_step_matches_the_pytorch_step():
    got_params, got_bufs = _steps(True)
    want_params, want_bufs = _steps(False)
    for got, want in zip(got_params + got_bufs, want_params + want_bufs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("numel", [BLOCK - 1, BLOCK + 1, 2 * BLOCK - 3])
def test_writes_stay_inside_each_tensor(numel):
    """Each tensor is the front of a larger buffer whose tail holds a sentinel: neither launch may touch it."""
    sentinel = 7.0
    room = torch.full((4, numel + 64), sentinel, device=DEV)  # grad, momentum, update, parameter
    grad, buf, out, param = (row[:numel].view(1, numel) for row in room)
    for t in (grad, buf, param):
        t.normal_()
    triton_muon.momentum_into_blocks([grad], [buf], [out], [1], [0.9])
    torch.testing.assert_close(out, grad + 0.9 * buf)
    triton_muon.apply_block_updates([param], [out], [1], [0.1], [0.99])
    assert torch.equal(room[:, numel:], torch.full_like(room[:, numel:], sentinel))


def _one_step(fused, grad: torch.Tensor | None = None, device: str = DEV) -> None:
    p = nn.Parameter(torch.randn(6, 4, device=device))
    p.grad = torch.randn(6, 4, device=device) if grad is None else grad
    MuonAdamW([dict(params=[p], algorithm="muon", split="whole")], lr=0.1, fused=fused).step()


def test_fused_true_names_what_stops_it(monkeypatch):
    with pytest.raises(ValueError, match="not all plain contiguous"):
        _one_step(True, torch.randn(4, 6, device=DEV).t())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="on cpu, not on a CUDA device"):
        _one_step(True, device="cpu")
    _one_step(None, device="cpu")  # where the kernels cannot run, the default takes the PyTorch form
    cpu = [torch.randn(2, 2)]
    assert optim._fused_muon_blocker(cpu, cpu, cpu)
