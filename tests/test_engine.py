"""The continuous-batching engine with the K3 prefix cache, on a small random-init hybrid model (CPU)."""

import random

import pytest
import torch

from openk3.config import get_preset
from openk3.model import K3ForCausalLM
from openk3.serve.engine import Engine, EngineConfig
from openk3.serve.sampling import SamplingParams, sample_token
from openk3.serve.scheduler import QueueFull, SchedulerConfig
from openk3.serve.tokenizer import ByteTokenizer

H = 16  # hash block of the tests' engines


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster and leaves the shared cores alone
    torch.manual_seed(0)
    cfg = get_preset("k3-tiny").with_overrides({"num_layers": 4, "mla_layers": [1, 3], "max_seq_len": 512,
                                                "mtp_layers": 0})
    yield K3ForCausalLM(cfg).eval()
    torch.set_num_threads(threads)


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
    run concurrently; with `stagger`, session s starts s steps late so batches mix prefill and decode."""
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
            history[s] += r.output
    return outputs, cached, prompts


def test_greedy_identical_with_and_without_prefix_cache_and_later_turns_hit(model):
    on = make_engine(model)
    out_on, cached, prompts = conversations(on)
    out_off, cached_off, _ = conversations(make_engine(model, prefix_cache=False))
    assert out_on == out_off
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


def budget(model, pages, checkpoints):
    """Bytes of `pages` physical pages and `checkpoints` KDA checkpoints of the test engines."""
    probe = make_engine(model)
    return pages * probe.prefix_cache.config.page_bytes + checkpoints * probe.checkpoint_bytes


def test_greedy_identical_under_forced_eviction_with_host_tier(model):
    baseline, _, _ = conversations(make_engine(model, prefix_cache=False), seed=1)
    for host in (0, budget(model, 16, 64)):
        tight = make_engine(model, cache_bytes=budget(model, 5, 10), host_cache_bytes=host)  # < the sessions' chains
        out, cached, _ = conversations(tight, seed=1)
        assert out == baseline
        stats = tight.prefix_cache.stats
        assert (stats.demoted_pages if host else stats.evicted_pages) > 0
        assert all(used <= tight.prefix_cache.capacity(t) for t, used in enumerate(tight.prefix_cache.used))
        assert sum(cached.values()) > 0
        if host:  # a session's next turn found its pages on the host and brought them back
            assert stats.promoted_pages > 0


def test_hit_is_the_shared_full_hash_blocks_only(model):
    engine = make_engine(model)
    tok = ByteTokenizer()
    a = tok.encode("x" * (5 * H + 3))
    engine.add_request(a, SamplingParams(max_tokens=2, temperature=0))
    drain(engine)
    b = a[: 3 * H + 5] + tok.encode("y" * 40)  # shares 3 full blocks and 5 tokens of the fourth
    rb = engine.add_request(b, SamplingParams(max_tokens=2, temperature=0))
    drain(engine)
    assert rb.cached_tokens == 3 * H
    fresh = make_engine(model, prefix_cache=False)
    rf = fresh.add_request(b, SamplingParams(max_tokens=2, temperature=0))
    drain(fresh)
    assert rf.output == rb.output


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
    text = greedy.text
    stop = text[4:6] if len(text) >= 6 else None
    if stop:
        r = engine.add_request(prompt, SamplingParams(temperature=0, stop=[stop], **params))
        drain(engine)
        assert r.finish_reason == "stop" and r.text == text[: text.find(stop)]


def test_streamed_deltas_reassemble_the_text(model):
    engine = make_engine(model)
    events = []
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    r = engine.add_request(ByteTokenizer().encode("stream me"), params, on_event=events.append)
    drain(engine)
    assert "".join(e.text for e in events) == r.text
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1].completion_tokens == len(r.output) and events[-1].prompt_tokens == len(r.prompt)


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
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert sample_token(logits, SamplingParams(temperature=0), gen) == 1
    draws = {sample_token(logits, SamplingParams(temperature=5.0, top_k=2), gen) for _ in range(200)}
    assert draws == {1, 2}
    draws = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.01), gen) for _ in range(50)}
    assert draws == {1}
