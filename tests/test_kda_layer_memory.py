"""What the KDA layer keeps for backward under bf16 autocast: one shared copy of its input for its six projections
(the values and gradients of separate casts), against the layer as it was."""

import pytest
import torch

import openk3.model.kda as model_kda
from openk3.config import get_preset
from openk3.model import KimiDeltaAttention
from saved_tensors import saved_storages


def _run(layer, x, dy):
    """Forward under CPU bf16 autocast, backward: (y, dx, parameter grads, the bf16 storages of x's size kept)."""
    layer.zero_grad()
    leaf = x.clone().requires_grad_()
    out = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = saved_storages(lambda t: out.append(layer(t * 1.0)), leaf, exclude=list(layer.parameters()))
    out[0].backward(dy.to(out[0].dtype))
    copies = [n for dtype, _, n in kept if dtype == torch.bfloat16 and n == 2 * x.numel()]
    return out[0].detach(), leaf.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}, len(copies)


@pytest.mark.parametrize("output_gate", ["full", "lowrank"])
def test_kda_layer_shares_one_copy_of_its_input(monkeypatch, output_gate):
    """k3-tiny's KDA layer (full and low-rank output gate): the output identical to the bit with one cast per
    projection, the gradients of the input and every parameter equal to fp32 rounding (the shared copy's
    gradients are summed in fp32 in another order), and one [B,T,D] bf16 copy of the input kept where there were
    six (q, k, v, forget gate, beta, output gate): five fewer bf16 storages of x's size."""
    cfg = get_preset("k3-tiny").with_overrides({"kda": {"output_gate": output_gate}})
    torch.manual_seed(0)
    layer = KimiDeltaAttention(cfg, 0)
    x = torch.randn(2, 11, cfg.hidden_size) * 3
    dy = torch.randn(2, 11, cfg.hidden_size)
    shared = _run(layer, x, dy)
    monkeypatch.setattr(model_kda, "shared_cast", lambda t, n: (t,) * n)
    separate = _run(layer, x, dy)
    assert torch.equal(shared[0], separate[0]) and separate[3] - shared[3] == 5
    torch.testing.assert_close(shared[1], separate[1], rtol=1e-5, atol=1e-6)
    for name in separate[2]:
        torch.testing.assert_close(shared[2][name], separate[2][name], rtol=1e-5, atol=1e-6, msg=name)
