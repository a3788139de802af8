"""The engine in a process of its own (openk3.serve.core.ProcessCore, `openk3 serve`'s default) against the same
engine on a thread of the server's process (LocalCore, `--no-engine-process`): the same greedy and seeded texts,
`n` choices, refusals and metrics through the same app; a dead engine process turns /health to 503 and fails the
open and the next requests instead of hanging them."""

import argparse
import time

import httpx
import pytest

from openk3.serve.command import add_serve_parser, build_engine, engine_description
from openk3.serve.core import ProcessCore
from serve_process import inprocess_server

ARGS = ["--preset", "k3-tiny", "--device", "cpu", "--threads", "1", "--seed", "3"]


def serve_args(*argv):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def replies(url: str) -> list:
    """Greedy, seeded-sampled and n = 2 completions, and two refusals: what the two cores must agree on."""
    out = []
    for body in ({"prompt": "def parse(", "max_tokens": 12, "temperature": 0},
                 {"prompt": "import os", "max_tokens": 10, "temperature": 1.0, "seed": 7},
                 {"prompt": "class A:", "max_tokens": 6, "temperature": 0.9, "seed": 11, "n": 2}):
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", **body}, timeout=60)
        assert r.status_code == 200, r.text
        out.append([(c["text"], c["finish_reason"]) for c in r.json()["choices"]])
    too_long = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": [5] * 5000, "max_tokens": 2},
                          timeout=60)
    bad_ids = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": [1, 10**6], "max_tokens": 2},
                         timeout=60)
    out.append((too_long.status_code, bad_ids.status_code, bad_ids.json()["error"]["message"]))
    return out


@pytest.fixture
def process_core():
    """A fresh engine process (the app's shutdown stops the core it served)."""
    core, name = ProcessCore.start_process(serve_args(*ARGS), build_engine, engine_description)
    assert name == "k3-tiny" and "capacity" in core.info.ready and core.alive()
    yield core
    if core.process.is_alive():
        core.stop()


def test_engine_process_serves_what_the_engine_thread_serves(process_core):
    engine, _ = build_engine(serve_args(*ARGS))
    with inprocess_server(engine, "m") as url:
        local = replies(url)
    with inprocess_server(process_core, "m") as url:
        assert replies(url) == local
        assert local[-1][:2] == (413, 400)
        text = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'openk3_requests_finished_total{reason="length"} 4.0' in text  # the snapshot came back


def test_a_dead_engine_process_fails_requests_instead_of_hanging(process_core):
    with inprocess_server(process_core, "m") as url:
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
        process_core.process.kill()
        process_core.process.join(10)
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def test_engine_that_cannot_be_built_fails_start_up_in_one_line():
    with pytest.raises(ValueError, match="unknown preset 'nosuch'"):
        ProcessCore.start_process(serve_args("--preset", "nosuch", "--device", "cpu"), build_engine, engine_description)


def test_start_up_prints_the_engine_phases_that_took_time(monkeypatch, capsys):
    """`openk3 serve` prints the engine's start-up phases (on a GPU: the prefill warm-up, the prefill and decode
    graphs, each with its compiling): here the runner's decode capture, made to report 1.25 s, and nothing for the
    phases that did not run on the CPU."""
    from openk3.serve.runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "capture", lambda self: 1.25)
    engine, _ = build_engine(serve_args(*ARGS))
    line = [x for x in capsys.readouterr().err.splitlines() if "engine started" in x]
    assert engine.startup_seconds == {"decode graphs": 1.25}
    assert line == ["openk3 serve: engine started in 1.2 s (decode graphs 1.2 s)"]
