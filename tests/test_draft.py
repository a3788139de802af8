"""`openk3 draft` and the EAGLE-3-style draft model (SPEC §11): a short fine-tune of a tiny trained target writes its
metrics and a checkpoint holding the unchanged target plus the draft; training-time test sees what drafting sees;
clear errors for a checkpoint without an MTP layer."""

import json

import pytest
import torch

from openk3.cache import MLALayerCache
from openk3.cli import main
from openk3.draft import EagleDraft, default_taps, load_draft, tapped_hidden_states
from openk3.interop import load_pretrained, save_pretrained
from openk3.model import K3ForCausalLM
from openk3.train.draft import DraftArgs, train_draft
from spec_tiny import DRAFT_STEPS, trained_runs
from train_tiny import TINY, one_thread


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return trained_runs(tmp_path_factory.mktemp("spec"))


def test_draft_run_writes_metrics_and_a_target_plus_draft_checkpoint(runs):
    _, target_run, draft_run = runs
    records = [json.loads(line) for line in (draft_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, DRAFT_STEPS + 1))
    for r in records:
        assert r["loss"] > 0 and len(r["alpha"]) == 3 and all(0 < a <= 1 for a in r["alpha"])
    evals = [r for r in records if "accept_len" in r]
    assert [r["step"] for r in evals] == [6, 12]
    for r in evals:  # 1 + accepted / verifications, accepted / drafted
        assert 1 <= r["accept_len"] <= 4 and 0 <= r["accept_rate"] <= 1
        assert r["accept_len"] == pytest.approx(1 + 3 * r["accept_rate"])
    ckpt = draft_run / f"step-{DRAFT_STEPS:06d}"
    target = load_pretrained(target_run / "step-000040")
    model = load_pretrained(ckpt)
    draft = load_draft(model, ckpt)
    assert draft.taps == default_taps(TINY["num_layers"]) and draft.layer is model.mtp[0]
    before, after = target.state_dict(), model.state_dict()
    frozen = [k for k in before if not k.startswith("mtp.")]
    assert all(torch.equal(before[k], after[k]) for k in frozen)  # the target itself is unchanged
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("mtp."))  # the draft trained
    assert not torch.equal(draft.fc.weight, EagleDraft(target).fc.weight)


def test_training_time_test_matches_drafting(runs):
    """Unrolled step i at index t (training) = the draft's chain at position t + i (inference): the real context
    up to t, then its own hidden states fed back with the true tokens."""
    _, _, draft_run = runs
    ckpt = draft_run / f"step-{DRAFT_STEPS:06d}"
    model = load_pretrained(ckpt).eval()
    draft = load_draft(model, ckpt)
    tokens = torch.randint(0, TINY["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), one_thread():
        with tapped_hidden_states(model, draft.taps) as tapped:
            model(tokens, return_mtp=False)
            features = draft.fuse(tapped)
        unrolled = draft.unroll(features, tokens, 3)
        attn = draft.layer.block.self_attn
        for t in (0, 7, 16):
            latents = MLALayerCache(features.new_zeros(1, 0, attn.kv_lora_rank + attn.slice_dim))
            prev = torch.cat([features.new_zeros(1, 1, features.shape[-1]), features[:, :t]], dim=1)
            hidden = draft.step(prev, tokens[:, :t + 1], latents, torch.tensor([0]))[:, -1:]
            torch.testing.assert_close(draft.logits(hidden)[0, 0], unrolled[0][0, t], rtol=1e-4, atol=1e-5)
            for i in (1, 2):
                hidden = draft.step(hidden, tokens[:, t + i:t + i + 1], latents, torch.tensor([t + i]))
                torch.testing.assert_close(draft.logits(hidden)[0, 0], unrolled[i][0, t], rtol=1e-4, atol=1e-5)


def test_a_checkpoint_without_mtp_layers_is_refused_with_directions(tmp_path, runs):
    _, target_run, _ = runs
    cfg = load_pretrained(target_run / "step-000040").config.with_overrides({"mtp_layers": 0})
    save_pretrained(K3ForCausalLM(cfg), tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").write_bytes((target_run / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match=r"no MTP layer .* `openk3 train`"):
        train_draft(DraftArgs(ckpt=str(tmp_path / "ckpt"), out=str(tmp_path / "out"), progress=False))
    with pytest.raises(ValueError, match="mtp_layers"):
        EagleDraft(K3ForCausalLM(cfg))


def test_draft_cli_help_bad_flags_and_a_reused_out(runs, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["draft", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: lk)", "(default: 200)", "(default: 3)", "(default: runs/draft)"):
        assert default in text
    with pytest.raises(SystemExit):
        main(["draft", "--ckpt", "x", "--draft-tokens", "0"])
    assert "--draft-tokens: must be at least 1" in capsys.readouterr().err
    _, target_run, draft_run = runs
    assert main(["draft", "--ckpt", str(target_run), "--out", str(draft_run), "--no-progress"]) == 2
    assert "already holds a draft run" in capsys.readouterr().err
    assert main(["draft", "--ckpt", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "missing does not exist" in capsys.readouterr().err


def test_taps_are_validated(runs):
    _, target_run, _ = runs
    model = load_pretrained(target_run / "step-000040")
    with pytest.raises(ValueError, match=r"3 layer indices in \[0, 3\]"):
        EagleDraft(model, (0, 1, 4))
    assert default_taps(8) == (2, 4, 5) and default_taps(93) == (2, 46, 90)
