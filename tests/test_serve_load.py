"""bench/serve_load.py against a real `openk3 serve` process (k3-tiny on the CPU, the byte-level tokenizer): its
counts agree with the usage the server returned, its latencies are ordered, its arrival processes keep their
schedule and concurrency, the agent workload grows its session and hits the prefix cache, failures are counted by
HTTP status, and bad input or an unreachable server gets one line. A minimal OpenAI-style server that knows neither
ignore_eos nor stream usage checks the generator's fallbacks; prompts cut by a BPE tokenizer have the asked length."""

import importlib.util
import json
import random
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from serve_process import metric, serve_process

BENCH = Path(__file__).resolve().parents[1] / "bench" / "serve_load.py"
spec = importlib.util.spec_from_file_location("serve_load", BENCH)
serve_load = sys.modules["serve_load"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(serve_load)


@pytest.fixture(scope="module")
def server():
    with serve_process("--preset", "k3-tiny", "--seed", "0") as (url, _):
        yield url


def check_report(report: dict) -> list[dict]:
    """What holds for every report: totals are the sums of the per-request usage, latencies are ordered, rates are
    totals over the duration, and the duration spans the requests."""
    done = [r for r in report["requests"] if r["status"] == "ok"]
    assert report["completed"] == len(done) and report["failed"] == len(report["requests"]) - len(done)
    assert report["prompt_tokens"] == sum(r["prompt_tokens"] or 0 for r in done)  # None: the server sent no usage
    assert report["output_tokens"] == sum(r["output_tokens"] for r in done)
    for r in done:
        assert 0 < r["ttft"] <= r["e2e"] and 1 <= r["chunks"] <= r["output_tokens"]
    assert report["tokens_per_chunk"] == pytest.approx(report["output_tokens"] / sum(r["chunks"] for r in done))
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = report[name]
        assert 0 <= d["p50"] <= d["p90"] <= d["p99"]
    assert report["ttft_s"]["p99"] <= report["e2e_s"]["p99"]
    over = [report["itl_over_s"][str(bound)] for bound in serve_load.ITL_BOUNDS_S]  # longer bounds, fewer gaps
    assert all(1 >= a >= b >= 0 for a, b in zip(over, over[1:]))
    spans = [(r["start"], r["start"] + r["e2e"]) for r in report["requests"]]
    assert report["duration_s"] == pytest.approx(max(e for _, e in spans) - min(s for s, _ in spans))
    duration = report["duration_s"]
    assert report["request_throughput"] == pytest.approx(len(done) / duration)
    assert report["output_tok_per_s"] == pytest.approx(report["output_tokens"] / duration)
    assert report["total_tok_per_s"] == pytest.approx((report["prompt_tokens"] + report["output_tokens"]) / duration)
    return done


def test_poisson_completions_count_what_the_server_reports(server):
    generated, received = metric(server, "generation_tokens_total"), metric(server, "requests_received_total")
    report = serve_load.run_load(server, request_rate=20, num_requests=6, prompt_len="40:90", output_len=5,
                                 tokenizer="bytes", temperature=0.8, top_p=0.95, slo="ttft=5,tpot=0.03", seed=1)
    assert report["completed"] == 6 and report["failures"] == {} and report["usage_reported"]
    probes = len(report["probe_usage"])  # of one token each
    assert metric(server, "requests_received_total") - received == 6 + probes
    assert metric(server, "generation_tokens_total") - generated == report["output_tokens"] + probes
    done = check_report(report)
    for r in done:
        assert 40 <= r["prompt_target"] <= 90
        assert r["prompt_tokens"] == r["prompt_local"]  # the bytes the server counted are the bytes sent
        assert r["output_tokens"] == r["output_target"] == 5  # ignore_eos: every reply runs to max_tokens
    good = [r for r in done if r["ttft"] <= 5 and r["tpot"] <= 0.03]
    assert report["goodput"]["requests"] == len(good)
    assert report["goodput"]["req_per_s"] == pytest.approx(len(good) / report["duration_s"])


def test_closed_loop_chat_holds_its_concurrency(server):
    report = serve_load.run_load(server, endpoint="chat", max_concurrency=2, num_requests=5, prompt_len=64,
                                 output_len=4)
    assert report["completed"] == 5
    done = check_report(report)
    assert report["tokens_per_char"] == pytest.approx(1.0, abs=0.05)  # bytes, calibrated on mostly-ASCII text
    for r in done:
        assert r["prompt_tokens"] > r["prompt_target"]  # the text (about 64 bytes) and the chat template
        assert r["output_tokens"] == 4
    starts = sorted(r["start"] for r in done)
    ends = sorted(r["start"] + r["e2e"] for r in done)
    in_flight = [sum(s <= t for s in starts) - sum(e <= t for e in ends) for t in starts]
    assert max(in_flight) == 2  # two clients ...
    for k, start in enumerate(starts[2:], 2):  # ... each sending its next request after its last one finished
        assert sum(end <= start for end in ends) >= k - 1


def test_fixed_rate_for_a_duration_from_the_command_line(server, tmp_path, capsys):
    out = tmp_path / "load.json"
    serve_load.main([server, "--request-rate", "5", "--arrival", "fixed", "--duration", "0.9", "--prompt-len", "32",
                     "--output-len", "2", "--no-progress", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["completed"] == 5  # arrivals at 0, 0.2, ..., 0.8 s
    check_report(report)
    starts = sorted(r["start"] for r in report["requests"])
    assert all(b - starts[0] >= 0.2 * i - 1e-3 for i, b in enumerate(starts))
    table = capsys.readouterr().out
    assert "5 finished, 0 failed" in table and "fixed 5.0/s" in table and "TTFT" in table


def test_agent_session_grows_and_reuses_its_prefix(server):
    hits = metric(server, "prefix_cache_hit_tokens_total")
    report = serve_load.run_load(server, workload="agent", agent_turns=3, prompt_len=200, agent_turn_len=30,
                                 output_len=4, tokenizer="bytes", seed=3)  # a seed of its own: new probe prompts
    probe_hits = sum(u["prompt_tokens_details"]["cached_tokens"] for u in report["probe_usage"])
    assert metric(server, "prefix_cache_hit_tokens_total") - hits == report["cached_tokens"] + probe_hits
    turns = sorted(report["requests"], key=lambda r: r["turn"])
    assert [r["turn"] for r in turns] == [1, 2, 3] and report["completed"] == 3
    check_report(report)
    assert turns[0]["prompt_tokens"] == turns[0]["prompt_local"]
    for before, after in zip(turns, turns[1:]):
        # the whole conversation again: the last prompt, its reply (some bytes), then the turn's new text
        assert after["prompt_tokens"] > before["prompt_tokens"] + after["prompt_local"]
        assert 0 < after["cached_tokens"] <= before["prompt_tokens"] + before["output_tokens"]
    assert [t["completed"] for t in report["turns"]] == [1, 1, 1]
    assert report["turns"][2]["cached_tokens"] == turns[2]["cached_tokens"]


def test_failures_are_counted_by_http_status(server):
    report = serve_load.run_load(server, num_requests=2, prompt_len=5000, output_len=2)
    assert report["completed"] == 0 and report["failures"] == {"413": 2}
    # the calibrating probe, first of about 5000 characters, was shortened into k3-tiny's 4096-token context
    assert 2048 <= report["probe_usage"][1]["prompt_tokens"] < 4096
    assert "--max-model-len" in report["failure_examples"]["413"]
    assert report["ttft_s"] is None and report["request_throughput"] == 0
    assert "2 x 413" in serve_load.format_report(report)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, words", [
    ([f"http://127.0.0.1:{closed_port()}"], "cannot reach"),
    (["http://127.0.0.1:9", "--prompt-len", "9:3"], "--prompt-len"),
    (["http://127.0.0.1:9", "--output-len", "many"], "--output-len"),
    (["http://127.0.0.1:9", "--slo", "ttfb=1"], "--slo"),
    (["http://127.0.0.1:9", "--duration", "5"], "--max-concurrency"),
    (["http://127.0.0.1:9", "--tokenizer", "/no/such/file"], "--tokenizer"),
])
def test_bad_input_and_an_unreachable_server_get_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_load.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err and err.count("\n") == 1


def test_help_explains_every_flag():
    p = serve_load.parser()
    assert all(action.help for action in p._actions)
    text = p.format_help()
    for flag in ("--request-rate", "--max-concurrency", "--prompt-len", "--workload", "--agent-turn-len", "--slo"):
        assert flag in text


@pytest.fixture(scope="module")
def plain_server():
    """A minimal OpenAI-style /v1/completions in this process: it refuses `ignore_eos` with a 400 (as OpenAI does
    an unknown field), counts two characters a prompt token, and streams max_tokens chunks of "ab" without a usage
    chunk. Yields (its URL, the prompt lengths its streamed requests had)."""
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app, received = FastAPI(), []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "plain", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if "ignore_eos" in body:
            return JSONResponse({"error": {"message": "Unrecognized request argument supplied: ignore_eos"}}, 400)
        if not body.get("stream"):
            usage = {"prompt_tokens": len(body["prompt"]) // 2, "completion_tokens": 1}
            return {"choices": [{"index": 0, "text": "ab", "finish_reason": "length"}], "usage": usage}
        received.append(len(body["prompt"]))
        chunk = json.dumps({"choices": [{"index": 0, "text": "ab", "finish_reason": None}]})
        events = [f"data: {chunk}\n\n"] * body["max_tokens"] + ["data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the plain server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", received
    server.should_exit = True
    thread.join(timeout=10)


def test_a_server_without_ignore_eos_or_stream_usage(plain_server):
    url, received = plain_server
    report = serve_load.run_load(url, max_concurrency=2, num_requests=4, prompt_len="10:50", output_len="3:9")
    assert report["completed"] == 4 and not report["ignore_eos"] and not report["usage_reported"]
    assert report["tokens_per_char"] == 0.5 and report["model"] == "plain"
    done = check_report(report)
    assert sorted(received) == sorted(2 * r["prompt_target"] for r in done)  # calibrated: 2 characters a token
    for r in done:
        assert r["prompt_tokens"] is None and r["output_tokens"] == r["chunks"] == r["output_target"]  # by chunk
    assert "ignore_eos refused" in serve_load.format_report(report)


def test_cyclic_matches_indexing_modulo_the_length():
    rng = random.Random(0)
    for _ in range(50):
        seq = [rng.randrange(9) for _ in range(rng.randint(1, 7))]
        start, n = rng.randrange(len(seq)), rng.randint(0, 30)
        assert serve_load.cyclic(seq, start, n) == [seq[(start + i) % len(seq)] for i in range(n)]
        assert serve_load.cyclic("".join(map(str, seq)), start, n) == "".join(str(x) for x in
                                                                               serve_load.cyclic(seq, start, n))


def test_prompts_cut_by_a_bpe_tokenizer_have_the_asked_length(tmp_path):
    from openk3.tokenizer import train_bpe

    corpus = serve_load.load_corpus(None)[:60_000]
    train_bpe([corpus], 320).save(tmp_path / "tokenizer.json")
    tok = serve_load.load_tokenizer(str(tmp_path))  # --tokenizer DIR: its tokenizer.json
    source, rng = serve_load.PromptSource(corpus, tok), random.Random(0)
    for n in (1, 2, 17, 500, 3 * len(source.ids) + 5):  # the last wraps around the corpus
        text, count = source.text(rng, n)
        assert count == len(tok.encode_plain(text)) and abs(count - n) <= 2  # re-encoding may merge at the edges
