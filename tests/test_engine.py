"""The continuous-batching engine with the K3 prefix cache, on a small random hybrid model (CPU).

The model's weights are O(1)-scale (tests/random_weights.py), so its logits depend on the whole context; with the
default init (std 0.02) greedy ids barely do. The cache-on / cache-off comparisons check every sampled logits row
against a plain full forward of the same tokens, not only the ids."""

import gc
import random
from collections import defaultdict

import pytest
import torch

from openk3.config import get_preset
from openk3.model import K3ForCausalLM
from openk3.sampling import TEMPERATURE_FLOOR, SamplingParams, sample_token
from openk3.serve.engine import Engine, EngineConfig, ragged_groups
from openk3.serve.scheduler import QueueFull, SchedulerConfig
from openk3.tokenizer import ByteTokenizer
from random_weights import randomise

H = 16  # hash block of the tests' engines


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster and leaves the shared cores alone
    torch.manual_seed(0)
    cfg = get_preset("k3-tiny").with_overrides({"num_layers": 4, "mla_layers": [1, 3], "max_seq_len": 512,
                                                "mtp_layers": 0})
    model = K3ForCausalLM(cfg)
    randomise(model, seed=0)
    yield model.eval()
    torch.set_num_threads(threads)


TOL = 1e-4  # fp32: chunking, batching and restored cache states change only the round-off


def record_logits(engine) -> dict[str, list[torch.Tensor]]:
    """Every logits row the engine samples a token from, by request id (wraps the engine's `_sampler`: a row is
    recorded when its token is drawn)."""
    seen, sampler = defaultdict(list), engine._sampler

    def recording(requests, logits):
        draw = sampler(requests, logits)

        def sample(row):
            seen[requests[row].rid].append(logits[row].detach().float().clone())
            return draw(row)

        return sample

    engine._sampler = recording
    return seen


@torch.no_grad()
def reference_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: the logits each output token was sampled from, by one full forward without a cache."""
    logits = model(torch.tensor([prompt + output[:-1]])).logits[0]
    return logits[len(prompt) - 1:]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL) -> None:
    err = (actual - expected).abs().max().item()
    assert err <= tol * max(1.0, expected.abs().max().item()), f"max |diff| {err}"


def make_engine(model, prefix_cache=True, **kw):
    sched = kw.pop("scheduler", SchedulerConfig(max_running=8))
    return Engine(model, ByteTokenizer(), EngineConfig(prefix_cache=prefix_cache, hash_block=H, page_size=4 * H,
                                                       scheduler=sched, **kw))


def drain(engine, max_steps=10_000):
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def conversations(engine, sessions=3, turns=3, stagger=True, seed=0):
    """Agent-style sessions over a shared system prompt; each turn appends the reply and a tool result. Sessions
    run concurrently; with `stagger`, session s starts s steps late so batches mix prefill and decode. Returns
    {(session, turn): ...} of outputs, cache hits, prompts and the sampled logits rows ([n_out, V])."""
    seen = record_logits(engine)
    logits = {}
    rng = random.Random(seed)
    tok = ByteTokenizer()
    system = tok.encode("system: you are a careful agent with tools. ")
    history = {s: list(system) for s in range(sessions)}
    outputs, cached, prompts = {}, {}, {}
    for turn in range(turns):
        requests = {}
        for s in range(sessions):
            history[s] += tok.encode(f"tool[{s}.{turn}]: " + "".join(rng.choice("abcdef") for _ in range(9)))
            requests[s] = engine.add_request(list(history[s]), SamplingParams(max_tokens=5, temperature=0))
            if stagger:
                engine.step()
        drain(engine)
        for s, r in requests.items():
            outputs[s, turn], cached[s, turn], prompts[s, turn] = list(r.output), r.cached_tokens, r.prompt
            logits[s, turn] = torch.stack(seen[r.rid])
            history[s] += r.output
    return outputs, cached, prompts, logits


def test_logits_identical_with_and_without_prefix_cache_and_later_turns_hit(model):
    on = make_engine(model)
    out_on, cached, prompts, logits_on = conversations(on)
    out_off, cached_off, _, logits_off = conversations(make_engine(model, prefix_cache=False))
    assert out_on == out_off
    for key, logits in logits_on.items():  # every sampled row, both ways, equals a full forward of the same tokens
        reference = reference_logits(model, prompts[key], out_on[key])
        assert_close(logits, reference)
        assert_close(logits_off[key], reference)
    assert all(c == 0 for c in cached_off.values())
    for (s, turn), c in cached.items():
        if turn > 0:  # the previous turn's prompt and reply (all but the last token, never fed) are reused
            fed_before = len(prompts[s, turn - 1]) + len(out_on[s, turn - 1]) - 1
            assert c == H * (fed_before // H) > 0
        elif s > 0:  # session s started after session 0 had written the shared system prompt
            shared = next(i for i, (a, b) in enumerate(zip(prompts[0, 0], prompts[s, 0])) if a != b)
            assert c == H * (shared // H) > 0
    stats = on.prefix_cache.stats
    assert stats.hit_tokens == sum(cached.values()) and stats.queried_tokens > stats.hit_tokens
    # the comparison has power: without the cached prefix the same tokens give logits far outside the tolerance
    key = max(cached, key=cached.get)
    prompt, out = prompts[key], out_on[key]
    blind = reference_logits(model, prompt[cached[key]:], out)
    assert (blind - logits_on[key]).abs().max() > 100 * TOL * logits_on[key].abs().max()


def budget(model, pages, checkpoints):
    """Bytes of `pages` physical pages and `checkpoints` KDA checkpoints of the test engines."""
    probe = make_engine(model)
    return pages * probe.prefix_cache.config.page_bytes + checkpoints * probe.checkpoint_bytes


def test_greedy_identical_under_forced_eviction_with_host_tier(model):
    baseline, _, _, baseline_logits = conversations(make_engine(model, prefix_cache=False), seed=1)
    for host in (0, budget(model, 16, 64)):
        tight = make_engine(model, cache_bytes=budget(model, 4, 10), host_cache_bytes=host)  # < the sessions' chains
        out, cached, _, logits = conversations(tight, seed=1)
        assert out == baseline
        for key, rows in logits.items():
            assert_close(rows, baseline_logits[key])
        stats = tight.prefix_cache.stats
        assert (stats.demoted_pages if host else stats.evicted_pages) > 0
        assert all(used <= tight.prefix_cache.capacity(t) for t, used in enumerate(tight.prefix_cache.used))
        assert sum(cached.values()) > 0
        if host:  # a session's next turn found its pages on the host and brought them back
            assert stats.promoted_pages > 0


def test_hit_is_the_shared_full_hash_blocks_only(model):
    engine = make_engine(model)
    seen = record_logits(engine)
    tok = ByteTokenizer()
    a = tok.encode("x" * (5 * H + 3))
    engine.add_request(a, SamplingParams(max_tokens=2, temperature=0))
    drain(engine)
    b = a[: 3 * H + 5] + tok.encode("y" * 40)  # shares 3 full blocks and 5 tokens of the fourth
    rb = engine.add_request(b, SamplingParams(max_tokens=2, temperature=0))
    drain(engine)
    assert rb.cached_tokens == 3 * H
    fresh = make_engine(model, prefix_cache=False)
    fresh_seen = record_logits(fresh)
    rf = fresh.add_request(b, SamplingParams(max_tokens=2, temperature=0))
    drain(fresh)
    assert rf.output == rb.output
    assert_close(torch.stack(seen[rb.rid]), torch.stack(fresh_seen[rf.rid]))


def test_sparser_checkpoints_keep_the_turn_boundary(model):
    engine = make_engine(model, checkpoint_every=4)
    tok = ByteTokenizer()
    a = tok.encode("z" * (6 * H + 3))  # checkpoints after blocks 4 (a chunk end) and 6 (the prompt's last full block)
    engine.add_request(a, SamplingParams(max_tokens=1, temperature=0))
    drain(engine)
    hits = {}
    for shared_blocks in (3, 5, 6):
        r = engine.add_request(a[: shared_blocks * H + 2] + tok.encode("!" * 20), SamplingParams(max_tokens=1))
        drain(engine)
        hits[shared_blocks] = r.cached_tokens
    assert hits == {3: 0, 5: 4 * H, 6: 6 * H}


def test_each_step_spends_the_whole_prefill_budget(model):
    """Prompts waiting to prefill get the step's whole token budget, step after step (a chunk cut by the budget ends
    on a hash-block boundary and the next prompt takes the rest); the default budget is the device's."""
    from openk3.serve.capacity import CPU_BATCHED_TOKENS

    assert make_engine(model, scheduler=SchedulerConfig()).scheduler.config.prefill_tokens_per_step \
        == CPU_BATCHED_TOKENS
    budget, rng = 96, random.Random(1)
    engine = make_engine(model, scheduler=SchedulerConfig(max_running=8, prefill_tokens_per_step=budget))
    requests = [engine.add_request([rng.randrange(256) for _ in range(n)], SamplingParams(max_tokens=3))
                for n in (100, 90, 83, 7)]
    while any(r.fed < len(r.prompt) for r in requests):
        left = sum(len(r.prompt) - r.fed for r in requests)
        before = sum(r.fed for r in requests if r.fed < len(r.prompt))
        prefilling = [r for r in requests if r.fed < len(r.prompt)]
        engine.step()
        assert sum(min(r.fed, len(r.prompt)) for r in prefilling) - before == min(budget, left)
    drain(engine)
    assert all(len(r.output) == 3 for r in requests)


def test_short_chunks_join_a_longer_chunks_forward(model):
    """With the short-prefill step on, a short prompt prefilled beside a longer one rides in the longer one's
    right-padded forward (one forward, not two); alone it takes the short step. Greedy output is the same."""
    from unittest import mock

    tok = ByteTokenizer()
    prompts = [tok.encode("a prompt longer than the short step takes"), tok.encode("short")]
    outputs = []
    for together in (True, False):
        engine = make_engine(model, short_prefill_tokens=8)
        with mock.patch.object(engine.runner, "prefill_short", wraps=engine.runner.prefill_short) as short_step:
            requests = [engine.add_request(prompts[0], SamplingParams(max_tokens=4, temperature=0))]
            if not together:
                engine.step()
            requests.append(engine.add_request(prompts[1], SamplingParams(max_tokens=4, temperature=0)))
            engine.step()
            drain(engine)
        assert short_step.called == (not together)
        assert engine.metrics.prefill_forwards == 1 + (not together)
        outputs.append([r.output for r in requests])
    assert outputs[0] == outputs[1]


def test_a_short_prompt_stops_at_its_turn_boundary_in_the_short_step(model):
    """A prompt the short-prefill step can take whole, with a turn boundary inside, goes in two short steps (up to
    the boundary, then the rest) rather than one eager forward recording the boundary's KDA state; the next turn
    hits the cache at the boundary all the same."""
    from unittest import mock

    tok = ByteTokenizer()
    engine = make_engine(model, short_prefill_tokens=3 * H, checkpoint_every=4)
    prompt = tok.encode("z" * (2 * H + 5))
    with mock.patch.object(engine.runner, "forward_steps", wraps=engine.runner.forward_steps) as eager:
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
        drain(engine)
        assert not eager.called and engine.metrics.prefill_forwards == 2
        follow_up = engine.add_request(prompt + tok.encode("!"), SamplingParams(max_tokens=1, temperature=0))
        drain(engine)
    assert follow_up.cached_tokens == 2 * H


def test_cancellation_frees_the_sequence_and_its_locks(model):
    engine = make_engine(model)
    events = []
    r = engine.add_request(ByteTokenizer().encode("a long prompt " * 8), SamplingParams(max_tokens=50),
                           on_event=events.append)
    other = engine.add_request(ByteTokenizer().encode("another one"), SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert r in engine.scheduler.running and any(p.locks for p in engine.prefix_cache.pages)
    engine.cancel(r.rid)
    engine.step()
    assert r.finish_reason == "cancelled" and r.slot is None and r.lease.released
    assert r not in engine.scheduler.running and events[-1].finished
    drain(engine)
    assert other.finish_reason == "length"
    assert not any(p.locks for p in engine.prefix_cache.pages)


def test_max_tokens_stop_strings_and_seeded_sampling(model):
    engine = make_engine(model)
    prompt = ByteTokenizer().encode("hello there, general")
    params = dict(max_tokens=12, ignore_eos=True)  # a random model may well emit <|im_end|> early
    greedy = engine.add_request(prompt, SamplingParams(temperature=0, **params))
    top1 = engine.add_request(prompt, SamplingParams(temperature=0.7, top_k=1, **params))
    seeded = [engine.add_request(prompt, SamplingParams(temperature=1.5, seed=s, **params)) for s in (7, 7, 8)]
    drain(engine)
    assert len(greedy.output) == 12 and greedy.finish_reason == "length"
    assert top1.output == greedy.output
    assert seeded[0].output == seeded[1].output != seeded[2].output
    # a stop string taken from the greedy text (two characters that are not a partial UTF-8 character's U+FFFD):
    # the same request with it stops there and returns the text before its first occurrence
    text = greedy.text
    cut = next(i for i in range(len(text) - 2, -1, -1) if "\ufffd" not in text[i:i + 2])
    stop = text[cut:cut + 2]
    r = engine.add_request(prompt, SamplingParams(temperature=0, stop=[stop], **params))
    drain(engine)
    assert r.finish_reason == "stop" and r.text == text[: text.find(stop)]
    assert r.output == greedy.output[: len(r.output)]


def test_streamed_deltas_reassemble_the_text(model):
    engine = make_engine(model)
    events = []
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    r = engine.add_request(ByteTokenizer().encode("stream me"), params, on_event=events.append)
    drain(engine)
    assert "".join(e.text for e in events) == r.text
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1].completion_tokens == len(r.output) and events[-1].prompt_tokens == len(r.prompt)


def test_reply_sent_whole_gets_its_first_and_last_events_and_a_sink_one_batch_per_step(model):
    """every_token=False (a request without `stream`): the first token's event and the finishing one, which
    carries the rest of the text and the logprobs, so they reassemble the same reply as a streamed twin's events;
    with an event_sink set, each step's events reach it in one call, in order, instead of the on_event calls."""
    engine = make_engine(model)
    params = SamplingParams(max_tokens=9, temperature=1.0, seed=5, ignore_eos=True, logprobs=2)
    prompt = ByteTokenizer().encode("whole or streamed")
    streamed, whole, batches = [], [], []
    engine.event_sink = batches.append
    a = engine.add_request(prompt, params, on_event=streamed.append)
    b = engine.add_request(prompt, params, on_event=whole.append, every_token=False)
    drain(engine)
    assert streamed == whole == []  # nothing delivered but through the sink
    assert [len(batch) for batch in batches] == [2] + [1] * 7 + [2]  # the first tokens, a's next 7, both last
    for batch in batches:
        for on_event, event in batch:
            on_event(event)
    assert a.output == b.output and len(streamed) == 9
    assert [e.completion_tokens for e in whole] == [1, 9] and [e.finished for e in whole] == [False, True]
    assert "".join(e.text for e in whole) == "".join(e.text for e in streamed) == b.text
    assert [len(e.logprobs) for e in whole] == [1, 8]


def full_redecode_events(tokenizer, params: SamplingParams, tokens: list[int]) -> list[tuple[str, bool, str | None]]:
    """The reply's events by the plain rule: after every token decode the whole output (stop tokens left out), cut
    it at the earliest stop string of complete characters (none ending with a final U+FFFD), and send all but a
    trailing U+FFFD run and the longest end that begins a stop string (brute force); (delta, finished,
    finish_reason) per event, the text's last one at the finish."""
    stop_ids, events, sent = tokenizer.stop_ids, [], 0
    for k, token in enumerate(tokens):
        reason = "stop" if token in stop_ids and not params.ignore_eos else \
            "length" if k + 1 >= params.max_tokens else None
        text = tokenizer.decode_plain([t for t in tokens[:k + 1] if t not in stop_ids])
        complete = len(text) - text.endswith("\ufffd")  # a final U+FFFD may be a character missing bytes
        starts = [i for s in params.stop if s for i in range(len(text)) if text.startswith(s, i)
                  and i + len(s) <= complete]
        if starts:
            text, reason = text[:min(starts)], "stop"
        if reason is not None:
            return events + [(text[sent:], True, reason)]
        body = text.rstrip("\ufffd")
        hold = max((k for s in params.stop for k in range(1, len(s)) if body.endswith(s[:k])), default=0)
        upto = max(len(body) - hold, sent)
        events.append((text[sent:upto], False, None))
        sent = upto
    raise AssertionError("the token stream ended before the reply")


def test_incremental_text_is_a_full_redecode(model):
    """The engine decodes each token's bytes once and searches stop strings only where a new token can complete
    one: on random token streams (characters split over tokens, invalid bytes, control and stop tokens, stop
    strings across tokens, several replies interleaved as with n > 1) its events and texts are those of a full
    re-decode after every token."""
    engine, tok, rng = make_engine(model), ByteTokenizer(), random.Random(4)
    text_ids = tok.encode_plain("aé日🙂 ab日本 ✓")
    pool = ["ab", "b", "日本", "é日", "🙂 a", "\ufffd", "✓✓", "a" * 5, "bab"]
    for _ in range(30):
        replies = []
        for _ in range(3):
            params = SamplingParams(max_tokens=rng.randint(1, 50), ignore_eos=rng.random() < 0.5,
                                    stop=rng.sample(pool, rng.randint(0, 3)))
            tokens = [rng.choice(text_ids) if rng.random() < 0.8 else rng.randrange(tok.vocab_size)
                      for _ in range(params.max_tokens)]
            events = []
            replies.append((engine.add_request([1, 2, 3], params, on_event=events.append), tokens, events))
        for k in range(50):  # round-robin, one token each
            for r, tokens, _ in replies:
                if r.finish_reason is None:
                    engine._accept(r, tokens[k])
        engine._deliver_events()  # (what the end of a step does)
        for r, tokens, events in replies:
            expected = full_redecode_events(tok, r.params, tokens)
            assert [(e.text, e.finished, e.finish_reason) for e in events] == expected
            assert r.text == "".join(delta for delta, _, _ in expected) and r not in engine.texts


def test_admission_throttles_running_and_queue(model):
    engine = make_engine(model, scheduler=SchedulerConfig(max_running=2, max_queue=3))
    prompt = ByteTokenizer().encode("throttle")
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    requests = [engine.add_request(prompt, params) for _ in range(3)]
    with pytest.raises(QueueFull):
        engine.add_request(prompt, SamplingParams(max_tokens=3))
    most = 0
    while engine.has_work():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == 2 and all(r.finish_reason == "length" for r in requests)


def test_step_timing_and_slow_steps_are_reported(model, monkeypatch, caplog):
    """The engine's step-time counters (the /metrics series) and the slow-step log line: prompts of different
    lengths (one past a hash-block boundary) prefill together in one right-padded forward; with the threshold at 0
    every step is 'slow' and says what it held."""
    from openk3.serve import engine as engine_module

    monkeypatch.setattr(engine_module, "SLOW_STEP_S", 0.0)
    engine = make_engine(model)
    tok = ByteTokenizer()
    for text in ("a short one", "a somewhat longer prompt"):
        engine.add_request(tok.encode(text), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    with caplog.at_level("INFO", logger="openk3.serve.engine"):
        while engine.has_work():
            engine.step()
    m = engine.metrics
    assert m.prefill_forwards == 1 and m.steps >= 2
    assert 0 < m.slowest_step_seconds <= m.step_seconds
    slow = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow engine step")]
    assert len(slow) == m.steps
    assert sum(int(line.split(" with ")[1].split()[0]) for line in slow) == m.prefill_forwards
    # a collection inside a step is counted in its line (the collector's own time, from gc.callbacks)
    step = engine._step
    monkeypatch.setattr(engine, "_step", lambda: (gc.collect(), step()))
    engine.add_request(tok.encode("again"), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    caplog.clear()
    with caplog.at_level("INFO", logger="openk3.serve.engine"):
        engine.step()
    line = caplog.records[-1].getMessage()
    assert line.startswith("slow engine step") and line.endswith("in 1 collections")
    assert 0 < float(line.split("garbage collector ")[1].split(" ms")[0]) <= float(line.split(": ")[1].split(" ms")[0])
    # and which phases held it: the phases of over 1 ms, longest first, within the step's time
    phases = dict(p.rsplit(" ", 2)[:2] for p in line.split("; phases: ")[1].split("; ")[0].split(", "))
    assert set(phases) <= {"admit", "decode launch", "device wait", "accept", "prefix cache", "sample and accept",
                           "speculate", "prefill", "events"} and "prefill" in phases, line
    assert sum(map(float, phases.values())) <= float(line.split(": ")[1].split(" ms")[0]) + len(phases)
    assert list(map(float, phases.values())) == sorted(map(float, phases.values()), reverse=True)


def test_bad_prompts_are_refused(model):
    engine = make_engine(model)
    with pytest.raises(ValueError):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request([1] * model.config.max_seq_len, SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request([model.config.vocab_size], SamplingParams())
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_sampling_filters():
    gen = random.Random(0)
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert sample_token(logits, SamplingParams(temperature=0), gen) == 1
    draws = {sample_token(logits, SamplingParams(temperature=5.0, top_k=2), gen) for _ in range(200)}
    assert draws == {1, 2}
    draws = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.01), gen) for _ in range(50)}
    assert draws == {1}


def test_sampling_cannot_fail_for_valid_parameters():
    """Temperatures below the floor are greedy (1e-40 overflowed fp32 before); NaN logits are never chosen;
    extreme, infinite and half-precision logits give a valid id for every valid parameter combination."""
    gen = random.Random(0)
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    for t in (1e-40, 5e-324, TEMPERATURE_FLOOR / 2):
        assert SamplingParams(temperature=t).greedy and sample_token(logits, SamplingParams(temperature=t), gen) == 1
    assert not SamplingParams(temperature=TEMPERATURE_FLOOR).greedy
    nan = torch.tensor([float("nan"), 1.0, float("nan"), 0.5])
    assert {sample_token(nan, SamplingParams(temperature=t), gen) for t in (0, 1.0) for _ in range(50)} <= {1, 3}
    assert sample_token(torch.tensor([1.0, float("inf"), 2.0]), SamplingParams(temperature=1.0), gen) == 1
    rng = torch.Generator().manual_seed(1)
    cases = [torch.full((7,), float("nan")), torch.full((7,), float("-inf")), torch.tensor([3e38, -3e38, 0.0]),
             (torch.randn(33, generator=rng) * 1e4).half(), torch.randn(33, generator=rng).bfloat16()]
    for case in cases:
        for t in (0.0, 1e-30, TEMPERATURE_FLOOR, 0.7, 100.0):
            for top_k, top_p in ((0, 1.0), (3, 1.0), (0, 1e-6), (2, 0.5)):
                token = sample_token(case, SamplingParams(temperature=t, top_k=top_k, top_p=top_p), gen)
                assert 0 <= token < case.numel()
                assert not torch.isnan(case[token]) or torch.isnan(case).all()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)


def test_a_failing_sequence_fails_alone(model, poisoned_sampling):
    """A sequence whose sampling raises ends with "error" (its lease and state freed); every other request decoding
    in the same steps finishes exactly as it does alone, and the engine keeps serving."""
    tok, params = ByteTokenizer(), dict(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [tok.encode(f"request {i} shares the steps with a failing one") for i in range(3)]
    alone = make_engine(model)
    expected = [alone.add_request(p, SamplingParams(**params)) for p in prompts]
    drain(alone)
    engine, events = make_engine(model), []
    bad = engine.add_request(tok.encode("this one fails"),  # sampled (greedy rows never reach sample_tokens)
                             SamplingParams(seed=poisoned_sampling, **{**params, "temperature": 0.8}),
                             on_event=events.append)
    good = [engine.add_request(p, SamplingParams(**params)) for p in prompts]
    drain(engine)
    assert bad.finish_reason == "error" and bad.slot is None and bad.lease.released
    assert events[-1].finished and events[-1].finish_reason == "error"
    assert [r.output for r in good] == [r.output for r in expected]
    assert all(r.finish_reason == "length" for r in good)
    assert not any(p.locks for p in engine.prefix_cache.pages) and not engine.scheduler.running
    again = engine.add_request(prompts[0], SamplingParams(**params))
    drain(engine)
    assert again.output == expected[0].output and again.cached_tokens > 0


def test_a_failing_prefill_forward_fails_its_group_alone(model):
    """A prefill forward that raises ends the requests of that forward ("error"); a request prefilled in another
    forward of the same step, and one already decoding, finish as they do alone."""
    tok, params = ByteTokenizer(), dict(max_tokens=4, temperature=0, ignore_eos=True)
    poison = 7  # a byte no other prompt has

    decoding, short = tok.encode("already decoding"), tok.encode("a short prompt")
    longer = tok.encode("a longer prompt that fills most of a right-padded forward; " * 2)
    alone = make_engine(model)
    expected = [alone.add_request(p, SamplingParams(**params)) for p in (decoding, longer, short)]
    drain(alone)
    engine = make_engine(model)
    forward_steps = engine.runner.forward_steps

    def fails_on_poison(chunks, *args, **kwargs):
        if any(poison in chunk for chunk in chunks):
            raise RuntimeError("injected forward failure")
        return forward_steps(chunks, *args, **kwargs)

    engine.runner.forward_steps = fails_on_poison
    first = engine.add_request(decoding, SamplingParams(**params))
    engine.step()
    # (right-padded together, the longer and the short prompt fill their forward: the poisoned one, as short, pads
    # too much to join them and goes alone; see ragged_groups)
    others = [engine.add_request(p, SamplingParams(**params)) for p in (longer, short)]
    bad = engine.add_request(tok.encode("a bad \x07 prompt"), SamplingParams(**params))
    drain(engine)
    assert bad.finish_reason == "error" and bad.lease.released
    assert [r.output for r in (first, *others)] == [r.output for r in expected]
    assert all(r.finish_reason == "length" for r in (first, *others))


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_choices_after_a_leader_reuse_its_prefill(model, prefix_cache):
    """Choices of one request (`after`): with the prefix cache on, the followers wait until their leader has
    prefilled and then hit the prompt's full hash blocks; without it they start at once. Either way each choice's
    greedy output is the leader's (same prompt, same parameters)."""
    engine = make_engine(model, prefix_cache=prefix_cache)
    prompt = ByteTokenizer().encode("choices share one prompt of a few hash blocks, " * 2)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    leader = engine.add_request(prompt, params)
    followers = [engine.add_request(prompt, params, after=leader) for _ in range(2)]
    engine.step()
    admitted = [r in engine.scheduler.running for r in followers]
    assert admitted == [not prefix_cache] * 2  # admission comes before the step's prefill
    drain(engine)
    assert all(r.output == leader.output for r in followers) and leader.cached_tokens == 0
    assert [r.cached_tokens for r in followers] == [H * ((len(prompt) - 1) // H) if prefix_cache else 0] * 2


@pytest.mark.parametrize("free", [0, 64, 4096])
def test_ragged_groups_pad_no_more_than_the_real_tokens_nor_free_unless_the_forward_fits_free(free):
    """Random chunk lengths: every chunk lands in exactly one forward, longest first, and each forward of more than
    one row keeps its padding within its real tokens and within `free`, or its padded size within `free`."""
    rng = random.Random(free)

    class Chunk:
        fed = 0

    for _ in range(50):
        chunks = [(Chunk(), rng.choice([rng.randint(1, 300), rng.randint(1, 9000)])) for _ in range(rng.randint(1, 9))]
        groups = ragged_groups(chunks, free=free)
        assert sorted(id(c) for g in groups for c in g) == sorted(id(c) for c in chunks)
        for group in groups:
            lengths = [end for _, end in group]
            assert lengths == sorted(lengths, reverse=True)
            padded, real = lengths[0] * len(lengths), sum(lengths)
            if len(group) > 1:
                assert padded <= free or (padded - real <= real and padded - real <= free)


def test_the_same_prompt_again_prefills_one_block_when_it_ends_on_a_boundary(model):
    """A prompt of exactly 10 hash blocks, checkpoints every 4: the same prompt again (a retry, another choice) hits
    all but its last block (the turn checkpoint sits one block before the end, since one token must be prefilled,
    not at the last multiple of 4 blocks) and gives the same greedy tokens; a follow-up turn hits the whole prompt."""
    tok = ByteTokenizer()
    engine = make_engine(model, checkpoint_every=4)
    prompt = tok.encode("q" * (10 * H))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = engine.add_request(prompt, params)
    drain(engine)
    again = engine.add_request(prompt, params)
    drain(engine)
    follow_up = engine.add_request(prompt + tok.encode("!" * 5), params)
    drain(engine)
    assert again.cached_tokens == 9 * H and again.output == first.output
    assert follow_up.cached_tokens == 10 * H


def test_overlapped_decode_gives_the_synchronous_replies(model):
    """`overlap` (each decode step queued before the host reads the last one's tokens; on by default on a GPU)
    changes nothing a client sees: the agent sessions' greedy turns and their cache hits, seeded top-p samples,
    stop strings, max_tokens and the streamed events are those of the synchronous engine, and a request
    cancelled while its token is in flight ends cleanly."""
    sync, overlapped = make_engine(model, overlap=False), make_engine(model, overlap=True)
    assert overlapped.overlap and not sync.overlap
    expected, got = conversations(sync), conversations(overlapped)
    assert got[:3] == expected[:3]  # outputs, cache hits, prompts

    tok = ByteTokenizer()
    stop = tok.decode(expected[0][0, 0][1:3])  # a stop string inside a greedy reply of the sessions above

    def requests(engine):
        events = defaultdict(list)
        made = [engine.add_request(tok.encode(f"prompt {i} " * (i + 1)), params, on_event=events[i].append)
                for i, params in enumerate([
                    SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, seed=4, ignore_eos=True),
                    SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                    SamplingParams(max_tokens=12, temperature=1.2, seed=9, ignore_eos=True),
                    SamplingParams(max_tokens=7, temperature=0, stop=[stop], ignore_eos=True),
                    SamplingParams(max_tokens=6, temperature=0.7, presence_penalty=0.5, seed=1)])]
        drain(engine)
        return [(r.output, r.text, r.finish_reason) for r in made], {i: [(e.text, e.finished) for e in ev]
                                                                      for i, ev in events.items()}

    assert requests(overlapped) == requests(sync)

    r = overlapped.add_request(tok.encode("cancel me in flight"), SamplingParams(max_tokens=50, ignore_eos=True))
    while len(r.output) < 3:
        overlapped.step()
    assert overlapped._inflight is not None and r in overlapped._inflight.rows
    overlapped.cancel(r.rid)
    drain(overlapped)
    assert r.finish_reason == "cancelled" and r.slot is None and len(r.output) == 3
    assert overlapped.states.num_free == overlapped.states.num_slots
    assert not any(p.locks for p in overlapped.prefix_cache.pages)


def test_a_step_with_decoding_sequences_runs_at_most_the_set_prefill_forwards(model):
    """`prefill_forwards_per_step` 1 (a GPU's default): while a sequence decodes, a long prompt prefills one chunk
    forward per step (its later chunks wait for later steps, which take them in order); with none decoding the
    step's whole budget runs. The replies are those of the engine without the limit."""
    tok, greedy = ByteTokenizer(), dict(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [tok.encode("decoding already"), tok.encode("a long prompt arrives while another decodes; " * 2)]

    def replies(limit):
        engine = make_engine(model, prefill_forwards_per_step=limit, prefill_chunk_blocks=2,
                             scheduler=SchedulerConfig(max_running=4, prefill_tokens_per_step=96))
        first = engine.add_request(prompts[0], SamplingParams(**greedy))
        engine.step()
        assert first.output and first.fed == len(prompts[0])
        second = engine.add_request(prompts[1], SamplingParams(**greedy))
        forwards = []
        while second.prefilling:
            before = engine.metrics.prefill_forwards
            engine.step()
            forwards.append(engine.metrics.prefill_forwards - before)
        drain(engine)
        return [first.output, second.output], forwards

    (limited, forwards), (unlimited, all_at_once) = replies(1), replies(0)
    assert limited == unlimited
    assert set(forwards) == {1} and len(forwards) == -(-len(prompts[1]) // (2 * H))
    assert max(all_at_once) == 3  # the budget's 96 tokens as three 32-token chunks, one per round
