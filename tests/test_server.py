"""`openk3 serve` end to end: a real uvicorn server process on 127.0.0.1, driven by the official openai client.

The server loads a k3-tiny checkpoint with O(1)-scale random weights, so its greedy text depends on the whole
context and the cache-on / cache-off comparisons below (a hit vs the first miss, and against a second server
with --no-prefix-cache) would catch a wrong restored state. Logits themselves are compared in test_engine.py."""

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serve_process import metric, serve_process

MODEL = "k3-tiny"
H = 16  # the default hash block for k3-tiny's context


@pytest.fixture(scope="module")
def server(o1_server):
    return o1_server



def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert httpx.head(f"{server}/health").status_code == 200  # load balancers probe with HEAD
    text = httpx.get(f"{server}/metrics").text
    for name in ("requests_received_total", "generation_tokens_total", "queue_requests",
                 "prefix_cache_queried_tokens_total", "prefix_cache_hit_tokens_total", "engine_step_seconds_total",
                 "engine_slowest_step_seconds", "engine_prefill_forwards_total", "prefix_cache_evicted_pages_total",
                 "prefix_cache_dropped_checkpoints_total"):
        assert f"# TYPE openk3_{name}" in text


def test_completion_is_deterministic_and_reports_the_prefix_hit(client):
    prompt = "The hybrid prefix cache keeps KDA checkpoints at every hash block boundary."
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert first.choices[0].text == again.choices[0].text and first.choices[0].finish_reason == "length"
    assert first.usage.prompt_tokens == len(prompt.encode()) and first.usage.completion_tokens == 4
    assert again.usage.prompt_tokens_details.cached_tokens == H * ((len(prompt.encode()) - 1) // H)


def test_multi_turn_chat_hits_the_previous_turn(client):
    messages = [{"role": "system", "content": "You are a terse agent that calls tools."},
                {"role": "user", "content": "List the files in the repository, please."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "tool", "content": "README.md src tests bench"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= H * ((reply.usage.prompt_tokens - 1) // H) > 0


def test_streaming_matches_the_full_reply(client):
    prompt = "Stream this reply token by token"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": prompt}]
    chat_full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        chat_full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6


def test_sse_wire_format_ends_with_done(server):
    body = {"model": MODEL, "prompt": "wire", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("body, status, param", [
    (b'{"model": "k3-tiny", "prompt": ', 400, None),
    (b'[1, 2]', 400, None),
    ({"prompt": "no model"}, 400, "model"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "n": 129}, 400, "n"),
    ({"model": MODEL, "prompt": "x" * 5000}, 413, "prompt"),
    ({"model": "gpt-4o", "prompt": "x"}, 404, "model"),
])
def test_bad_completion_requests_get_openai_errors(server, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server}/v1/completions", headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_bad_chat_requests_and_the_server_keeps_serving(server, client):
    for body in ({"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"role": "user"}]},
                 {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                 {"model": MODEL, "messages": "hi"}):
        r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still up?"}],
                                        max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_disconnect_mid_stream_frees_the_sequence(server):
    cancelled = metric(server, 'requests_finished_total{reason="cancelled"}')
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 60
    while metric(server, 'requests_finished_total{reason="cancelled"}') == cancelled:
        assert time.monotonic() < deadline, "the abandoned stream kept running"
        time.sleep(0.2)
    assert metric(server, "running_requests") == 0


def test_bounded_concurrent_load(server, client):
    prompts = [f"Session {i}: the agent reads a tool result and answers." for i in range(4)]

    def ask(prompt):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage.completion_tokens

    expected = {p: ask(p) for p in prompts}
    jobs = [prompts[(c + k) % len(prompts)] for c in range(32) for k in range(4)]  # 32 clients x 4 requests
    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(ask, jobs))
    assert results == [expected[p] for p in jobs]
    assert metric(server, "queue_requests") == 0


def test_a_server_without_prefix_cache_gives_the_same_replies(o1_checkpoint_dir, client):
    """Multi-turn agent sessions: the cached server (hits from the second turn on) and a --no-prefix-cache server
    answer every turn with the same greedy text."""
    def session(c, s):
        messages, replies, hits = [{"role": "system", "content": "You are a terse agent that calls tools."}], [], []
        for turn in range(3):
            messages.append({"role": "user" if turn == 0 else "tool", "content": f"session {s} result {turn}: ok"})
            r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            replies.append(r.choices[0].message.content)
            hits.append(r.usage.prompt_tokens_details.cached_tokens)
        return replies, hits

    with serve_process("--ckpt", o1_checkpoint_dir, "--model-name", MODEL, "--no-prefix-cache") as (url, ready):
        assert ready.startswith(f"openk3 serve: ready at {url}/v1 ") and "prefix cache off" in ready
        off = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(max_workers=4) as pool:
            on_runs = list(pool.map(lambda s: session(client, s), range(2)))
            off_runs = list(pool.map(lambda s: session(off, s), range(2)))
    assert [replies for replies, _ in on_runs] == [replies for replies, _ in off_runs]
    assert all(hits[1] > 0 and hits[2] > hits[1] for _, hits in on_runs)
    assert all(hits == [0, 0, 0] for _, hits in off_runs)


def serve_args(*argv):
    import argparse

    from openk3.serve.command import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_ckpt_loads_its_weights_and_tokenizer_json(tmp_path):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from openk3.config import get_preset
    from openk3.interop import save_pretrained
    from openk3.model import K3ForCausalLM
    from openk3.serve.command import build_engine
    from openk3.tokenizer import ByteTokenizer, TextTokenizer, load_tokenizer

    torch.manual_seed(1)
    cfg = get_preset(MODEL).with_overrides({"num_layers": 4, "mla_layers": [1, 3]})
    model = K3ForCausalLM(cfg).eval()
    save_pretrained(model, tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path), cfg.vocab_size), ByteTokenizer)  # no tokenizer.json yet
    with pytest.raises(ValueError):
        load_tokenizer(None, ByteTokenizer.vocab_size - 1)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(["hello world, the agent calls a tool"] * 10,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    tok.save(str(tmp_path / "tokenizer.json"))
    ids = torch.tensor([[1, 2, 3, 4]])
    threads = torch.get_num_threads()
    try:
        engine, name = build_engine(serve_args("--ckpt", str(tmp_path), "--device", "cpu", "--threads", "1"))
        with torch.no_grad():
            same = torch.equal(engine.model(ids).logits, model(ids).logits)
    finally:
        torch.set_num_threads(threads)
    assert same and name == tmp_path.name
    assert isinstance(engine.tokenizer, TextTokenizer)
    assert engine.stop_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    assert engine.tokenizer.encode("<|im_start|>") == [tok.token_to_id("<|im_start|>")]
    assert tok.token_to_id("<|im_start|>") not in engine.tokenizer.encode_plain("<|im_start|>")


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield str(s.getsockname()[1])


@pytest.mark.parametrize("argv, flag", [
    (["--port", "99999"], "--port"), (["--port", "-1"], "--port"), (["--port", "http"], "--port"),
    (["--host", "not a host!"], "--host"), (["--host", "999.1.1.1"], "--host"),
    (["--host", "192.0.2.1"], "--host"),  # a documentation address: valid, but not this machine's
    (["--port", "BUSY"], "--port"),
])
def test_a_bad_address_fails_in_one_line_before_the_model_loads(argv, flag, busy_port, capsys, monkeypatch):
    from openk3.cli import main
    from openk3.serve import command

    monkeypatch.setattr(command, "build_engine", lambda args: pytest.fail("the model loaded"))
    try:
        code = main(["serve", *[busy_port if a == "BUSY" else a for a in argv]])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("openk3 serve: error: ") and err.count("\n") == 1 and flag in err, err
