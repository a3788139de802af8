"""`openk3 train` with a vision tower: the embedded shapes task (deterministic scenes, packed batches with the loss on
the captions only, the text-only baseline) and a short CLI run on a small vision-language config that learns what
only the image tells: the colour's held-out loss falls far below the text-only floor of ln 4."""

import json
import math

import numpy as np
import torch
import torch.nn.functional as F

from openk3.cli import main
from openk3.config import get_preset
from openk3.interop import load_pretrained
from openk3.train.shapes import (
    ATTRIBUTES,
    IGNORE,
    UNK,
    AttributePrior,
    SceneStream,
    caption_tokenizer,
    draw,
    held_out_scenes,
    make_batch,
    scene,
)
from train_tiny import one_thread, pytorch_muon

# k3-tiny-vl cut down so that a hundred steps take seconds: two decoder layers, a dense FFN, a one-block tower
SMALL_VL = {"hidden_size": 64, "num_layers": 2, "mla_layers": [1], "moe": None, "dense_hidden": 128, "mtp_layers": 0,
            "kda": {"num_heads": 2}, "mla": {"num_heads": 2},
            "vision": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "head_dim": 16, "intermediate_size": 64}}


def test_scenes_are_deterministic_and_captions_match_the_drawing():
    a, b = scene(7, 123), scene(7, 123)
    assert a == b and (np.asarray(draw(a)) == np.asarray(draw(b))).all()
    assert scene(7, 124) != a and scene("held-out", 123) != a
    s = scene(0, 5)
    image = draw(s)
    assert image.size == s.canvas
    pixels = torch.from_numpy(np.array(image)).int()  # [height, width, 3]
    background = pixels[0, 0]  # shapes keep a margin from the canvas edges
    coloured = (pixels - background).abs().sum(-1) > 60
    ys, xs = coloured.nonzero(as_tuple=True)
    assert (ys < s.canvas[1] // 2).all() == s.quadrant.startswith("top")  # the shapes sit in their quadrant
    assert (xs >= s.canvas[0] // 2).all() == s.quadrant.endswith("right")


def test_batches_pack_images_of_several_sizes_and_score_only_the_caption():
    vc = get_preset("k3-tiny-vl").vision
    tok = caption_tokenizer()
    scenes = [scene(1, i) for i in range(12)]
    batch = make_batch(scenes, tok, vc)
    assert len(set(batch.images.grid_hws)) > 1  # different sizes in one batch, no padding between images
    assert batch.images.num_patches == sum(h * w for h, w in batch.images.grid_hws)
    for row, targets, s, n in zip(batch.inputs, batch.targets, scenes, batch.images.token_counts(vc.merge_size)):
        assert int((row == vc.image_token_id).sum()) == n
        scored = targets[targets != IGNORE].tolist()
        assert scored == tok.encode(s.caption) + [tok.eos_id]
        start = int((targets != IGNORE).nonzero()[0])
        assert row[start + 1:start + 5].tolist() == scored[:4]  # teacher forcing: the input is the previous word
        assert tok.special_id(UNK) not in row.tolist()  # every prompt token, chat roles included, is a word


def test_text_only_baseline_is_chance():
    held = held_out_scenes(256)
    prior = AttributePrior([scene(0, i) for i in range(4096)])
    acc = prior.accuracy(held)
    for name, values in ATTRIBUTES.items():
        assert abs(acc[name] - 1 / len(values)) < 0.1, (name, acc[name])
    entropy = sum(math.log(len(v)) for v in ATTRIBUTES.values()) / (len(ATTRIBUTES) + 1)
    assert abs(prior.loss(held) - entropy) < 0.02


def test_scene_stream_resumes_where_it_stopped():
    stream = SceneStream(seed=3, batch_size=4)
    stream.next()
    resumed = SceneStream(seed=3, batch_size=4)
    resumed.load_state_dict(stream.state_dict())
    assert resumed.next() == stream.next()
    assert [s for r in range(2) for s in SceneStream(3, 4).next(r, 2)] == SceneStream(3, 4).next()


def test_cli_run_learns_what_only_the_image_tells(tmp_path, capsys, monkeypatch):
    pytorch_muon(monkeypatch)  # a hundred steps: the interpreted Triton Muon would take most of the run's time
    out = tmp_path / "run"
    config = tmp_path / "small.json"
    config.write_text(json.dumps(SMALL_VL))
    with one_thread():
        assert main(["train", "--preset", "k3-tiny-vl", "--config", str(config), "--max-steps", "100",
                     "--batch-size", "16", "--lr", "1e-2", "--eval-every", "0", "--mtp-weight", "0", "--threads", "1",
                     "--out", str(out), "--no-progress", "--sample-tokens", "4"]) == 0
    report = capsys.readouterr().out
    assert "held-out accuracy (greedy captions)" in report and "text-only baseline" in report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["caption_accuracy"]["colour"] > 0.9 > 0.35 > summary["text_only_accuracy"]["colour"]
    assert summary["heldout_loss"] < summary["text_only_loss"] - 0.15
    # per-word held-out loss from the saved checkpoint (vision tower and projector included)
    model = load_pretrained(out / "step-000100")
    assert model.config.vision == get_preset("k3-tiny-vl").with_overrides(SMALL_VL).vision
    tok = caption_tokenizer()
    batch = make_batch(held_out_scenes(64), tok, model.config.vision)
    with torch.no_grad():
        logits = model(batch.inputs, images=batch.images).logits
    ce = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE, reduction="none")
    per_word = ce.view(batch.targets.shape)[batch.targets != IGNORE].view(64, 5).mean(0)
    colour = list(ATTRIBUTES).index("colour")
    assert per_word[colour] < 0.3 * math.log(4), per_word  # the text-only floor for the colour is ln 4
    assert (out / "sample.txt").read_text().count("->") == 3  # one held-out caption per canvas size


def test_the_vision_task_takes_no_data_tokenizer_or_context_parallelism(tmp_path, capsys):
    for flag in ("--data", "--tokenizer"):
        assert main(["train", "--preset", "k3-tiny-vl", flag, str(tmp_path), "--out", str(tmp_path / "r"),
                     "--no-progress"]) == 2
        assert f"openk3 train: error: {flag}: preset 'k3-tiny-vl' has a vision tower" in capsys.readouterr().err
    assert main(["train", "--preset", "k3-tiny-vl", "--cp", "2", "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    assert "openk3 train: error: --cp 2: the shapes task's sequences" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
