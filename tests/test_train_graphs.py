"""`openk3 train --cuda-graphs` (openk3.train.graphs): the refusals on any machine, the graph itself on a GPU.

The GPU tests hold the graphed step to the eager one: the same model and batches through both, the losses of
every step and the weights after the last compared. They cover both optimizers (the graph hands its gradients to
an optimizer outside it), the trainer's own step (schedule, clipping, Quantile Balancing around the replays), a
batch of another shape, and a step that cannot be captured (it falls back to the eager step with a warning).
"""

import warnings

import pytest
import torch

from openk3.config import get_preset
from openk3.model import K3ForCausalLM
from openk3.train.args import TrainArgs
from openk3.train.graphs import GraphedForwardBackward
from openk3.train.loop import Trainer, lm_losses
from openk3.train.optim import build_optimizer
from train_tiny import TINY, make_corpus, tiny_args

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_cuda_graphs_refuse_a_cpu_run(tmp_path):
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device; this run is on cpu"):
        Trainer(tiny_args(tmp_path / "run", tmp_path / "data", device="cpu", cuda_graphs=True))


def test_cuda_graphs_refuse_the_captioning_task(tmp_path):
    from openk3.train.vision_loop import CaptionTrainer

    args = TrainArgs(preset="k3-tiny-vl", out=str(tmp_path / "run"), cuda_graphs=True)
    with pytest.raises(ValueError, match="--cuda-graphs needs batches of one shape"):
        CaptionTrainer(args)


def test_graph_runner_refuses_a_cpu_batch_and_no_warmup():
    with pytest.raises(ValueError, match="warmup must be at least 1"):
        GraphedForwardBackward(lambda batch: (batch,), [], warmup=0)
    with pytest.raises(ValueError, match="CUDA graphs need the batch on a CUDA device, got cpu"):
        GraphedForwardBackward(lambda batch: (batch,), [])(torch.zeros(2, 3))


def _tiny_model() -> K3ForCausalLM:
    torch.manual_seed(0)
    return K3ForCausalLM(get_preset("k3-tiny").with_overrides(TINY)).cuda()


def _forward_backward(model):
    def run(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss, lm, _ = lm_losses(model, ids, mtp_weight=0.3)
        loss.backward()
        return lm.detach(), loss.detach()

    return run


def _train(model, optimizer: str, batches, graphed: bool):
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1, optimizer=optimizer)
    step = _forward_backward(model)
    runner = GraphedForwardBackward(step, list(model.parameters())) if graphed else step
    losses = []
    for ids in batches:
        lm, _ = runner(ids)
        losses.append(float(lm))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, runner


@needs_cuda
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_graphed_steps_train_like_eager_steps(optimizer):
    torch.manual_seed(1)
    batches = [torch.randint(0, TINY["vocab_size"], (4, 33), device="cuda") for _ in range(7)]
    eager_model, graphed_model = _tiny_model(), _tiny_model()
    eager, _ = _train(eager_model, optimizer, batches, graphed=False)
    graphed, runner = _train(graphed_model, optimizer, batches, graphed=True)
    assert runner.captured and runner.failed is None and runner.calls == len(batches)
    assert graphed == pytest.approx(eager, rel=2e-3)
    assert graphed[-1] != graphed[-2]  # the replays saw new batches and new weights
    for (name, a), b in zip(eager_model.named_parameters(), graphed_model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-3, msg=name)


@needs_cuda
def test_a_batch_of_another_shape_is_refused():
    model = _tiny_model()
    runner = GraphedForwardBackward(_forward_backward(model), list(model.parameters()), warmup=1)
    ids = torch.randint(0, TINY["vocab_size"], (2, 17), device="cuda")
    for _ in range(2):
        runner(ids)
    with pytest.raises(ValueError, match=r"batches of one shape: the first was \(2, 17\) torch.int64, got \(2, 9\)"):
        runner(ids[:, :9])


@needs_cuda
def test_a_step_that_cannot_be_captured_runs_eagerly_with_a_warning():
    model = _tiny_model()
    step = _forward_backward(model)

    def syncing(ids):  # .item() waits for the GPU: not allowed while capturing
        lm, loss = step(ids)
        return lm, loss * float(loss.item() > 0)

    runner = GraphedForwardBackward(syncing, list(model.parameters()), warmup=1)
    ids = torch.randint(0, TINY["vocab_size"], (2, 17), device="cuda")
    runner(ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm, _ = runner(ids)
    assert not runner.captured and runner.failed
    assert any("training on eagerly" in str(w.message) for w in caught)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)  # the eager step's
    model.zero_grad(set_to_none=True)
    expected, _ = step(ids)
    assert float(lm) == pytest.approx(float(expected), rel=1e-3)


@needs_cuda
def test_trainer_with_cuda_graphs_follows_the_eager_run(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    data = make_corpus(tmp_path / "d")
    losses = {}
    for flag in (False, True):
        # eager and graphed, on batches of one layout (with --packing docs automatic graphs stay off)
        trainer = Trainer(tiny_args(tmp_path / str(flag), data, device="cuda", cuda_graphs=flag, compile=False,
                                    packing="concat"))
        losses[flag] = [trainer.train_step()["loss"] for _ in range(6)]
        bias = [r.e_score_correction_bias for _, r in trainer.balancer.routers()]
        assert all(bool(b.abs().sum() > 0) for b in bias)  # Quantile Balancing moved the biases
    assert trainer.graphed.captured
    assert losses[True] == pytest.approx(losses[False], rel=2e-3)
