"""OpenAI request fields against a real `openk3 serve` process, driven by the official openai client: stop strings
(also across tokens and while streaming), n choices with seeds (reproducible alone and under concurrency, sharing the
prompt through the prefix cache), logprobs in both shapes (equal to log_softmax of a direct forward of the same
checkpoint), presence / frequency penalties and logit bias (equal to a plain greedy loop with OpenAI's formula),
max_completion_tokens, 400s naming the fields the server does not implement, and /metrics' histograms (parsed with
prometheus_client's parser).

The checkpoint has O(1)-scale random weights (tests/random_weights.py) and the byte tokenizer: token ids are bytes
(ids 256-259 are control tokens), so a token's `bytes` give its id."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from openk3.tokenizer import ByteTokenizer, encode_chat
from serve_process import metric

MODEL = "k3-tiny"
H = 16  # the hash block of k3-tiny's context
VOCAB = ByteTokenizer.vocab_size  # the engine samples from the tokenizer's ids
LOGPROB_TOL = 2e-3  # fp32: the engine's chunked prefill and cached decode against one full forward


@pytest.fixture(scope="module")
def server(o1_server):
    return o1_server



@pytest.fixture(scope="module")
def model(o1_checkpoint_dir):
    from openk3.interop import load_pretrained

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_pretrained(o1_checkpoint_dir).eval()
    torch.set_num_threads(threads)


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), VOCAB]: log_softmax of one full forward's logits at each output position."""
    logits = model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1:, :VOCAB]
    return torch.log_softmax(logits.double(), dim=-1)


def token_id(name: str, raw: list[int] | None) -> int:
    """A byte-tokenizer token from its chat logprob entry (its one byte, or a control token's name)."""
    return ByteTokenizer.SPECIALS[name] if raw is None else raw[0]


def legacy_token_id(name: str) -> int:
    """A byte-tokenizer token from its legacy completions name ("bytes:\\xNN", one character, or a control name)."""
    if name.startswith("bytes:"):
        return int(name[len("bytes:\\x"):], 16)
    return ByteTokenizer.SPECIALS.get(name, ord(name) if len(name) == 1 else -1)


def completion(client, prompt, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True}, **kw)


def streamed_text(chunks, n=1) -> tuple[list[str], list[str]]:
    """(text, finish reason) of each choice from completion stream chunks."""
    texts, reasons = [""] * n, [None] * n
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return texts, reasons


def first_plain_pair(text: str) -> int:
    """Where two characters (two tokens or more) without U+FFFD occur first, past the start."""
    return next(i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i)


def test_stop_strings_across_tokens_and_while_streaming(client):
    prompt = "Stop strings: the reply ends before the first one."
    greedy = completion(client, prompt, max_tokens=30, temperature=0, logprobs=0).choices[0]
    text, offsets = greedy.text, greedy.logprobs.text_offset
    cut = first_plain_pair(text)
    stop = text[cut:cut + 2]
    for stops in (stop, [stop, "never in the text \u2603"]):
        r = completion(client, prompt, max_tokens=30, temperature=0, stop=stops, logprobs=0).choices[0]
        assert r.text == text[:cut] and r.finish_reason == "stop"
        # logprobs end with the last token whose text starts before the cut: the stop string's tokens are left out
        kept = sum(o < cut for o in offsets)
        assert r.logprobs.tokens == greedy.logprobs.tokens[:kept] and r.logprobs.text_offset == offsets[:kept]
        chunks = list(completion(client, prompt, max_tokens=30, temperature=0, stop=stops, stream=True, logprobs=0))
        assert streamed_text(chunks) == ([text[:cut]], ["stop"])  # no character of the stop string was streamed
        assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == greedy.logprobs.tokens[:kept]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True})
    reply = chat.choices[0].message.content
    cut = first_plain_pair(reply)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                            temperature=0, stop=[reply[cut:cut + 2]], stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_seeded_choices_are_reproducible_alone_and_under_concurrency(server, client):
    prompt = "Seeded choices: three samples of one prompt that spans a few hash blocks."
    kw = dict(max_tokens=8, temperature=1.0, seed=11)
    hits = metric(server, "prefix_cache_hit_tokens_total")
    alone = completion(client, prompt, n=3, **kw)
    texts = [c.text for c in sorted(alone.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(alone.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3 and all(c.finish_reason == "length" for c in alone.choices)
    assert alone.usage.completion_tokens == 24 and alone.usage.prompt_tokens == len(prompt.encode())
    # a fresh prompt: the first choice prefilled it, the other two were admitted after and hit its blocks
    assert metric(server, "prefix_cache_hit_tokens_total") - hits == 2 * H * ((len(prompt.encode()) - 1) // H)
    assert alone.usage.prompt_tokens_details.cached_tokens == 0  # the least any choice reused
    assert completion(client, prompt, n=1, **kw).choices[0].text == texts[0]  # choice 0 has the seed itself

    def same(stream: bool):
        if stream:
            return streamed_text(completion(client, prompt, n=3, stream=True, **kw), n=3)[0]
        return [c.text for c in sorted(completion(client, prompt, n=3, **kw).choices, key=lambda c: c.index)]

    def other(i):
        return completion(client, f"Another client, request {i}, samples too.", n=2, max_tokens=6, seed=i).usage

    with ThreadPoolExecutor(max_workers=7) as pool:
        mine = [pool.submit(same, stream) for stream in (False, True, False)]
        others = [pool.submit(other, i) for i in range(4)]
        assert [m.result() for m in mine] == [texts] * 3
        assert all(o.result().completion_tokens == 12 for o in others)


def test_logprobs_equal_log_softmax_of_a_direct_forward(client, model):
    messages = [{"role": "user", "content": "Report the logprobs of every token, please."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=3,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    output = [token_id(e.token, e.bytes) for e in content]
    assert len(output) == chat.usage.completion_tokens == 6
    reference = reference_logprobs(model, encode_chat(ByteTokenizer(), messages), output)
    for row, entry, token in zip(reference, content, output):
        assert abs(entry.logprob - row[token].item()) < LOGPROB_TOL
        assert len(entry.top_logprobs) == 3
        for alt in entry.top_logprobs:
            assert abs(alt.logprob - row[token_id(alt.token, alt.bytes)].item()) < LOGPROB_TOL
        assert abs(entry.top_logprobs[0].logprob - row.max().item()) < LOGPROB_TOL
    assert bytes(b for e in content for b in e.bytes or []).decode("utf-8", "replace") == \
        chat.choices[0].message.content

    prompt = "Legacy logprobs: tokens, token_logprobs, top_logprobs, text_offset."
    full = completion(client, prompt, max_tokens=6, temperature=1.0, seed=4, logprobs=2).choices[0]
    lp = full.logprobs
    output = [legacy_token_id(t) for t in lp.tokens]
    reference = reference_logprobs(model, list(prompt.encode()), output)
    for row, token, logprob, top in zip(reference, output, lp.token_logprobs, lp.top_logprobs):
        assert abs(logprob - row[token].item()) < LOGPROB_TOL
        assert 2 <= len(top) <= 3 and all(abs(v - row[legacy_token_id(t)].item()) < LOGPROB_TOL for t, v in top.items())
    assert lp.text_offset == sorted(lp.text_offset) and all(0 <= o < len(full.text) for o in lp.text_offset)
    chunks = list(completion(client, prompt, max_tokens=6, temperature=1.0, seed=4, logprobs=2, stream=True))
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens  # streamed: the same, in order
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset


@torch.no_grad()
def penalized_greedy(model, prompt: list[int], steps: int, presence: float, frequency: float,
                     bias: dict[int, float]) -> list[int]:
    """Greedy decoding by full forwards with OpenAI's logit adjustments written out token by token."""
    out: list[int] = []
    for _ in range(steps):
        logits = model(torch.tensor([prompt + out])).logits[0, -1, :VOCAB].tolist()
        adjusted = [mu + bias.get(j, 0.0) - out.count(j) * frequency - (presence if j in out else 0.0)
                    for j, mu in enumerate(logits)]
        out.append(max(range(VOCAB), key=adjusted.__getitem__))
    return out


def test_penalties_and_logit_bias_equal_a_plain_greedy_loop(client, model):
    prompt = "Penalties push repeated tokens down"
    bias = {65: 6.0, 66: 5.0, 10: -100.0}

    def served(**kw):
        r = completion(client, prompt, max_tokens=10, temperature=0, logprobs=0,
                       logit_bias={str(t): b for t, b in bias.items()}, **kw)
        return [legacy_token_id(t) for t in r.choices[0].logprobs.tokens]

    penalized = served(presence_penalty=1.5, frequency_penalty=2.0)
    assert penalized == penalized_greedy(model, list(prompt.encode()), 10, 1.5, 2.0, bias)
    plain = served()
    assert plain == penalized_greedy(model, list(prompt.encode()), 10, 0.0, 0.0, bias)
    assert plain != penalized and max(plain.count(t) for t in set(plain)) > max(map(penalized.count, penalized))


def test_max_completion_tokens_wins_on_both_endpoints(client):
    r = client.completions.create(model=MODEL, prompt="limits", max_tokens=9,
                                  extra_body={"ignore_eos": True, "max_completion_tokens": 3})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "limits"}],
                                       max_completion_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def post(server, path, **fields):
    base = {"model": MODEL, "max_tokens": 1}
    base.update({"messages": [{"role": "user", "content": "x"}]} if path == CHAT else {"prompt": "x"})
    return httpx.post(f"{server}{path}", json={**base, **fields}, timeout=60)


@pytest.mark.parametrize("path, field, value", [
    (CHAT, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    (CHAT, "tool_choice", "auto"),
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "function_call", "auto"),
    (CHAT, "parallel_tool_calls", True),
    (CHAT, "response_format", {"type": "json_object"}),
    (CHAT, "response_format", {"type": "text", "strict": True}),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "prediction", {"type": "content", "content": "x"}),
    (CHAT, "web_search_options", {}),
    (COMPLETIONS, "echo", True),
    (COMPLETIONS, "suffix", "tail"),
    (COMPLETIONS, "best_of", 2),
])
def test_unsupported_fields_get_a_400_naming_them(server, path, field, value):
    r = post(server, path, **{field: value})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": f"{field} is not supported by this server", "type": "invalid_request_error",
                                 "param": field, "code": "unsupported_parameter"}


def test_unused_values_of_unsupported_fields_and_unknown_fields_are_accepted(server, client):
    for path, fields in ((CHAT, {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                                 "modalities": ["text"], "parallel_tool_calls": None, "functions": None}),
                         (COMPLETIONS, {"echo": False, "suffix": None, "best_of": 1}),
                         (CHAT, {"user": "u-1", "metadata": {"k": "v"}, "store": False, "vendor_extra": [1]})):
        assert post(server, path, **fields).status_code == 200, fields
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert err.value.param == "tools" and err.value.code == "unsupported_parameter"


@pytest.mark.parametrize("path, fields, param", [
    (COMPLETIONS, {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (COMPLETIONS, {"stop": ["a", 1]}, "stop.1"),  # the element at fault
    (COMPLETIONS, {"n": 0}, "n"),
    (COMPLETIONS, {"logprobs": 6}, "logprobs"),
    (COMPLETIONS, {"logprobs": True}, "logprobs"),
    (CHAT, {"logprobs": 2}, "logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (COMPLETIONS, {"presence_penalty": 2.5}, "presence_penalty"),
    (CHAT, {"frequency_penalty": -2.01}, "frequency_penalty"),
    (COMPLETIONS, {"frequency_penalty": "1"}, "frequency_penalty"),
    (COMPLETIONS, {"logit_bias": {"260": 1}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"a": 1}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"-1": 1}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"65": 100.5}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"65": "1"}}, "logit_bias.65"),
    (CHAT, {"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
    (COMPLETIONS, {"max_completion_tokens": 10**9}, "max_completion_tokens"),
])
def test_bad_values_of_the_new_fields_get_a_400_naming_them(server, path, fields, param):
    r = post(server, path, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def histograms(server) -> dict[str, dict[str, float]]:
    """The histograms of /metrics, parsed: name -> {"count", "sum", "buckets": [(le, cumulative count)]}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{server}/metrics", timeout=10).text):
        if family.type == "histogram":
            samples = {s.name[len(family.name) + 1:]: s for s in family.samples if not s.name.endswith("_bucket")}
            buckets = [(float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket")]
            out[family.name] = {"count": samples["count"].value, "sum": samples["sum"].value, "buckets": buckets}
    return out


def test_metrics_histograms_count_every_request(server, client):
    before = histograms(server)
    assert set(before) == {"openk3_time_to_first_token_seconds", "openk3_inter_token_latency_seconds",
                           "openk3_e2e_request_latency_seconds"}
    received = metric(server, "requests_received_total")
    completion(client, "metrics, two choices", n=2, max_tokens=3, seed=1)
    list(completion(client, "metrics, streamed", max_tokens=4, stream=True))
    body = {"model": MODEL, "prompt": "metrics, a bad request", "tools": []}
    assert httpx.post(f"{server}{COMPLETIONS}", json={**body, "echo": True}, timeout=30).status_code == 400
    after = histograms(server)
    # two requests: two first tokens, (3 - 1) * 2 + (4 - 1) gaps between tokens, two ends; the 400 never ran
    expected = {"openk3_time_to_first_token_seconds": 2, "openk3_inter_token_latency_seconds": 7,
                "openk3_e2e_request_latency_seconds": 2}
    for name, added in expected.items():
        assert after[name]["count"] - before[name]["count"] == added, name
        assert after[name]["sum"] > before[name]["sum"]
        counts = [c for _, c in after[name]["buckets"]]
        assert counts == sorted(counts) and after[name]["buckets"][-1] == (float("inf"), after[name]["count"])
    assert metric(server, "requests_received_total") - received == 3  # engine requests: one per choice
    assert httpx.get(f"{server}/metrics", timeout=10).headers["content-type"].startswith("text/plain")
