"""What the KDA layer keeps for backward under bf16 autocast: one shared copy of its input for its two products
(the values and gradients of separate casts), against the layer as it was; its output norm + gate through the
Triton Function (as on CUDA; here under TRITON_INTERPRET=1) against the reference."""

import pytest
import torch

import openk3.model.kda as model_kda
from openk3.config import get_preset
from openk3.model import KimiDeltaAttention
from saved_tensors import saved_storages


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: bf16 rounding of o before o_proj (the interpreter truncates where the GPU rounds) spreads
    over the elements of the output and the gradients."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _run(layer, x, dy):
    """Forward under CPU bf16 autocast, backward: (y, dx, parameter grads, the number of bf16 storages of x's size
    kept for backward, the bytes kept)."""
    layer.zero_grad()
    leaf = x.clone().requires_grad_()
    out = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = saved_storages(lambda t: out.append(layer(t * 1.0)), leaf, exclude=list(layer.parameters()))
    out[0].backward(dy.to(out[0].dtype))
    copies = [n for dtype, _, n in kept if dtype == torch.bfloat16 and n == 2 * x.numel()]
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return out[0].detach(), leaf.grad, grads, len(copies), sum(n for *_, n in kept)


@pytest.mark.parametrize("output_gate", ["full", "lowrank"])
def test_kda_layer_shares_one_copy_of_its_input(monkeypatch, output_gate):
    """k3-tiny's KDA layer (full and low-rank output gate): the output identical to the bit with one cast per
    projection, the gradients of the input and every parameter equal to fp32 rounding (the shared copy's
    gradients are summed in fp32 in another order), and one [B,T,D] bf16 copy of the input kept where there were
    two (q|k|v, and the gates' first matrices: forget gate, beta, output gate): one bf16 storage of x's size
    fewer."""
    cfg = get_preset("k3-tiny").with_overrides({"kda": {"output_gate": output_gate}})
    torch.manual_seed(0)
    layer = KimiDeltaAttention(cfg, 0)
    x = torch.randn(2, 11, cfg.hidden_size) * 3
    dy = torch.randn(2, 11, cfg.hidden_size)
    shared = _run(layer, x, dy)
    monkeypatch.setattr(model_kda, "shared_cast", lambda t, n: (t,) * n)
    separate = _run(layer, x, dy)
    assert torch.equal(shared[0], separate[0]) and separate[3] - shared[3] == 1
    torch.testing.assert_close(shared[1], separate[1], rtol=1e-5, atol=1e-6)
    for name in separate[2]:
        torch.testing.assert_close(shared[2][name], separate[2][name], rtol=1e-5, atol=1e-6, msg=name)


def test_kda_layer_output_through_triton_matches_reference(monkeypatch):
    """k3-tiny's KDA layer under CPU bf16 autocast with the output's norm + gate dispatched to the Triton Function
    (the CUDA rule forced on): output and gradients equal the reference path's to bf16 rounding (relative norm
    error < 1e-2), and it keeps fewer bytes for backward, at least the fp32 [B,T,H,V] copies and products the
    reference keeps (12 bytes per element of o more than the Function's bf16 o and gate input)."""
    cfg = get_preset("k3-tiny")
    torch.manual_seed(2)
    layer = KimiDeltaAttention(cfg, 0)
    with torch.no_grad():
        layer.o_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(1, 7, cfg.hidden_size) * 2
    dy = torch.randn(1, 7, cfg.hidden_size)
    reference = _run(layer, x, dy)
    monkeypatch.setattr(model_kda, "use_triton", lambda t: True)
    fused = _run(layer, x, dy)
    for name, got, want in [("y", fused[0], reference[0]), ("dx", fused[1], reference[1]),
                            *((n, fused[2][n], reference[2][n]) for n in reference[2])]:
        assert _rel(got, want) < 1e-2, name
    o_elements = x.shape[0] * x.shape[1] * layer.num_heads * layer.v_head_dim
    assert reference[4] - fused[4] >= 12 * o_elements
