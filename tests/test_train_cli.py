"""`openk3 train` and `openk3 generate` end to end on a tiny config, plus the pieces they are built from."""

import dataclasses
import json
import re
import shutil

import pytest
import torch

from openk3.cli import main
from openk3.config import get_preset
from openk3.generation import generate_ids
from openk3.interop import load_pretrained
from openk3.model import K3ForCausalLM
from openk3.sampling import SamplingParams
from openk3.tokenizer import EOS, TextTokenizer, load_or_train
from openk3.train.args import TrainArgs
from openk3.train.data import BatchStream, load_documents, split_documents, unigram_cross_entropy
from openk3.train.schedule import WSDSchedule
from train_tiny import TINY, make_corpus, one_thread

STEPS = 4


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = make_corpus(root / "data")
    config = root / "tiny.json"
    config.write_text(json.dumps(TINY))
    out = root / "run"
    argv = ["train", "--config", str(config), "--data", str(data), "--max-steps", str(STEPS), "--seq-len", "32",
            "--batch-size", "4", "--out", str(out), "--save-every", "2", "--eval-every", "2", "--no-progress",
            "--sample-tokens", "8", "--lr", "0.01"]
    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.setenv("OPENK3_CACHE", str(root / "cache"))
        assert main(argv) == 0
        yield out


def test_train_writes_metrics_checkpoints_plot_and_sample(cli_run, capsys):
    out = cli_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s", "maxvio", "mtp_loss", "grad_norm"} <= set(r)
        assert set(r["maxvio"]) == {"1", "2", "3", "4"}  # MoE layers 1..3 and the MTP layer (index 4)
    assert "eval_loss" in records[1] and "eval_loss" in records[3]
    for step in (2, STEPS):
        assert (out / f"step-{step:06d}" / "manifest.json").is_file()
    assert (out / "loss.png").stat().st_size > 0
    assert (out / "sample.txt").read_text().startswith("def ")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["unigram_loss"] > 0


def test_generate_from_the_training_checkpoint(cli_run, capsys):
    capsys.readouterr()
    assert main(["generate", "--ckpt", str(cli_run), "--prompt", "import ", "--max-new-tokens", "6",
                 "--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("import ")
    main(["generate", "--ckpt", str(cli_run / f"step-{STEPS:06d}"), "--prompt", "import ", "--max-new-tokens", "6",
          "--seed", "3", "--threads", "1"])
    assert capsys.readouterr().out == first  # run dir -> latest checkpoint; same seed -> same text


def test_greedy_decode_with_cache_equals_full_recompute(cli_run):
    model = load_pretrained(cli_run / f"step-{STEPS:06d}")
    tok = TextTokenizer.from_file(cli_run / f"step-{STEPS:06d}" / "tokenizer.json")
    prompt = tok.encode("def f(x):\n")
    new = generate_ids(model, prompt, 8, SamplingParams(max_tokens=8, temperature=0.0))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]), return_mtp=False).logits[0, -1].argmax()))
    assert new == ids[len(prompt):len(prompt) + len(new)] and len(new) > 0


def test_tokenizer_round_trip_cache_and_vocab_limit(tmp_path):
    docs = load_documents(make_corpus(tmp_path / "d"))
    texts = [d.text for d in docs]
    tok = load_or_train(texts, 300, cache=tmp_path / "c")
    assert tok.vocab_size == 300 and tok.decode(tok.encode(texts[0])) == texts[0]
    assert tok.tokenizer.token_to_id(EOS) == tok.eos_id
    cached = list((tmp_path / "c").glob("*.json"))
    assert len(cached) == 1 and load_or_train(texts, 300, cache=tmp_path / "c").encode("x = 1") == tok.encode("x = 1")
    with pytest.raises(ValueError, match="vocab_size is 280"):
        load_or_train(texts, 280, path=cached[0])


def test_default_corpus_is_the_stdlib_with_a_stable_held_out_split():
    docs = load_documents(None)
    train, held = split_documents(docs)
    assert len(docs) > 50 and held and train and not {d.name for d in held} & {d.name for d in train}
    assert [d.name for d in docs] == sorted(d.name for d in docs)


def test_jsonl_data_needs_a_text_field(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text('{"text": "hello"}\n\n{"text": "world"}\n')
    assert [d.text for d in load_documents(good)] == ["hello", "world"]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="b.jsonl:1: each JSONL line needs a string field 'text'"):
        load_documents(bad)


def test_batch_stream_resumes_and_covers_every_window_once_per_epoch():
    tokens = torch.arange(1 + 10 * 8)
    stream = BatchStream(tokens, seq_len=8, batch_size=4, seed=7)
    first = [stream.next() for _ in range(2)]
    state = stream.state_dict()
    later = [stream.next() for _ in range(3)]
    again = BatchStream(tokens, seq_len=8, batch_size=4, seed=7)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(later, [again.next() for _ in range(3)]))
    epoch_one = torch.cat([b[:, 0] for b in first + later])[:10]
    assert sorted(epoch_one.tolist()) == list(range(0, 80, 8))


def test_wsd_schedule_shape():
    s = WSDSchedule.for_run(1.0, total_steps=100, warmup_frac=0.1, decay_frac=0.2, min_ratio=0.1)
    lrs = [s(i) for i in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0
    assert all(v == 1.0 for v in lrs[10:80])
    assert lrs[99] == pytest.approx(0.1) and all(a >= b for a, b in zip(lrs[80:], lrs[81:]))


def test_unigram_baseline_is_the_smoothed_cross_entropy():
    train = torch.tensor([0, 0, 1])
    value = unigram_cross_entropy(train, torch.tensor([0]), vocab_size=3)
    assert value == pytest.approx(-torch.log(torch.tensor(3 / 6)).item())


def test_router_bias_is_never_an_optimizer_parameter():
    from openk3.train.optim import build_optimizer

    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("k3-tiny").with_overrides(TINY))
    opt = build_optimizer(model, lr=0.1, weight_decay=0.1)
    biases = [r.e_score_correction_bias for _, r in model.routers()]
    assert biases and not {id(b) for b in biases} & {id(p) for g in opt.param_groups for p in g["params"]}
    before = [b.clone() for b in biases]
    out = model(torch.randint(0, TINY["vocab_size"], (2, 16)))
    out.logits.float().logsumexp(-1).mean().backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, biases))


def test_time_limit_shrinks_the_schedule_gives_steps_back_and_ignores_one_stall(tmp_path, monkeypatch):
    import time

    from openk3.train.loop import CLOSING_STEPS, FIT_WINDOW, Trainer
    from train_tiny import tiny_args

    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    requested, limit, left, step_s, at = 100, 1000.0, 100.0, 2.0, 10
    with one_thread():
        trainer = Trainer(tiny_args(tmp_path / "run", make_corpus(tmp_path / "d"), max_steps=requested,
                                    time_limit=limit))
    trainer.step = at
    trainer.created = time.perf_counter() - (limit - left)
    for _ in range(FIT_WINDOW):
        trainer._recent.append(step_s)
        trainer._fit_time_limit(None)
    expected = at + int((left - CLOSING_STEPS * step_s) / step_s)
    assert expected - 1 <= trainer.schedule.total_steps <= expected
    assert trainer.schedule.total_steps - trainer.schedule.decay > at  # the decay still lies ahead, whole
    fitted = trainer.schedule.total_steps
    trainer._recent.append(44.0)  # one stalled step (the 2026-11-30 report) does not move the fit
    trainer._fit_time_limit(None)
    assert abs(trainer.schedule.total_steps - fitted) <= 1
    trainer.created = time.perf_counter()  # plenty of time again
    trainer._fit_time_limit(None)
    assert trainer.schedule.total_steps == requested


def test_by_default_a_slow_machine_gets_a_warning_not_a_shorter_run(tmp_path, monkeypatch, capsys):
    from openk3.train.loop import FIT_WINDOW, SLOW_RUN_SECONDS, Trainer
    from train_tiny import tiny_args

    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    assert TrainArgs().time_limit == 0  # off unless asked for
    requested = 200
    step_s = 1.2 * SLOW_RUN_SECONDS / requested  # projected 20% over the slow-run mark
    with one_thread():
        trainer = Trainer(tiny_args(tmp_path / "run", make_corpus(tmp_path / "d"), max_steps=requested))
    capsys.readouterr()
    for _ in range(FIT_WINDOW):
        trainer._recent.append(step_s)
        trainer._fit_time_limit(None)
        trainer._watch_pace(None)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"warning: at {step_s:.2f} s/step the run is expected to take 12 min")
    assert f"keeps its {requested} steps" in out[0]
    for _ in range(FIT_WINDOW):  # the machine slows down: one more warning with the new expected duration
        trainer._recent.append(3 * step_s)
        trainer._watch_pace(None)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("warning: steps slowed to ") and "(expected 12 min" in out[0]
    assert trainer.schedule.total_steps == requested


@pytest.mark.parametrize("flag,value", [("--max-steps", "-1"), ("--max-steps", "0"), ("--batch-size", "0"),
                                        ("--seq-len", "-4"), ("--lr", "0"), ("--lr", "nan"), ("--grad-clip", "0"),
                                        ("--time-limit", "-5"), ("--save-every", "-1"), ("--weight-decay", "-0.1"),
                                        ("--eval-every", "1.5"), ("--threads", "-1")])
def test_impossible_values_fail_at_parse_time_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", flag, value])
    assert exit_.value.code == 2
    assert f"openk3 train: error: argument {flag}: must be " in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [
    (["train", "--preset", "nosuch"], "argument --preset: invalid choice: 'nosuch'"),
    (["train", "--max-steps", "0"], "argument --max-steps: must be at least 1, got 0"),
    (["generate", "--ckpt", "x", "--prompt", "p", "--max-new-tokens", "0"], "argument --max-new-tokens: must be "),
    (["generate", "--ckpt", "x", "--prompt", "p", "--threads", "-1"], "argument --threads: must be at least 0"),
    (["draft", "--ckpt", "x", "--max-steps", "0"], "argument --max-steps: must be at least 1"),
])
def test_a_bad_flag_is_one_line_naming_it(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"openk3 {argv[0]}: error: {named}") and f"(see openk3 {argv[0]} --help)" in err


def test_out_defaults_to_runs_slash_the_preset():
    """Each preset trains into its own directory: a vision run does not collide with the text run."""
    from openk3.cli import build_parser
    from openk3.train.command import train_args

    for preset in ("k3-tiny", "k3-tiny-vl"):
        assert train_args(build_parser().parse_args(["train", "--preset", preset])).out == f"runs/{preset}"
        assert TrainArgs(preset=preset).out == f"runs/{preset}"
    assert train_args(build_parser().parse_args(["train", "--out", "elsewhere"])).out == "elsewhere"


def test_a_draft_run_directory_is_named_as_such_and_no_resume_is_offered(tmp_path):
    """`openk3 draft --out` leaves metrics and step-*/ checkpoints with a draft.json and no trainer.pt: `openk3
    train` there says what it holds instead of offering a --resume that cannot work; a training run whose latest
    checkpoint cannot be resumed gets no --resume advice either."""
    from openk3.draft.model import DRAFT_CONFIG
    from openk3.train.loop import claim_out_dir

    (tmp_path / "metrics.jsonl").write_text("{}\n")
    step = tmp_path / "step-000200"
    step.mkdir()
    for name in ("config.json", "model.safetensors", DRAFT_CONFIG, "manifest.json"):
        (step / name).write_text("{}")
    with pytest.raises(ValueError, match="holds a draft run of `openk3 draft`") as refused:
        claim_out_dir(tmp_path, None, overwrite=False, delete=True)
    assert "--resume" not in str(refused.value) and "--overwrite" in str(refused.value)
    (step / DRAFT_CONFIG).unlink()
    with pytest.raises(ValueError, match="already holds a training run") as refused:
        claim_out_dir(tmp_path, None, overwrite=False, delete=True)
    assert "--resume" not in str(refused.value)
    (step / "trainer.pt").write_text("")
    with pytest.raises(ValueError, match=f"continue it with --resume {step}"):
        claim_out_dir(tmp_path, None, overwrite=False, delete=True)


def test_train_args_in_code_are_checked_too():
    with pytest.raises(ValueError, match="--batch-size must be at least 1, got 0"):
        TrainArgs(batch_size=0)
    with pytest.raises(ValueError, match="--warmup-frac must be at least 0 and at most 1, got 1.5"):
        TrainArgs(warmup_frac=1.5)


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    blocks = {m.group(1): m.group(0) for m in re.finditer(r"^  (--[\w-]+).*?(?=^  -|\Z)", text, re.M | re.S)}
    shown = 0
    for f in dataclasses.fields(TrainArgs):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = "--" + f.name.replace("_", "-")
        if flag in blocks and default is not None and default is not False:
            assert f"(default: {default})" in " ".join(blocks[flag].split()), flag
            shown += 1
    assert shown >= 15 and "(default: 300" in " ".join(blocks["--max-steps"].split())
    assert "(default: runs/PRESET)" in " ".join(blocks["--out"].split())


def test_a_new_run_into_another_runs_directory_is_refused(cli_run, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in cli_run.iterdir()}
    metrics = (cli_run / "metrics.jsonl").read_text()
    assert main(["train", "--out", str(cli_run), "--max-steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--out {cli_run} already holds a training run (metrics.jsonl, summary.json, sample.txt" in err
    assert f"continue it with --resume {cli_run / f'step-{STEPS:06d}'}" in err and "--overwrite" in err
    assert {p.name: p.stat().st_mtime_ns for p in cli_run.iterdir()} == before
    assert (cli_run / "metrics.jsonl").read_text() == metrics


def test_resume_continues_in_place_and_overwrite_replaces_only_run_files(cli_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(cli_run, run)
    (run / "notes.txt").write_text("mine")
    common = ["--config", str(cli_run.parent / "tiny.json"), "--data", str(cli_run.parent / "data"), "--seq-len",
              "32", "--batch-size", "4", "--out", str(run), "--no-progress", "--sample-tokens", "2"]
    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.setenv("OPENK3_CACHE", str(cli_run.parent / "cache"))
        assert main(["train", *common, "--resume", str(run / "step-000002"), "--max-steps", str(STEPS)]) == 0
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, STEPS + 1))  # the first two kept, the last two redone
        assert main(["train", *common, "--max-steps", "1", "--overwrite"]) == 0
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == ["step-000001"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (run / "notes.txt").read_text() == "mine"


def test_activation_checkpointing_gives_the_same_losses(tmp_path, monkeypatch):
    from openk3.train.loop import Trainer
    from train_tiny import tiny_args

    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    data = make_corpus(tmp_path / "d")
    losses = {}
    with one_thread():
        for flag in (False, True):
            trainer = Trainer(tiny_args(tmp_path / str(flag), data, activation_checkpointing=flag))
            losses[flag] = [trainer.train_step()["loss"] for _ in range(3)]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_heldout_evaluation_leaves_the_balancing_biases_frozen(tmp_path, monkeypatch):
    from openk3.train.loop import Trainer, heldout_loss
    from train_tiny import tiny_args

    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    with one_thread():
        trainer = Trainer(tiny_args(tmp_path / "run", make_corpus(tmp_path / "d")))
        trainer.train_step()
        routers = [r for _, r in trainer.model.routers()]
        biases = [r.e_score_correction_bias.clone() for r in routers]
        scores = [r.last_scores for r in routers]
        heldout_loss(trainer.model, trainer.eval_windows, 4, trainer.device, None, trainer.world)
    assert all(torch.equal(b, r.e_score_correction_bias) for b, r in zip(biases, routers))
    assert all(s is r.last_scores for s, r in zip(scores, routers))  # eval forwards record nothing
    assert trainer.model.training


def test_the_run_reads_each_step_once_the_next_is_queued_and_evaluates_with_nothing_queued(tmp_path, monkeypatch):
    """`Trainer.run` pipelines the steps (openk3.train.queued): step n's numbers are read after step n + 1 is
    queued, except where it evaluates or ends; its metrics equal steps run and read one at a time."""
    from openk3.train.loop import Trainer
    from train_tiny import pytorch_muon, tiny_args

    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    pytorch_muon(monkeypatch)
    data = make_corpus(tmp_path / "d")
    steps, every = 7, 3
    with one_thread():
        serial = Trainer(tiny_args(tmp_path / "serial", data, max_steps=steps, eval_every=every))
        expected = []
        for _ in range(steps):
            record = serial.train_step()
            if record["step"] % every == 0 or record["step"] == steps:
                record["eval_loss"] = serial._heldout()
            expected.append(record)
        piped = Trainer(tiny_args(tmp_path / "piped", data, max_steps=steps, eval_every=every))
        events = []
        queue, read = piped.queue_step, piped._read
        monkeypatch.setattr(piped, "queue_step", lambda: events.append(f"q{piped.step + 1}") or queue())
        monkeypatch.setattr(piped, "_read", lambda queued: events.append(f"r{queued.step}") or read(queued))
        piped.run()
    assert " ".join(events) == "q1 q2 r1 q3 r2 r3 q4 q5 r4 q6 r5 r6 q7 r7"
    got = [json.loads(line) for line in (tmp_path / "piped" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for mine, theirs in zip(got, expected):
        assert mine.keys() == theirs.keys()
        for key in ("loss", "mtp_loss", "lr", "grad_norm", "eval_loss"):
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-6), (mine["step"], key)
        assert mine["maxvio"] == pytest.approx(theirs["maxvio"], rel=1e-6)
        assert mine["tokens_per_s"] > 0
