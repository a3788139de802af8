"""train.distributed.clip_grad_norm against torch.nn.utils.clip_grad_norm_ (the reference)."""

import pytest
import torch
from torch import nn

from openk3.train.distributed import clip_grad_norm


def _model_with_grads(scale: float, seed: int) -> nn.Module:
    """Odd shapes, an fp32 and a bf16 group, one parameter without a gradient."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.ModuleList([nn.Linear(7, 5), nn.Linear(5, 3, bias=False), nn.Linear(3, 1)])
    model[1].to(torch.bfloat16)
    for p in list(model.parameters())[:-1]:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)
    return model


@pytest.mark.parametrize("scale,max_norm", [(3.0, 1.0), (1e-3, 1.0), (1e15, 0.5)])
@pytest.mark.parametrize("seed", range(2))
def test_clip_grad_norm_matches_torch(scale, max_norm, seed):
    ours, reference = _model_with_grads(scale, seed), _model_with_grads(scale, seed)
    norm = clip_grad_norm(ours, max_norm)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    assert norm.dtype == torch.float64 and norm.dim() == 0
    torch.testing.assert_close(norm.float(), want.float(), rtol=1e-5, atol=0)
    for p, q in zip(ours.parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-2 if p.dtype == torch.bfloat16 else 1e-5, atol=0)
