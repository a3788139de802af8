"""The grouped GEMM's padded row layout in one Triton launch (`ops.triton_layout`) against `grouped_layout`'s
PyTorch form: offsets, each row's destination and each padded row's source, for empty experts first, in the
middle and last, no rows at all, one expert and a width that is not a power of two. On CPU the kernel runs under
TRITON_INTERPRET=1 (tests/conftest.py); the buffers it leaves to the kernel are filled with -1 first and `source`
is compared whole, so an element the kernel forgets to write fails."""

from __future__ import annotations

import pytest
import torch

from openk3.ops import moe as moe_ops
from openk3.ops import triton_layout
from test_ops_fused import DEV, _Poisoned


@pytest.mark.parametrize("counts", [[0, 3, 0, 5, 9, 0], [4], [0, 0, 0], [1] * 70, [17, 0, 2, 33, 0, 1, 8, 0, 0, 5]])
@pytest.mark.parametrize("align", [8, 16])
def test_layout_kernel_matches_reference(counts, align, monkeypatch):
    monkeypatch.setattr(triton_layout, "torch", _Poisoned())
    monkeypatch.setattr(triton_layout, "BLOCK_R", 16)  # several programs for the larger cases
    counts = torch.tensor(counts)
    M = int(counts.sum())
    want = moe_ops.grouped_layout(counts, M, align)  # CPU tensors: the PyTorch form
    offsets, dest, source = triton_layout.grouped_layout_triton(counts.to(DEV), M, align, want.capacity)
    assert offsets.dtype == torch.int32 and dest.dtype == source.dtype == torch.int64
    assert torch.equal(offsets.cpu(), want.offsets)
    assert torch.equal(dest.cpu(), want.dest)
    assert torch.equal(source.cpu(), want.source)
