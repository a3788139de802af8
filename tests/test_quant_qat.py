"""Quantization-aware training (openk3.quant.qat, `openk3 train --qat mxfp4`): the fake-quantized forward, the
straight-through gradients, a short QAT run on k3-tiny, and its checkpoints."""

from __future__ import annotations

import pytest
import torch

from openk3.cli import main
from openk3.interop import load_pretrained
from openk3.model.moe import Experts
from openk3.ops.moe import sigmoid_topk_routing
from openk3.quant import fake_quant_mxfp4, fake_quant_mxfp8
from openk3.quant.qat import FakeQuantExperts, enable_qat
from openk3.train.args import TrainArgs
from openk3.train.loop import Trainer
from random_weights import randomise
from test_interop_k3 import is_routed_expert, random_model, tiny_k3, with_quantized_experts
from train_tiny import make_corpus, one_thread, pytorch_muon, tiny_args


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_qat_forward_and_gradients_equal_the_model_on_quantized_weights():
    """Weights-only QAT: the logits are those of the plain model holding dequant(quant(W)), and every gradient,
    the master expert weights' included, is that model's gradient (w.r.t. the quantized weights): the STE."""
    cfg = tiny_k3()
    qat = random_model(cfg, seed=20).train()
    reference = with_quantized_experts(qat).train()
    assert enable_qat(qat, activations=False) == cfg.num_layers - cfg.first_k_dense + cfg.mtp_layers
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    got_logits, got = loss_and_grads(qat, ids)
    want_logits, want = loss_and_grads(reference, ids)
    assert torch.equal(got_logits, want_logits)
    assert got.keys() == want.keys()
    for name in want:  # (the MTP layer, not run here, has none)
        assert (got[name] is None) == (want[name] is None), name
        assert want[name] is None or torch.equal(got[name], want[name]), name
    masters = {n: p for n, p in qat.named_parameters() if is_routed_expert(n) and p.grad is not None}
    assert masters and all(not torch.equal(fake_quant_mxfp4(p), p) for p in masters.values())  # not on the grid


def test_qat_experts_equal_a_per_token_reference_with_mxfp8_activations():
    """The whole fake-quantized expert computation, written token by token: MXFP8 input, MXFP4 weights, MXFP8
    GLU output, combined with the routing weights (fp64, so only the summation order differs)."""
    cfg = tiny_k3()
    experts = Experts(cfg, cfg.moe.latent_dim).double()
    randomise(experts, seed=21)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, cfg.moe.latent_dim, dtype=torch.float64, generator=g)
    routing = sigmoid_topk_routing(torch.randn(9, cfg.moe.num_experts, dtype=torch.float64, generator=g), None,
                                   cfg.moe.top_k)
    plain = experts(x, routing)
    enable_qat(experts)
    assert isinstance(experts, FakeQuantExperts)
    got = experts(x, routing)

    gate_up = fake_quant_mxfp4(experts._parameters["gate_up_proj"].detach())
    down = fake_quant_mxfp4(experts._parameters["down_proj"].detach())
    want = torch.zeros_like(x)
    for n in range(len(x)):
        for weight, e in zip(routing.weights[n], routing.indices[n]):
            gate, up = (fake_quant_mxfp8(x[n]) @ gate_up[e].T).chunk(2)
            want[n] += weight * (fake_quant_mxfp8(experts.act.act(gate, up)) @ down[e].T)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (got - plain).abs().max() > 1e-3  # the quantization is really applied


def test_qat_flag_and_what_qat_refuses(monkeypatch):
    seen = []
    monkeypatch.setattr("openk3.train.command.train", seen.append)
    assert main(["train", "--qat", "mxfp4", "--no-progress"]) == 0 and seen[0].qat == "mxfp4"
    with pytest.raises(ValueError, match="no routed experts"):
        enable_qat(random_model(tiny_k3(moe=None), seed=0))
    with pytest.raises(ValueError, match=r"moe.expert_hidden = 48\) must be multiples of 32"):
        enable_qat(random_model(tiny_k3(moe={"expert_hidden": 48}), seed=0))
    model = random_model(tiny_k3(), seed=0)
    with pytest.raises(ValueError, match="QAT format must be one of"):
        enable_qat(model, "nvfp4")
    enable_qat(model)
    with pytest.raises(ValueError, match="already a FakeQuantExperts"):
        enable_qat(model)
    with pytest.raises(ValueError, match="--qat must be one of"):
        TrainArgs(qat="int4")
    with pytest.raises(SystemExit):
        main(["train", "--qat", "nvfp4"])


def test_qat_training_on_k3_tiny_loses_loss_and_checkpoints_the_master_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    pytorch_muon(monkeypatch)  # what QAT changes is the forward and its gradients, not the optimizer's form
    args = tiny_args(tmp_path / "run", make_corpus(tmp_path / "data"), preset="k3-tiny", overrides={}, qat="mxfp4",
                     max_steps=8, eval_every=0)
    with one_thread():
        trainer = Trainer(args)
        assert all(type(m) is FakeQuantExperts for m in trainer.model.modules() if isinstance(m, Experts))
        records = [trainer.train_step() for _ in range(args.max_steps)]
        saved = trainer.save()
    losses = [r["loss"] for r in records]
    assert all(map(torch.isfinite, map(torch.tensor, losses)))
    assert sum(losses[-2:]) / 2 < losses[0] - 0.5, losses

    back = load_pretrained(saved)  # full precision: the masters, not their MXFP4 values
    trained = trainer.model.state_dict()
    assert back.state_dict().keys() == trained.keys()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    experts = [t for n, t in trained.items() if is_routed_expert(n)]
    assert experts and all(not torch.equal(fake_quant_mxfp4(t), t) for t in experts)
