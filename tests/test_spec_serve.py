"""Speculative decoding in the serving engine (SPEC §11) on its pools: greedy ids equal plain decoding with prefix
hits, rows of one batch accepting different numbers of drafts, the same drafts and acceptances as `openk3 generate
--speculative` (so the draft's paged latents and the features resumed from a prefix hit are the ones generate
computes), seeded sampling equal to it token for token, prefix-cache checkpoints taken only at accepted tokens; with
dynamic speculation (K chosen per step, switching between rounds and plain steps mid-generation) greedy text
unchanged, the draft's latents those of its own step over the target's features, and the sampled distribution the
target's (chi-square); `openk3 serve` with the default `auto` on a checkpoint with a draft against `--speculative 0`
through HTTP."""

import itertools
import random

import httpx
import pytest
import torch

from openk3.cache import MLALayerCache
from openk3.cache.state import KDAState
from openk3.cli import build_parser, main
from openk3.config import ModelConfig
from openk3.draft import EagleDraft, SpeculationStats, load_draft, speculative_generate, tapped_hidden_states
from openk3.generation import generate_ids
from openk3.interop import load_pretrained
from openk3.model import K3ForCausalLM, configure_kda
from openk3.ops.paged_mla import paged_positions
from openk3.sampling import SamplingParams
from openk3.serve.command import build_engine
from openk3.serve.engine import Engine, EngineConfig
from openk3.serve.scheduler import SchedulerConfig
from openk3.serve.speculation import DEFAULT_K, SpecPolicy
from openk3.tokenizer import TextTokenizer
from random_weights import randomise
from serve_process import metric, serve_process
from spec_tiny import DRAFT_STEPS, trained_runs
from test_paged_engine import check_references
from test_spec_decode import FALSE_ALARM, chi_square_p_value
from train_tiny import TINY, one_thread

H = 16  # hash block; pages of 4 blocks


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    ckpt = trained_runs(tmp_path_factory.mktemp("spec"))[2] / f"step-{DRAFT_STEPS:06d}"
    model = load_pretrained(ckpt).eval()
    with one_thread():
        yield ckpt, model, load_draft(model, ckpt), TextTokenizer.from_file(ckpt / "tokenizer.json")


def prompts_sharing_a_prefix(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(vocab) for _ in range(2 * H + 9)]
    return [system + [rng.randrange(vocab) for _ in range(n)] for n in (3, 20, 37)] + [[5, 6, 7], system[:20]]


def run(engine: Engine, prompts, params_for, events: list | None = None) -> list:
    """Submit one prompt per step (later ones hit the earlier ones' blocks) and run to the end; each request's
    events are appended to events[i] when given."""
    requests, pending = [], list(enumerate(prompts))
    while pending or engine.has_work():
        if pending:
            i, prompt = pending.pop(0)
            on_event = events[i].append if events is not None else None
            requests.append(engine.add_request(prompt, params_for(i), on_event=on_event))
        engine.step()
        check_references(engine)
    return requests


def engine_for(tokenizer, model, draft=None, k=0, **kw):
    sched = SchedulerConfig(max_running=4, prefill_tokens_per_step=48)
    return Engine(model, tokenizer, EngineConfig(hash_block=H, page_size=4 * H, speculative=k, scheduler=sched, **kw),
                  draft)


@pytest.mark.parametrize("k,fresh_draft", [(3, False), (2, True)])
def test_engine_greedy_speculation_equals_generate(trained, k, fresh_draft, monkeypatch):
    _, model, draft, tok = trained
    draft = EagleDraft(model) if fresh_draft else draft
    prompts = prompts_sharing_a_prefix(model.config.vocab_size)
    engine = engine_for(tok, model, draft, k)
    lengths, verify = [], engine._verify

    def recording(drafts, logits):
        kept = verify(drafts, logits)
        lengths.append([len(tokens) for tokens in kept])
        return kept

    monkeypatch.setattr(engine, "_verify", recording)
    requests = run(engine, prompts, lambda i: SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    greedy, stats = SamplingParams(temperature=0), SpeculationStats()
    for r in requests:
        assert r.finish_reason == "length" and r.output == generate_ids(model, r.prompt, 12, greedy)
        speculative_generate(model, draft, r.prompt, 12, greedy, k, stats=stats)
    assert sum(r.cached_tokens for r in requests) > 0  # prefix hits happened
    m = engine.metrics
    assert (m.spec_drafts, m.spec_draft_tokens, m.spec_accepted_tokens) == (stats.rounds, stats.drafted,
                                                                           stats.accepted)
    assert any(len(set(row)) > 1 for row in lengths)  # one batch, different acceptance lengths
    assert m.generation_tokens == 12 * len(prompts)
    assert engine.states.num_free == engine.states.num_slots


@pytest.mark.parametrize("top_p", [0.95, 1.0])  # a cut (distributions), the temperature alone (the draft's logits)
def test_engine_sampled_speculation_equals_generate_seed_for_seed(trained, top_p):
    _, model, draft, tok = trained
    prompts = prompts_sharing_a_prefix(model.config.vocab_size)[:4]
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=top_p, seed=11 + i) for i in range(4)]
    requests = run(engine_for(tok, model, draft, 3), prompts, params.__getitem__)
    for r, p in zip(requests, params):
        assert r.output == speculative_generate(model, draft, r.prompt, 10, p, 3, set(tok.stop_ids))


def test_logprobs_penalties_and_stops_match_plain_decoding(trained):
    """Rows that cannot compare raw argmaxes (a logit bias, penalties, logprobs) go through the distributions; text,
    logprobs and finish reasons equal a plain engine's."""
    _, model, draft, tok = trained
    prompts = prompts_sharing_a_prefix(model.config.vocab_size)[:3]
    text = tok.decode_plain(generate_ids(model, prompts[2], 12, SamplingParams(temperature=0)))
    stop = next(c for c in text[len(text) // 2:] if c != "\ufffd")  # ends the third reply midway
    params = [SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, frequency_penalty=0.7, logit_bias={3: 5.0},
                             ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, stop=[stop], logprobs=0, ignore_eos=True)]
    events = [[[] for _ in prompts] for _ in range(2)]
    plain = run(engine_for(tok, model), prompts, params.__getitem__, events[0])
    spec = run(engine_for(tok, model, draft, 3), prompts, params.__getitem__, events[1])
    for a, b in zip(plain, spec):
        assert (a.output, a.text, a.finish_reason) == (b.output, b.text, b.finish_reason)
    assert spec[2].finish_reason == "stop" and spec[0].finish_reason == "length"
    for a, b in zip(*events):
        logprobs = [[lp for e in run_events for lp in e.logprobs] for run_events in (a, b)]
        assert [lp.token for lp in logprobs[0]] == [lp.token for lp in logprobs[1]]
        for x, y in zip(*logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert len([lp for e in events[1][0] for lp in e.logprobs]) == 12


def test_sequences_near_the_context_limit_fall_back_to_one_token_steps(trained):
    _, model, draft, tok = trained
    config = model.config
    model.config = config.with_overrides({"max_seq_len": 48})
    try:
        prompts = [p[:30] for p in prompts_sharing_a_prefix(config.vocab_size)[:2]]
        params = lambda i: SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)  # noqa: E731
        plain = run(engine_for(tok, model), prompts, params)
        engine = engine_for(tok, model, draft, 3)
        spec = run(engine, prompts, params)
    finally:
        model.config = config
    for a, b in zip(plain, spec):
        assert a.output == b.output and a.finish_reason == b.finish_reason == "length"
        assert len(b.prompt) + len(b.output) == 48
    assert engine.metrics.spec_drafts > 0


def test_prefix_cache_checkpoints_are_states_of_accepted_tokens(trained):
    """Every KDA checkpoint the cache holds equals a fresh forward over its block chain's tokens, and carries the
    draft feature of the chain's last token: nothing past an accepted token, nothing from a rejected draft."""
    _, model, draft, tok = trained
    engine = engine_for(tok, model, draft, 3)
    run(engine, prompts_sharing_a_prefix(model.config.vocab_size),
        lambda i: SamplingParams(max_tokens=30, temperature=0.8, seed=i, ignore_eos=True))
    entries, stack = [], list(engine.prefix_cache.roots.values())
    while stack:
        entry = stack.pop()
        entries.append(entry)
        stack.extend(entry.children.values())
    checked = 0
    for entry in entries:
        if entry.checkpoint is None:
            continue
        chain, e = [], entry
        while e is not None:
            chain[:0], e = list(e.tokens), e.parent
        cache = model.new_cache(1)
        with torch.no_grad(), tapped_hidden_states(model, draft.taps) as tapped:
            model(torch.tensor([chain]), cache=cache)
            feature = draft.fuse(tapped)[0, -1]
        state = cache.extract(0)
        kda = [s for s in state.layers if isinstance(s, KDAState)]
        payload = entry.checkpoint.payload
        torch.testing.assert_close(payload["recurrent"], torch.stack([s.recurrent for s in kda]), rtol=1e-4,
                                   atol=1e-5)
        torch.testing.assert_close(payload["conv"], torch.stack([s.conv for s in kda]), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(payload["feature"], feature, rtol=1e-4, atol=1e-5)
        checked += 1
    assert checked >= 8  # prompt blocks and blocks completed while decoding speculatively


def test_speculative_serving_needs_a_draft(trained, capsys):
    _, model, _, tok = trained
    with pytest.raises(ValueError, match="'speculative' needs a draft model"):
        Engine(model, tok, EngineConfig(speculative=2))
    assert main(["serve", "--preset", "k3-tiny", "--port", "0", "--speculative", "2"]) == 2
    assert "--speculative needs --ckpt" in capsys.readouterr().err


def test_server_greedy_text_identical_with_speculation(trained):
    """Two real servers on the same checkpoint (it holds a draft), with --speculative 0 and the default (auto: rounds
    of 3 drafts where they pay): the same completions, a repeated prompt hitting the prefix cache in both, the usage
    unchanged, and /metrics counting drafts, acceptances and steps by K."""
    ckpt = str(trained[0])
    prompts = ["def split(self, text):\n    return [line for line in text.splitlines() if line]\n\n", "import ",
               "def split(self, text):\n    return [line for line in text.splitlines() if line]\n\nclass "]
    replies = []
    for extra in (["--speculative", "0"], []):
        with serve_process("--ckpt", ckpt, "--model-name", "x", "--hash-block", "16", *extra) as (url, _):
            got = []
            for prompt in prompts + prompts[:1]:
                body = {"model": "x", "prompt": prompt, "max_tokens": 14, "temperature": 0}
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
                got.append((r["choices"][0]["text"], r["usage"]["completion_tokens"], r["usage"]["prompt_tokens"]))
                cached = r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            assert cached > 0  # the repeated prompt hit the prefix cache
            drafts, accepted = metric(url, "spec_decode_drafts_total"), metric(url, "spec_decode_accepted_tokens")
            if not extra:  # auto: the first step measures the acceptance with a round
                assert drafts > 0 and 0 <= accepted <= 3 * drafts
                assert metric(url, "spec_decode_draft_tokens_total") == 3 * drafts
                assert metric(url, 'spec_decode_steps_total{k="3"}') > 0
                assert 0 <= metric(url, "spec_decode_accepted_average") <= 3
            else:
                assert drafts == 0 and metric(url, "spec_decode_steps_total") == 0
            replies.append(got)
    assert replies[0] == replies[1]
    assert all(n == 14 for _, n, _ in replies[1])


class Scripted:
    """A test hook in the speculation policy's place (`Engine.policy`): each step's drafts per round from a fixed
    cycle, switching between rounds and runs of plain steps mid-generation; it records what the rounds accepted."""

    def __init__(self, ks):
        self.ks, self.accepted, self.observed = itertools.cycle(ks), None, []

    def choose(self, batch: int) -> int:
        return next(self.ks)

    def observe(self, accepted) -> None:
        self.observed.extend(accepted)


PLAN = (0, 0, 0, 0, 0, 3, 3, 0, 3, 0, 0, 3, 0, 0, 0)  # runs of plain steps long enough to fill the pending positions


@pytest.mark.parametrize("policy", ["scripted", "measured"])
def test_dynamic_speculation_keeps_greedy_text(trained, policy):
    _, model, draft, tok = trained
    prompts = prompts_sharing_a_prefix(model.config.vocab_size)
    engine = engine_for(tok, model, draft, 3, auto_speculation=True)
    assert isinstance(engine.policy, SpecPolicy)
    if policy == "scripted":
        engine.policy = Scripted(PLAN)
    requests = run(engine, prompts, lambda i: SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    greedy = SamplingParams(temperature=0)
    for r in requests:
        assert r.finish_reason == "length" and r.output == generate_ids(model, r.prompt, 16, greedy)
    assert sum(r.cached_tokens for r in requests) > 0
    m = engine.metrics
    assert m.spec_steps.get(3, 0) > 0 and m.spec_drafts > 0
    if policy == "scripted":
        assert m.spec_steps.get(0, 0) > 0 and len(engine.policy.observed) == m.spec_drafts
    else:
        assert m.spec_accepted_average == engine.policy.accepted and 0 <= m.spec_accepted_average <= 3
    assert engine.states.num_free == engine.states.num_slots


def test_plain_steps_keep_the_drafts_latents(trained):
    """After rounds and runs of plain steps, the draft's latent of every position whose draft inputs are final equals
    the draft's own step over the target's features of the sequence (position t reads F_{t-1} and token t), and the
    pending features are the target's: a plain step leaves the draft nothing to catch up on."""
    _, model, draft, tok = trained
    engine = engine_for(tok, model, draft, 3, auto_speculation=True, prefix_cache=False)
    engine.policy = Scripted(PLAN)
    prompt = prompts_sharing_a_prefix(model.config.vocab_size)[1]
    r = engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    while len(r.output) < 40:
        engine.step()
    assert engine.metrics.spec_steps[0] > 5 and engine.metrics.spec_steps[3] > 3
    tokens = (r.prompt + r.output)[: r.fed + 1]  # the last one, at position r.fed, is not consumed yet
    with torch.no_grad(), tapped_hidden_states(model, draft.taps) as tapped:
        model(torch.tensor([tokens[:-1]]), cache=model.new_cache(1))
        features = draft.fuse(tapped)
        prev = torch.cat([features.new_zeros(1, 1, features.shape[-1]), features], dim=1)
        latents = MLALayerCache(features.new_zeros(1, 0, engine.pages.width))
        draft.step(prev, torch.tensor([tokens]), latents, torch.tensor([0]))
    pending = engine.features[r]
    final = r.fed + 1 - len(pending)  # positions before this one have their final draft inputs
    assert 1 <= len(pending) <= 4 and final > len(prompt) + 30
    torch.testing.assert_close(pending, features[0, final - 1:], rtol=1e-4, atol=1e-5)
    slot = torch.tensor([r.slot])
    rows = paged_positions(engine.tables.tables, slot, torch.arange(final).view(1, -1), engine.page_size)[0]
    torch.testing.assert_close(engine.pages.pages[-1].view(-1, engine.pages.width)[rows], latents.buffer[0, :final],
                               rtol=1e-4, atol=1e-5)


def test_dynamic_speculation_keeps_the_target_distribution(trained):
    """On an 8-token vocabulary with an untrained draft (drafts often rejected), 480 seeded requests in batches of 32
    through an engine switching between rounds of 2 drafts and plain steps every step: the second and third tokens,
    each made by a round for some requests and by a plain step right after a round or before one for others, have
    the target's distributions sum_a p(a) p(b | a) and sum_ab p(a) p(b | a) p(c | a, b)."""
    _, _, _, tok = trained
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_dict({**TINY, "vocab_size": 8})).eval()
    randomise(model, 1)
    configure_kda(model, backend="recurrent")
    prompt, temperature = [1, 5, 2, 7, 3], 1.5
    with torch.no_grad():
        def next_probs(prefixes):
            logits = model(torch.tensor([prompt + p for p in prefixes])).logits[:, -1].float()
            return torch.softmax(logits / temperature, -1)

        first = next_probs([[]])[0]
        second = next_probs([[a] for a in range(8)])  # [a, b]
        third = next_probs([[a, b] for a in range(8) for b in range(8)]).view(8, 8, 8)
    want = [first @ second, torch.einsum("a,ab,abc->c", first, second, third)]
    engine = Engine(model, tok, EngineConfig(prefix_cache=False, hash_block=H, speculative=2, auto_speculation=True,
                                             scheduler=SchedulerConfig(max_running=32, prefill_tokens_per_step=256)),
                    EagleDraft(model))
    engine.policy = Scripted((2, 0))
    requests = [engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=temperature, seed=seed,
                                                          ignore_eos=True)) for seed in range(480)]
    while engine.has_work():
        engine.step()
    counts = torch.zeros(2, 8)
    for r in requests:
        assert len(r.output) == 3
        counts[0, r.output[1]] += 1
        counts[1, r.output[2]] += 1
    m = engine.metrics
    assert m.spec_steps[0] > 5 and m.spec_steps[2] > 5 and 0 < m.spec_accepted_tokens < m.spec_draft_tokens
    for observed, p in zip(counts, want):
        assert (p > 0.02).sum() >= 3  # a distribution worth testing
        assert chi_square_p_value(observed, p) > FALSE_ALARM


def test_serve_speculates_by_default_when_the_checkpoint_holds_a_draft(trained, capsys):
    ckpt = trained[0]
    parse = build_parser().parse_args
    engine, _ = build_engine(parse(["serve", "--ckpt", str(ckpt), "--threads", "1"]))
    assert isinstance(engine.policy, SpecPolicy) and engine.config.speculative == DEFAULT_K
    engine, _ = build_engine(parse(["serve", "--ckpt", str(ckpt), "--threads", "1", "--speculative", "2"]))
    assert engine.policy is None and engine.config.speculative == 2  # a number: every step, as before
    assert "rounds of 2 drafts, every step" in capsys.readouterr().err
    target = trained_runs(ckpt.parent)[1]  # a checkpoint without a draft: off, no error
    engine, _ = build_engine(parse(["serve", "--ckpt", str(target), "--threads", "1"]))
    assert engine.draft is None and engine.policy is None and engine.config.speculative == 0
    assert main(["serve", "--preset", "k3-tiny", "--port", "0", "--speculative", "auto"]) == 2
    assert "--speculative needs --ckpt" in capsys.readouterr().err


def host_reads_per_round(engine: Engine, prompts, params, monkeypatch) -> float:
    """Copies to the host (`HostCopy.tolist`, which `host_list` uses too) inside speculative rounds, per round."""
    from openk3.ops.transfer import HostCopy

    reads, rounds, inside = [0], [0], [False]
    speculate, tolist = engine._speculate, HostCopy.tolist

    def counting_round(requests):
        inside[0], rounds[0] = True, rounds[0] + 1
        try:
            speculate(requests)
        finally:
            inside[0] = False

    def counting_read(self):
        reads[0] += inside[0]
        return tolist(self)

    monkeypatch.setattr(engine, "_speculate", counting_round)
    monkeypatch.setattr(HostCopy, "tolist", counting_read)
    run(engine, prompts, lambda i: params)
    monkeypatch.undo()
    assert rounds[0] > 0
    return reads[0] / rounds[0]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_rounds_host_reads_do_not_grow_with_k(trained, temperature, monkeypatch):
    """Greedy rows and rows shaped by the temperature alone: the K draft passes and the verification are queued
    back to back, each pass reading the last one's tokens on the device; the host reads the K drafts at once."""
    _, model, draft, tok = trained
    prompts = prompts_sharing_a_prefix(model.config.vocab_size)[:2]
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=3, ignore_eos=True)
    per_round = [host_reads_per_round(engine_for(tok, model, draft, k), prompts, params, monkeypatch) for k in (1, 3)]
    assert per_round[0] == per_round[1] <= 2
