"""Shared by the training tests: a very small K3-shaped config and a small local text corpus."""

from __future__ import annotations

import sysconfig
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from openk3.model.moe import decisive_routing
from openk3.train import loop
from openk3.train.args import TrainArgs
from openk3.train.optim import build_optimizer

# every K3 ingredient (KDA + MLA, latent MoE with a shared expert, Block AttnRes, one MTP layer), tiny widths
TINY = {
    "vocab_size": 320,
    "hidden_size": 32,
    "num_layers": 4,
    "mla_layers": [3],
    "kda": {"num_heads": 2, "head_dim": 16},
    "mla": {"num_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
            "v_head_dim": 8},
    "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 16, "num_shared_experts": 1, "latent_dim": 16},
    "dense_hidden": 64,
    "attn_res_block_size": 2,
    "mtp_layers": 1,
}

# MLA head dims the flash kernels take (multiples of 8), not the tiny model's 12 / 8
FLASH_MLA = {"mla": {**TINY["mla"], "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}}

CORPUS_FILES = ("bisect.py", "colorsys.py", "keyword.py", "this.py", "shlex.py")


def make_corpus(directory: Path) -> Path:
    """A few small standard-library modules copied into `directory` (about 30 KB of text)."""
    directory.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CORPUS_FILES:
        (directory / name).write_text((stdlib / name).read_text(encoding="utf-8"), encoding="utf-8")
    return directory


def tiny_args(out: Path, data: Path, **changes) -> TrainArgs:
    settings = dict(overrides=TINY, data=str(data), out=str(out), seq_len=32, batch_size=4, max_steps=6,
                    lr=1e-2, eval_every=3, eval_windows=4, sample_tokens=8, progress=False, plot=False, threads=1)
    settings.update(changes)
    return TrainArgs(**settings)


@contextmanager
def one_thread():
    """Tiny shapes gain nothing from intra-op threads, and on a busy machine the thread hand-offs dominate."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pytorch_muon(monkeypatch) -> None:
    """Trainers built after this take Muon's PyTorch passes (MuonAdamW(fused=False), its reference form) instead of
    its Triton kernels, which TRITON_INTERPRET=1 runs at 10-15 times the whole step's time: for tests of something
    other than the optimizer (tests/test_triton_muon.py holds the two forms equal; the other training tests still
    step through the interpreted kernels)."""
    monkeypatch.setattr(loop, "build_optimizer", partial(build_optimizer, fused=False))


def gradient_mismatches(names: list[str], got, want, tol: float) -> list[tuple[str, float, float]]:
    """(name, ||got - want|| / ||want||, ||got|| / ||want||) for every gradient off by `tol` or more, the worst
    first: a failure names the parameters and says whether a gradient went missing (ratio 0) or grew."""
    out = []
    for name, g, w in zip(names, got, want):
        if w is None or g is None or w.norm() == 0:
            assert (g is None or g.norm() == 0) == (w is None or w.norm() == 0), name
            continue
        err = ((g.float() - w.float()).norm() / w.float().norm()).item()
        if err >= tol:
            out.append((name, err, (g.float().norm() / w.float().norm()).item()))
    return sorted(out, key=lambda row: -row[1])


def assert_compiled_matches_eager(eager, compiled, batch: torch.Tensor, autocast: bool, segments=None) -> None:
    """The LM + MTP loss (weight 0.3) and every gradient of `compiled` equal `eager`'s (same weights) on one batch,
    under bf16 autocast or in fp32, the routers made decisive so that near-ties cannot flip an expert between the
    runs: the loss to 1e-4 (1e-2 under autocast), each whole gradient's relative error below 1e-4 (3e-2: bf16
    operands fused differently); a failure names the parameters (`gradient_mismatches`)."""
    results = []
    for model in (eager, compiled):
        params = [p for p in model.parameters() if p.requires_grad]
        with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=autocast), decisive_routing(model):
            loss = loop.lm_losses(model, batch, 0.3, segments)[0]
        results.append((loss, torch.autograd.grad(loss, params, allow_unused=True)))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-2 if autocast else 1e-4, atol=1e-4)
    names = [n for n, p in eager.named_parameters() if p.requires_grad]
    assert gradient_mismatches(names, got_grads, want_grads, 3e-2 if autocast else 1e-4) == []
