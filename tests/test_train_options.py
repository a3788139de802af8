"""`openk3 train`'s defaults and logs: the fast path resolved by device (--compile / --cuda-graphs), --packing,
and --tensorboard's event files (read back with TensorBoard's EventAccumulator) against metrics.jsonl, MFU
included (its GPU peak stood in for on CPU)."""

import json

import pytest
import torch

from openk3.cli import build_parser
from openk3.model.documents import same_document
from openk3.train import loop
from openk3.train.args import FastPath, resolve_fast_path
from openk3.train.data import BatchStream, resolve_packing
from openk3.train.loop import Trainer
from openk3.train.mfu import flops_per_token
from train_tiny import make_corpus, one_thread, tiny_args


def test_fast_path_defaults_resolve_by_device():
    assert resolve_fast_path(None, None, "cuda") == FastPath(True, True)
    assert resolve_fast_path(None, None, "cpu") == FastPath(False, False)
    assert resolve_fast_path(False, False, "cuda") == FastPath(False, False)  # --no-compile --no-cuda-graphs
    assert resolve_fast_path(None, False, "cuda") == FastPath(True, False)
    assert resolve_fast_path(True, None, "cpu") == FastPath(True, False)  # compiling on CPU stays possible
    # where shapes or the layout vary, or with several processes, automatic graphs are off with one line
    varying = resolve_fast_path(None, None, "cuda", varying="the prompts change length")
    assert varying == FastPath(True, False, "CUDA graphs off: the prompts change length")
    assert "4 processes" in resolve_fast_path(None, None, "cuda", processes=4).note
    # asked for where they cannot work: refused, naming the flag and the reason
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device; this run is on cpu"):
        resolve_fast_path(None, True, "cpu")
    with pytest.raises(ValueError, match="--cuda-graphs needs one process .*the prompts change length"):
        resolve_fast_path(None, True, "cuda", varying="the prompts change length")
    with pytest.raises(ValueError, match="this run has 2 processes"):
        resolve_fast_path(None, True, "cuda", processes=2)


def test_cli_flags_turn_the_fast_path_on_and_off():
    parser = build_parser()
    parse = lambda *flags: parser.parse_args(["train", *flags])  # noqa: E731
    assert (parse().compile, parse().cuda_graphs) == (None, None)  # resolved by device in the trainer
    assert (parse("--no-compile").compile, parse("--no-cuda-graphs").cuda_graphs) == (False, False)
    assert (parse("--compile").compile, parse("--cuda-graphs").cuda_graphs) == (True, True)
    assert parse().packing == "auto" and parse("--packing", "concat").packing == "concat"
    with pytest.raises(SystemExit):
        parse("--packing", "rows")


def test_packing_defaults_to_documents_when_the_data_has_them():
    assert resolve_packing("auto", 5) == "docs"
    assert resolve_packing("auto", 1) == "concat"  # one document: nothing to separate
    assert resolve_packing("auto", 5, cp=2) == "concat"
    assert resolve_packing("concat", 5) == "concat"
    with pytest.raises(ValueError, match="--packing docs is not supported with --cp 2"):
        resolve_packing("docs", 5, cp=2)


def test_packed_batches_are_the_same_windows_with_their_documents():
    tokens = torch.arange(200)
    segments = tokens // 7  # documents of 7 tokens
    plain, packed = BatchStream(tokens, 16, 4, seed=3), BatchStream(tokens, 16, 4, seed=3, segments=segments)
    for _ in range(3):
        ids, seg = packed.next_packed()
        assert torch.equal(ids, plain.next()) and torch.equal(seg, ids // 7)
    with pytest.raises(ValueError, match="without segments"):
        plain.next_packed()


def test_trainer_resolves_cpu_defaults_and_packs_documents(tmp_path):
    data = make_corpus(tmp_path / "data")
    trainer = Trainer(tiny_args(tmp_path / "run", data, device="cpu"))
    assert (trainer.args.compile, trainer.args.cuda_graphs, trainer.fast_path_note) == (False, False, None)
    assert trainer.packing == "docs"  # five files
    batch = trainer._next_batch()
    assert isinstance(batch, loop.PackedRows) and batch.segments.shape == batch.tokens.shape
    assert trainer.eval_segments.shape == trainer.eval_windows.shape
    compiled = Trainer(tiny_args(tmp_path / "run2", data, device="cpu", compile=True, packing="concat"))
    assert compiled.packing == "concat" and compiled.eval_segments is None
    assert [compiled._phase(n) for n in range(3)] == ["compiling", "compiling", None]  # the progress line's phase
    assert trainer._phase(0) is None


def test_heldout_loss_of_packed_windows_is_the_documents_next_token_loss():
    """heldout_loss with segments (batches of 2, the last one short) == lm_losses' next-token CE of the same
    windows with their documents (tests/test_packing.py holds that to the documents run one by one)."""
    from openk3.model import K3ForCausalLM
    from openk3.train.distributed import World
    from test_packing import SEGMENTS, tiny_config

    torch.manual_seed(0)
    model = K3ForCausalLM(tiny_config())
    windows = torch.randint(0, model.config.vocab_size, SEGMENTS.shape)
    got = loop.heldout_loss(model, windows, 2, torch.device("cpu"), None, World(), SEGMENTS)
    with torch.no_grad():
        model.eval()
        want = loop.lm_losses(model, windows, 0.0, SEGMENTS)[1]
    assert got == pytest.approx(float(want), rel=1e-6)
    assert same_document(SEGMENTS, 1).sum() < SEGMENTS[:, 1:].numel()  # labels were left out


def test_tensorboard_event_files_hold_the_metrics(tmp_path, monkeypatch, capsys):
    """A short CPU run with --tensorboard: every scalar of metrics.jsonl (MaxVio per layer as maxvio/<layer>, and
    MFU, with a stand-in GPU peak) is in the event files at its step with its value; the progress line shows MFU."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setattr(loop, "peak_flops", lambda device: 1e12)
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    board = tmp_path / "tb"
    args = tiny_args(tmp_path / "run", make_corpus(tmp_path / "data"), max_steps=3, eval_every=2,
                     tensorboard=str(board), progress=True)
    with one_thread():
        Trainer(args).run()
    assert "mfu=" in capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(board), size_guidance={"scalars": 0})
    events.Reload()
    want: dict[str, dict[int, float]] = {}
    per_token = flops_per_token(loop.model_config(args), args.seq_len)
    for r in records:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / 1e12)
        for key, value in r.items():
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for entry, number in items if key != "step" else []:
                want.setdefault(key if entry is None else f"{key}/{entry}", {})[r["step"]] = number
    assert {"loss", "mtp_loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "maxvio/1"} <= set(want)
    assert set(events.Tags()["scalars"]) == set(want)
    for tag, by_step in want.items():
        got = {e.step: e.value for e in events.Scalars(tag)}
        assert got.keys() == by_step.keys(), tag
        for step, value in by_step.items():
            assert got[step] == pytest.approx(value, rel=1e-6), (tag, step)  # stored as fp32



def test_the_first_line_names_the_threads_with_the_device(tmp_path, capsys):
    """`device=cpu (1 thread)`, next to the device (a QAT note came between them), and no "1 threads"."""
    trainer = Trainer(tiny_args(tmp_path / "run", make_corpus(tmp_path / "data"), device="cpu"))
    with one_thread():
        trainer._announce()
    assert "device=cpu (1 thread), processes=1" in capsys.readouterr().out
