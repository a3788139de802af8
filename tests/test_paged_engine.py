"""The engine on its pools (CPU): greedy ids equal `openk3 generate`'s with the prefix cache on and off and with the
GPU path's Triton kernels (interpreted); cancelled requests give back every page and slot; prefix hits share
physical pages by reference, and a page's reference count is always its block tables plus the cache."""

import random
from unittest import mock

import pytest
import torch

from openk3.cache.paged import NULL_PAGE
from openk3.generation import generate_ids
from openk3.model import K3ForCausalLM
from openk3.sampling import SamplingParams
from openk3.serve.engine import Engine, EngineConfig
from openk3.serve.piecewise import run_to_end
from openk3.serve.prefix_cache import DEVICE
from openk3.serve.scheduler import SchedulerConfig
from openk3.tokenizer import ByteTokenizer
from test_model_decode import CONFIGS, randomize

H = 16  # hash block of the tests' engines; pages of 4 hash blocks


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield randomize(K3ForCausalLM(CONFIGS["k3-small-mla-first"]().with_overrides({"max_seq_len": 512})), seed=5)
    torch.set_num_threads(threads)


def make_engine(model, **kw):
    sched = kw.pop("scheduler", SchedulerConfig(max_running=4, prefill_tokens_per_step=48))
    return Engine(model, ByteTokenizer(), EngineConfig(hash_block=H, page_size=4 * H, scheduler=sched, **kw))


def check_references(engine):
    """Every page's reference count = the block tables holding it + one if the prefix cache keeps it."""
    held = [0] * engine.pages.num_pages
    for pages in engine.tables.pages:
        for pid in pages:
            held[pid] += 1
    if engine.prefix_cache is not None:
        for page in engine.prefix_cache.pages:
            assert (page.phys is not None) == (page.tier == DEVICE)
            if page.phys is not None:
                held[page.phys] += 1
    held[NULL_PAGE] += 1
    assert held == engine.pages.refs


def run(engine, prompts, max_tokens, stagger=1):
    """Submit the prompts `stagger` steps apart, run to the end checking references; the requests."""
    requests, pending = [], list(prompts)
    while pending or engine.has_work():
        if pending:
            requests.append(engine.add_request(pending.pop(0), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                              ignore_eos=True)))
        for _ in range(stagger if pending else 1):
            engine.step()
            check_references(engine)
    return requests


def prompts_with_shared_prefixes(vocab, seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(70)]
    own = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 29, 50)]
    first = [system + o for o in own]
    return first + [first[1][:40] + [1, 2, 3], [rng.randrange(vocab) for _ in range(5)], first[2] + own[0]]


@pytest.mark.parametrize("kernels,prefix_cache,short", [("torch", True, 0), ("torch", False, 0), ("triton", True, 0),
                                                        ("torch", True, 8), ("triton", True, 8)])
def test_greedy_ids_equal_generate(model, kernels, prefix_cache, short):
    """(`short`: prompt chunks of up to that many tokens, the tails after prefix hits and short prompts among them,
    prefill in the runner's short-prefill step.)"""
    prompts = prompts_with_shared_prefixes(model.config.vocab_size)
    max_tokens = 6 if kernels == "triton" else 12
    if kernels == "triton":
        prompts = prompts[:2] + prompts[3:5]
    engine = make_engine(model, kernels=kernels, prefix_cache=prefix_cache, short_prefill_tokens=short)
    with mock.patch.object(engine.runner, "prefill_short", wraps=engine.runner.prefill_short) as short_prefills:
        requests = run(engine, prompts, max_tokens)
    assert short_prefills.called == bool(short)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0)
    for r in requests:
        assert r.finish_reason == "length"
        assert r.output == generate_ids(model, r.prompt, max_tokens, greedy)
    if prefix_cache:
        assert sum(r.cached_tokens for r in requests) > 0


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_cancelled_requests_free_their_pages_and_slots(model, prefix_cache):
    engine = make_engine(model, prefix_cache=prefix_cache, scheduler=SchedulerConfig(max_running=3,
                                                                                     prefill_tokens_per_step=32))
    free_pages, free_slots = engine.pages.num_free, engine.states.num_free
    rng = random.Random(1)
    prompts = [[rng.randrange(90) for _ in range(n)] for n in (150, 20, 90, 5, 70, 130, 33, 64)]
    params = SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    cancel_at = {0: 2, 2: 5, 4: 9, 5: 0, 7: 14}  # request -> step: waiting, prefilling and decoding ones
    for step in range(400):
        for i, at in cancel_at.items():
            if step == at:
                engine.cancel(requests[i].rid)
        if not engine.has_work():
            break
        engine.step()
        check_references(engine)
    reasons = [r.finish_reason for r in requests]
    assert reasons.count("cancelled") == len(cancel_at) and reasons.count("length") == len(prompts) - len(cancel_at)
    assert engine.states.num_free == free_slots and all(not pages for pages in engine.tables.pages)
    if prefix_cache:
        kept = sum(p.phys is not None for p in engine.prefix_cache.pages)
        assert kept > 0 and engine.pages.num_free == free_pages - kept
        assert not any(p.locks for p in engine.prefix_cache.pages)
        engine.prefix_cache.evict(engine.prefix_cache.used[DEVICE])
    assert engine.pages.num_free == free_pages


def test_hits_share_pages_by_reference_and_copy_only_a_page_being_written(model):
    engine = make_engine(model)
    rng = random.Random(2)
    long = [rng.randrange(90) for _ in range(5 * H + 3)]  # pages of 4 H: one full page, a second partly filled
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = engine.add_request(long, params)
    while first.prefilling or len(first.output) < 2:
        engine.step()
    # a hit inside the page `first` is still writing: its part of that page is copied, the full page is shared
    second = engine.add_request(long[: 5 * H + 1] + [7, 7], params)
    engine.step()
    assert second.cached_tokens == 5 * H and not second.lease.owns_tail
    a, b = engine.tables.pages[first.slot], engine.tables.pages[second.slot]
    assert a[0] == b[0] and engine.pages.refs[a[0]] == 3  # two block tables and the prefix cache
    assert a[1] != b[1]
    positions = slice(0, 5 * H - 4 * H)
    torch.testing.assert_close(engine.pages.pages[:, b[1], positions], engine.pages.pages[:, a[1], positions],
                               rtol=0, atol=0)
    while engine.has_work():
        engine.step()
    # once nobody writes it, a hit ending at the page's last cached block claims it and writes on into it
    cached_blocks = len(first.prompt + first.output[:-1]) // H
    third = engine.add_request(first.prompt + first.output[:-1] + [3] * (H + 1), params)
    engine.step()
    assert third.cached_tokens == cached_blocks * H and third.lease.owns_tail
    shared = third.lease.hit_pages
    assert engine.tables.pages[third.slot][: len(shared)] == shared  # no copy at all
    while engine.has_work():
        engine.step()
        check_references(engine)
    greedy = SamplingParams(max_tokens=40, temperature=0)
    for r in (first, second, third):
        assert r.output == generate_ids(model, r.prompt, 40, greedy)


def test_prompts_of_whole_blocks_sent_again_keep_their_hits_when_the_cache_is_full(model):
    """A prompt of a whole number of hash blocks, sent again, hits all but its last block (one is prefilled to
    sample from): the checkpoint there is kept like the turn's end when the cache's tier fills and mid-turn
    checkpoints give way (64 contexts of 16k tokens on an H100 lost the whole hit of 14 of them before)."""
    n, blocks = 4, 8
    probe = make_engine(model, checkpoint_every=1)
    page_bytes, ckpt = probe.prefix_cache.config.page_bytes, probe.checkpoint_bytes
    # room for each prompt's pages and two and a half of its eight checkpoints
    engine = make_engine(model, checkpoint_every=1, cache_bytes=n * (-(-blocks // 4) * page_bytes + 5 * ckpt // 2))
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 90) for _ in range(blocks * H)] for _ in range(n)]
    for max_tokens in (1, 3):
        made = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
                for p in prompts]
        while engine.has_work():
            engine.step()
        assert engine.prefix_cache.stats.dropped_checkpoints > 0 and engine.prefix_cache.stats.evicted_pages == 0
    assert [r.cached_tokens for r in made] == [(blocks - 1) * H] * n
    greedy = SamplingParams(max_tokens=3, temperature=0)
    assert all(r.output == generate_ids(model, r.prompt, 3, greedy) for r in made)


def test_prefill_spends_exactly_the_step_budget(model):
    """The chunk that reaches the budget is cut there, whatever the hash block (the block-aligned baseline of
    bench/serve.py prefills with the same budget per step as K3's policy)."""
    for h in (H, 4 * H):
        engine = Engine(model, ByteTokenizer(), EngineConfig(
            hash_block=h, page_size=4 * H, prefix_cache=False,
            scheduler=SchedulerConfig(max_running=4, prefill_tokens_per_step=40)))
        requests = [engine.add_request([5] * n, SamplingParams(max_tokens=2)) for n in (70, 23, 100)]
        fed = []
        while any(r.prefilling for r in requests):
            before = sum(min(r.fed, len(r.prompt)) for r in requests)
            engine.step()
            fed.append(sum(min(r.fed, len(r.prompt)) for r in requests) - before)
        assert fed == [40] * 4 + [193 - 160]


def test_a_full_pool_evicts_cached_pages_and_preempts_the_latest_sequence(model):
    """Pool pressure: new pages come from evicting (or demoting to the host tier) unlocked cached pages; when none
    is left, the latest admitted sequence is preempted and later resumed (recompute, hitting the prefix cache where
    it can): every output stays exact and every page comes back."""
    rng = random.Random(3)
    prompts = [[rng.randrange(90) for _ in range(n)] for n in (100, 40, 120, 70, 100)]
    greedy = SamplingParams(max_tokens=10, temperature=0)
    for host in (0, 1 << 20):
        engine = make_engine(model, kv_pages=1 + 2 * 3, cache_bytes=1 << 20, host_cache_bytes=host,
                             max_model_len=300, scheduler=SchedulerConfig(max_running=2, prefill_tokens_per_step=48))
        requests = run(engine, prompts, 10, stagger=3)
        assert all(r.output == generate_ids(model, r.prompt, 10, greedy) for r in requests)
        stats = engine.prefix_cache.stats
        assert (stats.demoted_pages if host else stats.evicted_pages) > 0
    # three sequences that grow past the pool together: preemption (also while a decode step is in flight)
    for prefix_cache, overlap in ((True, False), (False, False), (True, True)):
        engine = make_engine(model, kv_pages=1 + 7, prefix_cache=prefix_cache, max_model_len=7 * 4 * H - 1,
                             overlap=overlap, scheduler=SchedulerConfig(max_running=3, prefill_tokens_per_step=64))
        requests = run(engine, [prompts[0][:60], prompts[1], prompts[3][:50]], 90)
        assert engine.metrics.preemptions > 0 and sum(r.preemptions for r in requests) == engine.metrics.preemptions
        for r in requests:
            assert r.finish_reason == "length" and r.output == generate_ids(model, r.prompt, 90, greedy)
        held = sum(p.phys is not None for p in engine.prefix_cache.pages) if prefix_cache else 0
        assert engine.pages.num_free + held == engine.pages.num_pages - 1
        assert engine.states.num_free == engine.states.num_slots


def test_max_model_len_bounds_prompts_and_must_fit_the_pool(model):
    """A prompt of max_model_len tokens or more is refused; the pool must hold one max_model_len sequence, and
    max_model_len may exceed the model's max_seq_len (NoPE: only memory bounds the context)."""
    engine = make_engine(model, max_model_len=100)
    with pytest.raises(ValueError, match="--max-model-len"):
        engine.add_request(list(range(1, 101)), SamplingParams(max_tokens=4))
    (r,) = run(engine, [list(range(1, 90))], 30)
    assert r.finish_reason == "length" and r.length == 100  # stopped at max_model_len, not max_tokens
    with pytest.raises(ValueError, match="--kv-pages 5 holds 256 tokens; one sequence of --max-model-len 400"):
        make_engine(model, kv_pages=5, max_model_len=400)
    long = make_engine(model, max_model_len=4 * model.config.max_seq_len, prefix_cache=False)
    assert long.tables.max_pages * long.page_size > 4 * model.config.max_seq_len
    (r,) = run(long, [[7] * (model.config.max_seq_len + 20)], 3)
    assert r.finish_reason == "length" and len(r.output) == 3


def test_a_failing_sequence_fails_alone_and_gives_back_its_pages(model, poisoned_sampling):
    engine = make_engine(model, prefix_cache=False)
    free = engine.pages.num_free
    prompts = prompts_with_shared_prefixes(model.config.vocab_size)[:3]
    bad = engine.add_request(prompts[0], SamplingParams(max_tokens=6, temperature=1.0, seed=poisoned_sampling))
    good = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for p in prompts]
    while engine.has_work():
        engine.step()
    assert bad.finish_reason == "error" and bad.slot is None
    for r in good:
        assert r.finish_reason == "length" and r.output == generate_ids(model, r.prompt, 6, SamplingParams(
            temperature=0))
    assert engine.pages.num_free == free and engine.states.num_free == engine.states.num_slots


def paused_forwards(engine, pauses: int) -> None:
    """The GPU's prefill graphs on a CPU engine: every text forward pauses `pauses` times, as
    `PiecewisePrefill.steps` makes `ModelRunner.forward_steps` do (here the forward's work is done in its first piece
    and its result handed over after the last: anything that touched its slots in between would show)."""
    forward_steps = engine.runner.forward_steps

    def steps(*args, **kwargs):
        result = run_to_end(forward_steps(*args, **kwargs))
        for _ in range(pauses):
            yield
        return result

    engine.runner.forward_steps = steps
    engine.runner.forward_pauses = lambda tokens, images=False: 0 if images else pauses


@pytest.mark.parametrize("prefix_cache,forwards", [(True, 1), (False, 1), (False, 0)])
def test_prefill_forwards_split_over_steps_leave_outputs_exact(model, prefix_cache, forwards):
    """While sequences decode, a forward of N tokens runs over ceil(N / prefill_split_tokens) steps with the decode
    steps between its pieces: greedy outputs equal generate()'s, and a cancellation of one of its requests waits
    for it to end. With no limit on a step's forwards (0), the others of a step with a paused forward run whole."""
    rng = random.Random(4)
    prompts = [[rng.randrange(90) for _ in range(n)] for n in (20, 100, 60, 130, 45, 90)]
    greedy = SamplingParams(max_tokens=12, temperature=0)
    engine = make_engine(model, prefix_cache=prefix_cache, prefill_split_tokens=16,
                         prefill_forwards_per_step=forwards,
                         scheduler=SchedulerConfig(max_running=3, prefill_tokens_per_step=48))
    paused_forwards(engine, pauses=12)
    requests, pending, split_steps, cancelled = [], list(prompts), 0, None
    for _ in range(1000):  # (a lost paused forward would leave its requests waiting for ever)
        if not (pending or engine.has_work()):
            break
        if pending:
            requests.append(engine.add_request(pending.pop(0), SamplingParams(max_tokens=12, temperature=0,
                                                                              ignore_eos=True)))
        engine.step()
        check_references(engine)
        if engine._split is not None:
            split_steps += 1
            if cancelled is None:  # cancel one of the paused forward's requests: it ends after the forward
                cancelled = next(iter(engine._split.requests))
                engine.cancel(cancelled.rid)
                engine.step()
                assert cancelled.finish_reason is None
    assert split_steps > 5
    for r in requests:
        if r is cancelled:
            assert r.finish_reason == "cancelled"
        else:
            assert r.finish_reason == "length" and r.output == generate_ids(model, r.prompt, 12, greedy)
    assert engine.states.num_free == engine.states.num_slots and all(not pages for pages in engine.tables.pages)


def test_a_decoding_sequence_short_of_pages_ends_a_split_forward_before_preempting(model):
    """A decoding sequence needs a page while the pool is full and the latest admitted sequence (the victim) is in
    a paused forward: the forward ends first (its slot's states and latents written), then the victim is
    preempted and later resumed; both outputs stay exact."""
    rng = random.Random(0)
    for a_len in (54, 57):  # (a's decode crosses its page boundary while b's third chunk is under way)
        a_prompt, b_prompt = [rng.randrange(90) for _ in range(a_len)], [rng.randrange(90) for _ in range(180)]
        engine = make_engine(model, prefix_cache=False, prefill_split_tokens=16, prefill_forwards_per_step=1,
                             kv_pages=1 + 4, max_model_len=240,
                             scheduler=SchedulerConfig(max_running=2, prefill_tokens_per_step=48))
        paused_forwards(engine, pauses=12)
        a = engine.add_request(a_prompt, SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))
        engine.step()
        engine.step()
        b = engine.add_request(b_prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        with mock.patch.object(engine, "_advance_split", wraps=engine._advance_split) as advance:
            while engine.has_work():
                engine.step()
                check_references(engine)
        assert mock.call(whole=True) in advance.call_args_list  # (a decodes throughout: only for the preemption)
        assert engine.metrics.preemptions == b.preemptions == 1
        assert a.output == generate_ids(model, a_prompt, 150, SamplingParams(max_tokens=150, temperature=0))
        assert b.output == generate_ids(model, b_prompt, 20, SamplingParams(max_tokens=20, temperature=0))


def test_decode_checkpoints_the_kda_states_on_the_prefill_grid_only(model):
    """With `checkpoint_every` = 2 a decoding sequence snapshots its KDA states at every second hash block only
    (where a prefill would checkpoint), not at each block end; its blocks still go to the cache, and a later
    request on its prompt and reply hits up to the last checkpointed block and decodes exactly."""
    engine = make_engine(model, checkpoint_every=2)
    rng = random.Random(7)
    prompt = [rng.randrange(90) for _ in range(2 * H + 5)]
    params = SamplingParams(max_tokens=5 * H, temperature=0, ignore_eos=True)
    first = engine.add_request(prompt, params)
    while first.prefilling:
        engine.step()
    snapshotted = {}  # block end a decode step reached -> whether that step snapshotted the slot
    with mock.patch.object(engine.states, "snapshot", wraps=engine.states.snapshot) as snapshot:
        while engine.has_work():
            before = first.fed
            engine.step()
            snapshotted.update({end: snapshot.call_count == 1 for end in range(before + 1, first.fed + 1)
                                if end % H == 0})
            snapshot.reset_mock()
    assert len(snapshotted) >= 4 and all(taken == (end % (2 * H) == 0) for end, taken in snapshotted.items())
    history = first.prompt + first.output[:-1]
    second = engine.add_request(history + [5] * 3, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()
    assert second.cached_tokens == (len(history) - 1) // (2 * H) * 2 * H
    while engine.has_work():
        engine.step()
        check_references(engine)
    assert second.output == generate_ids(model, second.prompt, 8, SamplingParams(max_tokens=8, temperature=0))
    assert first.output == generate_ids(model, prompt, 5 * H, SamplingParams(max_tokens=5 * H, temperature=0))
