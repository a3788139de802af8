"""Speculative decoding in the serving engine (SPEC §11) on its pools: greedy ids equal plain decoding with prefix
hits, rows of one batch accepting different numbers of drafts, the same drafts and acceptances as `openk3 generate
--speculative` (so the draft's paged latents and the features resumed from a prefix hit are the ones generate
computes), seeded sampling equal to it token for token, prefix-cache checkpoints taken only at accepted tokens; and
`openk3 serve --speculative 3` against a server without it through HTTP."""

import random

import httpx
import pytest
import torch

from openk3.cache.state import KDAState
from openk3.cli import main
from openk3.draft import EagleDraft, SpeculationStats, load_draft, speculative_generate, tapped_hidden_states
from openk3.generation import generate_ids
from openk3.interop import load_pretrained
from openk3.sampling import SamplingParams
from openk3.serve.engine import Engine, EngineConfig
from openk3.serve.scheduler import SchedulerConfig
from openk3.tokenizer import TextTokenizer
from serve_process import metric, serve_process
from spec_tiny import DRAFT_STEPS, trained_runs
from test_paged_engine import check_references
from train_tiny import one_thread

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
    """Two real servers on the same checkpoint, with and without --speculative 3: the same completions, a repeated
    prompt hitting the prefix cache in both, the usage unchanged, and /metrics counting drafts and acceptances."""
    ckpt = str(trained[0])
    prompts = ["def split(self, text):\n    return [line for line in text.splitlines() if line]\n\n", "import ",
               "def split(self, text):\n    return [line for line in text.splitlines() if line]\n\nclass "]
    replies = []
    for extra in ([], ["--speculative", "3"]):
        with serve_process("--ckpt", ckpt, "--model-name", "x", "--hash-block", "16", *extra) as (url, _):
            got = []
            for prompt in prompts + prompts[:1]:
                body = {"model": "x", "prompt": prompt, "max_tokens": 14, "temperature": 0}
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
                got.append((r["choices"][0]["text"], r["usage"]["completion_tokens"], r["usage"]["prompt_tokens"]))
                cached = r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            assert cached > 0  # the repeated prompt hit the prefix cache
            drafts, accepted = metric(url, "spec_decode_drafts_total"), metric(url, "spec_decode_accepted_tokens")
            if extra:
                assert drafts > 0 and 0 < accepted <= 3 * drafts
                assert metric(url, "spec_decode_draft_tokens_total") == 3 * drafts
            else:
                assert drafts == 0
            replies.append(got)
    assert replies[0] == replies[1]
    assert all(n == 14 for _, n, _ in replies[1])
