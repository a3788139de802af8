"""Shared by the draft / speculative-decoding tests: a tiny trained target and a draft fine-tuned from its MTP layer
(train_tiny.TINY: KDA + MLA, latent MoE, Block AttnRes, one MTP layer), built once per test process."""

from __future__ import annotations

from pathlib import Path

import pytest

from openk3.train.command import train
from openk3.train.draft import DraftArgs, train_draft
from train_tiny import make_corpus, one_thread, pytorch_muon, tiny_args

TARGET_STEPS = 40
DRAFT_STEPS = 12
_built: dict[str, Path] = {}


def trained_runs(root: Path) -> tuple[Path, Path, Path]:
    """(the corpus, the target's run directory, the draft's run directory); trained on the first call."""
    if not _built:
        data = make_corpus(root / "data")
        with pytest.MonkeyPatch.context() as mp, one_thread():
            mp.setenv("OPENK3_CACHE", str(root / "cache"))
            pytorch_muon(mp)  # the target's 40 steps: the interpreted Triton Muon would be most of their time
            train(tiny_args(root / "target", data, max_steps=TARGET_STEPS, eval_every=0, sample_tokens=0))
            train_draft(DraftArgs(ckpt=str(root / "target"), out=str(root / "draft"), max_steps=DRAFT_STEPS,
                                  seq_len=32, batch_size=4, lr=3e-3, data=str(data), eval_every=6, eval_prompts=2,
                                  eval_prompt_len=16, eval_tokens=8, threads=1, progress=False))
        _built.update(data=data, target=root / "target", draft=root / "draft")
    return _built["data"], _built["target"], _built["draft"]
