"""The commands' edges: bad flags and inputs end with one line naming the flag (argparse, or a ValueError raised
before any model loads), --help shows the defaults, and `openk3 serve` stops cleanly on SIGINT / SIGTERM."""

import os
import select
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from openk3.cli import main
from openk3.config import get_preset
from openk3.interop import config_to_k3
from openk3.interop.files import write_config
from openk3.tokenizer import TextTokenizer, train_bpe
from serve_process import READY


def config_only_checkpoint(path, with_tokenizer: bool = True):
    """A k3-tiny checkpoint directory without weights: a command that got as far as loading them would fail."""
    path.mkdir(parents=True)
    write_config(path, config_to_k3(get_preset("k3-tiny")))
    if with_tokenizer:
        train_bpe(["x y z " * 50, "hello world " * 50], 300).save(path / "tokenizer.json")
    return path


def error_of(argv, capsys) -> str:
    """The one-line error of a command that must fail with exit code 2 (argparse's SystemExit or main's return)."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---- tokenizer and --config files ------------------------------------------------------------------------------

def test_a_file_that_is_not_a_tokenizer_json_is_named(tmp_path, capsys):
    bad = tmp_path / "notes.txt"
    bad.write_text("not json at all")
    with pytest.raises(ValueError, match="notes.txt is not a tokenizer.json"):
        TextTokenizer.from_file(bad)
    ckpt = config_only_checkpoint(tmp_path / "ckpt")
    err = error_of(["generate", "--ckpt", str(ckpt), "--prompt", "x", "--tokenizer", str(bad)], capsys)
    assert "notes.txt is not a tokenizer.json" in err


@pytest.mark.parametrize("overrides, message", [
    ([1, 2], "must be a JSON object of fields, got [1, 2]"),
    ({"moe": {"num_experts": "8"}}, "'moe.num_experts' must be an integer, got '8'"),
    ({"moe": 5}, "'moe' must be an object of its fields or null, got 5"),
    ({"mla_layers": [3, "7"]}, "'mla_layers' must be a list of integers"),
    ({"tie_embeddings": 1}, "'tie_embeddings' must be true or false"),
    ({"max_seq_len": 1.5}, "'max_seq_len' must be an integer"),
])
def test_config_overrides_of_the_wrong_type_name_the_field(overrides, message):
    with pytest.raises(ValueError) as err:
        get_preset("k3-tiny").with_overrides(overrides)
    assert message in str(err.value)


def test_config_overrides_that_fit_the_types():
    cfg = get_preset("k3-tiny").with_overrides({"kda": {"gate_lower_bound": -4}, "moe": None, "mla_layers": [3]})
    assert cfg.kda.gate_lower_bound == -4 and cfg.moe is None and cfg.mla_layers == (3,)


@pytest.mark.parametrize("text, message", [
    ("{bad", "is not valid JSON"),
    ("[1, 2]", ": config overrides must be a JSON object"),
    ('{"moe": {"num_experts": "8"}}', ": config field 'moe.num_experts' must be an integer"),
])
def test_config_file_errors_name_the_flag_and_the_file(tmp_path, text, message):
    path = tmp_path / "model.json"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        get_preset("k3-tiny").with_config_file(path)
    assert str(err.value).startswith(f"--config {path}") and message in str(err.value)


# ---- generate --------------------------------------------------------------------------------------------------

def test_serve_names_a_weights_file_the_engine_process_cannot_open(tmp_path, capfd):
    """An OSError while the engine process builds the model (here the weights file is a directory) is one line
    naming the file, as the CLI's own input errors are (it logged a traceback)."""
    write_config(tmp_path, config_to_k3(get_preset("k3-tiny")))
    (tmp_path / "model.safetensors").mkdir()
    err = error_of(["serve", "--port", "0", "--ckpt", str(tmp_path)], capfd)
    assert f"{tmp_path / 'model.safetensors'} cannot be opened" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine or torch build without CUDA")
@pytest.mark.parametrize("flags, message", [
    (["--device", "cuda"], "--device cuda: this machine or torch build has no CUDA GPU; use --device cpu"),
    (["--device", "tpu"], "--device tpu: openk3 runs on cpu or cuda"),
    (["--kda-backend", "triton"], "--kda-backend triton needs a CUDA device"),
])
def test_generate_refuses_devices_it_cannot_use(tmp_path, capsys, flags, message):
    ckpt = config_only_checkpoint(tmp_path / "ckpt")
    assert message in error_of(["generate", "--ckpt", str(ckpt), "--prompt", "x", *flags], capsys)


def test_generate_keeps_prompt_and_reply_inside_the_context(tmp_path, capsys):
    """As the server: a prompt that fills k3-tiny's 4096 tokens is refused (its 413), and so is a reply that could
    run past them (its 400), before the weights load."""
    ckpt = config_only_checkpoint(tmp_path / "ckpt")
    err = error_of(["generate", "--ckpt", str(ckpt), "--prompt", "x " * 5000], capsys)
    assert "--prompt has" in err and "the model's context holds 4096" in err
    err = error_of(["generate", "--ckpt", str(ckpt), "--prompt", "hello", "--max-new-tokens", "5000"], capsys)
    assert "--max-new-tokens 5000 and the prompt's" in err and "context of 4096 tokens" in err
    assert "--prompt is empty" in error_of(["generate", "--ckpt", str(ckpt), "--prompt", ""], capsys)


@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "-1", "must be at least 0"),
    ("--temperature", "nan", "must be at least 0"),
    ("--top-p", "0", "must be in (0, 1]"),
    ("--top-p", "1.5", "must be in (0, 1]"),
    ("--top-k", "-3", "must be at least 0"),
    ("--max-new-tokens", "0", "must be at least 1"),
])
def test_generate_sampling_flags_are_checked_by_argparse(capsys, flag, value, message):
    err = error_of(["generate", "--ckpt", "missing", "--prompt", "x", flag, value], capsys)
    assert f"argument {flag}: {message}" in err


def test_generate_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 0.8)" in out and "(default: 0.95)" in out and "(default: 200)" in out
    assert "--prompt PROMPT the text to continue" in out


# ---- export, info ----------------------------------------------------------------------------------------------

def test_export_refuses_a_training_run_or_other_files_as_out(tmp_path, capsys):
    source = config_only_checkpoint(tmp_path / "ckpt")
    run = tmp_path / "run"
    (run / "step-000010").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    for flags in ([], ["--overwrite"]):
        err = error_of(["export", "--ckpt", str(source), "--out", str(run), *flags], capsys)
        assert "holds other files than a checkpoint's (metrics.jsonl, step-000010)" in err
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "step-000010"]  # untouched
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "tokenizer.json").write_text("{}")
    err = error_of(["export", "--ckpt", str(source), "--out", str(earlier)], capsys)
    assert "pass --overwrite" in err
    (tmp_path / "file").write_text("")
    assert "is a file" in error_of(["export", "--ckpt", str(source), "--out", str(tmp_path / "file")], capsys)


def test_export_hub_layout_advice_names_the_flag(tmp_path, capsys):
    source = config_only_checkpoint(tmp_path / "ckpt")
    err = error_of(["export", "--ckpt", str(source), "--out", str(tmp_path / "out"), "--layout", "hub"], capsys)
    assert err.startswith("openk3 export: error: --layout hub: the Kimi Linear hub layout cannot express")
    assert err.endswith("export with --layout k3 instead") and "layout='k3'" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["0", "-5"])
def test_info_context_must_be_positive(capsys, value):
    assert "argument --context: must be at least 1" in error_of(["info", "--context", value], capsys)


def test_info_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["info", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: k3-tiny)" in out and "(default: 1048576)" in out


# ---- serve options ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--host-cache-mb", "-5"], "argument --host-cache-mb: must be at least 0"),
    (["--disk-cache-mb", "-1"], "argument --disk-cache-mb: must be at least 0"),
    (["--cache-mb", "-1"], "argument --cache-mb: must be above 0"),
    (["--hash-block", "0"], "argument --hash-block: must be at least 1"),
    (["--threads", "-1"], "argument --threads: must be at least 0"),
    (["--max-queue", "-1"], "argument --max-queue: must be at least 1"),
    (["--kv-pages", "0"], "argument --kv-pages: must be at least 2"),
    (["--checkpoint-every", "0"], "argument --checkpoint-every: must be at least 1"),
    (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be in (0, 1]"),
    (["--page-size", "7"], "--page-size 7 must be a multiple of the hash block (16, --hash-block)"),
    (["--page-size", "48", "--hash-block", "32"], "--page-size 48 must be a multiple of the hash block (32"),
    (["--disk-cache-dir", "d"], "--disk-cache-dir needs a host tier above it: set --host-cache-mb too"),
])
def test_serve_options_are_checked_before_the_model_loads(capsys, flags, message):
    assert message in error_of(["serve", "--port", "0", *flags], capsys)


def test_serve_disk_cache_dir_must_be_a_directory(tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("")
    err = error_of(["serve", "--port", "0", "--host-cache-mb", "8", "--disk-cache-dir", str(file)], capsys)
    assert f"--disk-cache-dir {file}: cannot use it as a directory" in err


@pytest.mark.parametrize("name, message", [("missing", "missing does not exist"),
                                           ("empty", "empty is neither a checkpoint (no config.json) nor a run")])
def test_serve_checks_the_checkpoint_before_the_engine_process_starts(tmp_path, capfd, name, message):
    """A --ckpt that is no checkpoint is one line (capfd: the engine process would log a traceback to fd 2)."""
    (tmp_path / "empty").mkdir()
    assert message in error_of(["serve", "--port", "0", "--ckpt", str(tmp_path / name)], capfd)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine or torch build without CUDA")
@pytest.mark.parametrize("flags, message", [
    (["--kernels", "triton"], "--kernels triton needs a CUDA device (Triton has no CPU driver); use --kernels auto"),
    (["--kda-backend", "triton"], "--kda-backend triton needs a CUDA device"),
    (["--device", "cuda"], "--device cuda: this machine or torch build has no CUDA GPU"),
])
def test_serve_refuses_cuda_only_settings_on_cpu(capsys, flags, message):
    assert message in error_of(["serve", "--port", "0", *flags], capsys)


def test_serve_help_has_usage_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: openk3 serve [-h]")
    for flag, default in (("--seed", 0), ("--max-queue", 1024), ("--host-cache-mb", 0), ("--disk-cache-mb", 1024),
                          ("--threads", 0), ("--log-level", "warning"), ("--kernels", "auto")):
        help_text = out.split(f" {flag} ", 1)[1].split(" --", 1)[0]
        assert f"(default: {default})" in help_text, (flag, help_text)


# ---- serve shutdown --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_cleanly_on_a_signal_to_its_process_group(sig):
    """Ctrl-C in a terminal (SIGINT) or a supervisor's SIGTERM reaches the server and its engine process alike: the
    server shuts down, stops the engine (an INFO line, no ERROR), and exits 0 without a traceback or triton's
    "nanobind: leaked" lines."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "openk3", "serve", "--host", "127.0.0.1", "--port", "0",
                                 "--threads", "1", "--log-level", "info"], stdout=subprocess.PIPE, stderr=log,
                                text=True, start_new_session=True)
        try:
            line, deadline = "", time.monotonic() + 180
            while not line.startswith(READY):
                left = deadline - time.monotonic()
                assert proc.poll() is None and left > 0 and select.select([proc.stdout], [], [], left)[0]
                line = proc.stdout.readline()
            os.killpg(proc.pid, sig)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        output = log.read().decode() + proc.stdout.read()
    assert code == 0, output[-4000:]
    assert "the engine process stopped (exit code 0)" in output
    for bad in ("Traceback", "leaked", "ERROR"):
        assert bad not in output, output[-4000:]



def test_generate_refuses_a_tokenizer_larger_than_the_vocabulary(tmp_path, capsys):
    """Its ids past the embedding table failed inside the model (on a GPU: a device-side assert)."""
    path = tmp_path / "small-vocab"
    path.mkdir()
    tokenizer = train_bpe(["x y z " * 50, "hello world " * 50], 300)
    tokenizer.save(path / "tokenizer.json")
    vocab = tokenizer.vocab_size - 1
    write_config(path, config_to_k3(get_preset("k3-tiny").with_overrides({"vocab_size": vocab})))
    err = error_of(["generate", "--ckpt", str(path), "--prompt", "x"], capsys)
    assert f"has {tokenizer.vocab_size} ids, the model's vocabulary {vocab}" in err


def test_serving_a_checkpoint_without_its_tokenizer_warns(tmp_path, capsys):
    """save_pretrained writes no tokenizer.json: such a checkpoint is served byte by byte, which is wrong text for a
    model trained with a tokenizer, so the start-up says so; a random-init preset (no checkpoint) does not."""
    from openk3.cli import build_parser
    from openk3.interop import save_pretrained
    from openk3.model import K3ForCausalLM
    from openk3.serve.command import build_engine

    save_pretrained(K3ForCausalLM(get_preset("k3-tiny")), tmp_path / "bare")
    for source, warned in ((["--ckpt", str(tmp_path / "bare")], True), (["--preset", "k3-tiny"], False)):
        build_engine(build_parser().parse_args(["serve", *source, "--threads", "1"]))
        err = capsys.readouterr().err
        assert ("has no tokenizer.json, so text is read and written byte by byte (ids 0-259 of the model's 4096)"
                in err) is warned, err
