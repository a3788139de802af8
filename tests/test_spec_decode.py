"""Speculative decoding (SPEC §11) in `openk3 generate`: greedy ids identical to plain decoding, the rolled-back KDA
state equal to a fresh recurrence over the accepted tokens (bitwise), and with sampling the target's distribution
kept (chi-square tests, each with a false-alarm rate of 1e-3 for a random seed set; the seeds here are fixed, so
each outcome is reproducible)."""

import copy
import random

import pytest
import torch

from openk3.cli import main
from openk3.config import ModelConfig
from openk3.draft import EagleDraft, SpeculationStats, accept_drafts, accept_greedy, load_draft, speculative_generate
from openk3.generation import generate_ids
from openk3.interop import load_pretrained
from openk3.model import K3ForCausalLM, KimiDeltaAttention, configure_kda
from openk3.ops.conv import causal_conv1d
from openk3.ops.kda import kda
from openk3.sampling import SamplingParams
from random_weights import randomise
from spec_tiny import DRAFT_STEPS, trained_runs
from train_tiny import TINY, one_thread

FALSE_ALARM = 1e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return trained_runs(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def trained(runs):
    ckpt = runs[2] / f"step-{DRAFT_STEPS:06d}"
    model = load_pretrained(ckpt).eval()
    return model, load_draft(model, ckpt)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed `counts` against `probs`; cells expecting fewer than 5 are pooled."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small].double(), counts[small].sum().double().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2.0), stat / 2))


def test_greedy_generate_is_identical_with_speculation(runs, capsys):
    ckpt = str(runs[2])
    texts = []
    for extra in ([], ["--speculative", "3"]):
        with one_thread():
            assert main(["generate", "--ckpt", ckpt, "--prompt", "def ", "--max-new-tokens", "24",
                         "--temperature", "0", *extra]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > len("def ")


@pytest.mark.parametrize("draft_kind", ["trained", "untrained"])
def test_greedy_ids_identical_for_any_draft_and_k(trained, draft_kind):
    """The trained draft is mostly accepted; a fresh one mostly rejected (every rollback path runs)."""
    model, draft = trained
    if draft_kind == "untrained":
        draft = EagleDraft(model)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=20, temperature=0)
    with one_thread():
        for length, k in ((5, 1), (23, 3), (40, 2)):
            prompt = torch.randint(0, TINY["vocab_size"], (length,), generator=gen).tolist()
            stats = SpeculationStats()
            want = generate_ids(model, prompt, 20, params)
            assert speculative_generate(model, draft, prompt, 20, params, k, stats=stats) == want
            assert stats.rounds > 0 and stats.drafted == k * stats.rounds
            stop = want[7]  # a stop id ends both at its first occurrence, unreturned
            assert speculative_generate(model, draft, prompt, 20, params, k, {stop}) == want[:want.index(stop)]


def kda_inputs(layer: KimiDeltaAttention, x: torch.Tensor, conv_state: torch.Tensor):
    """What the layer feeds the recurrence for inputs x [1,T,D] after the conv window `conv_state`."""
    B, T, _ = x.shape
    H, K = layer.num_heads, layer.head_dim
    qkv = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)
    y, _ = causal_conv1d(qkv, layer.conv_weight(), conv_state)
    q, k, v = (t.reshape(B, T, H, K) for t in y.split(H * K, dim=-1))
    q, k, g, beta = layer.activate(q, k, x, "recurrent")
    return qkv, q, k, v, g, beta


@pytest.mark.parametrize("kept,backend", [(1, "auto"), (2, "auto"), (3, "recurrent")])
def test_rolled_back_kda_state_is_a_fresh_recurrence_bitwise(kept, backend):
    """Verification of 4 tokens recording states after 1..3 of them (one `kda(state_offsets=...)` call per layer),
    rewound to `kept`: every KDA layer's recurrent state and conv window equal, to the bit, a fresh recurrence over
    the kept tokens from the state before the verification (same inputs: the layer's KDA inputs are computed from
    the verification's own layer inputs, since a linear layer over fewer than 4 rows rounds differently on CPU).
    "auto" on CPU: a verification this short runs the recurrence (ops/kda/__init__.py, SHORT_CALL_TOKENS)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_dict(TINY)).eval()
    randomise(model, 3)
    configure_kda(model, backend=backend)
    layers = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.__setitem__(mod, args[0])) for m in layers]
    with torch.no_grad(), one_thread():
        cache = model.new_cache(1)
        model(torch.randint(0, 320, (1, 9)), cache=cache)
        before = copy.deepcopy(cache)
        cache.checkpoints, cache.checkpoint_offsets = {}, (1, 2, 3)
        model(torch.randint(0, 320, (1, 4)), cache=cache)
        cache.rewind([kept], 4)
        assert cache.lengths.tolist() == [9 + kept]
        for layer in layers:
            pre = before.layers[layer.layer_idx]
            qkv, q, k, v, g, beta = kda_inputs(layer, seen[layer], pre.conv_state)
            _, state = kda(q[:, :kept], k[:, :kept], v[:, :kept], g[:, :kept], beta[:, :kept],
                           initial_state=pre.recurrent_state, output_final_state=True, backend="recurrent",
                           gate_min=layer.gate_min())
            window = torch.cat([pre.conv_state, qkv[:, :kept].transpose(1, 2)], dim=-1)[..., kept:]
            now = cache.layers[layer.layer_idx]
            assert torch.equal(now.recurrent_state, state)
            assert torch.equal(now.conv_state, window)
    for hook in hooks:
        hook.remove()


def test_rolled_back_cache_continues_like_a_fresh_forward(trained):
    """Model level, default backends: after a rewind the next logits match a cache fed only the kept tokens."""
    model, _ = trained
    ids = torch.randint(0, TINY["vocab_size"], (1, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), one_thread():
        cache = model.new_cache(1)
        model(ids[:, :8], cache=cache)
        fresh = copy.deepcopy(cache)
        cache.checkpoints, cache.checkpoint_offsets = {}, (1, 2, 3)
        model(ids[:, 8:12], cache=cache)
        cache.rewind([2], 4)
        model(ids[:, 8:10], cache=fresh)
        torch.testing.assert_close(model(ids[:, 10:14], cache=cache).logits,
                                   model(ids[:, 10:14], cache=fresh).logits, rtol=1e-5, atol=1e-5)


def test_accept_drafts_keeps_the_target_distribution():
    """Rejection sampling alone, K = 2, fixed p and q far apart, 6000 rows in one batch (each its own random source):
    the first output token ~ p_0, and the second (present iff the first draft was accepted) ~ p_1. Greedy rows in
    the same batch keep a draft iff it is the target's argmax and end with the argmax."""
    gen = torch.Generator().manual_seed(0)
    V, n = 6, 6000
    target = torch.randn(3, V, generator=gen) * 1.5
    q = torch.softmax(torch.randn(2, V, generator=gen) * 1.5, -1)
    sampled, greedy = SamplingParams(temperature=1.0), SamplingParams(temperature=0)
    best = target.argmax(-1).tolist()
    wrong = (best[0] + 1) % V
    drafted = [torch.multinomial(q, 1, generator=gen).flatten().tolist() for _ in range(n)]
    drafted += [[best[0], best[1]], [wrong, best[1]]]
    params = [sampled] * n + [greedy] * 2
    out = accept_drafts(drafted, q.expand(n + 2, 2, V), target.expand(n + 2, 3, V), params,
                        [random.Random(i) for i in range(n + 2)])
    assert out[n:] == [best, best[:1]]
    first, second = torch.zeros(V), torch.zeros(V)
    for tokens in out[:n]:
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    p = torch.softmax(target, -1)
    assert 0 < second.sum() < n  # both outcomes happen
    assert chi_square_p_value(first, p[0]) > FALSE_ALARM
    assert chi_square_p_value(second, p[1]) > FALSE_ALARM


def test_accept_greedy_equals_accept_drafts_for_greedy_rows():
    """The serving engine's argmax fast path against the general rejection sampler, ties included."""
    gen = torch.Generator().manual_seed(5)
    greedy = SamplingParams(temperature=0)
    logits = torch.randint(0, 3, (200, 4, 5), generator=gen).float()  # small integers: many ties
    drafted = torch.randint(0, 5, (200, 3), generator=gen).tolist()
    for trial in range(1, 200, 2):
        drafted[trial][: trial % 3] = logits[trial].argmax(-1)[: trial % 3].tolist()  # accepted prefixes of all lengths
    general = accept_drafts(drafted, None, logits, [greedy] * 200, [random.Random(0)] * 200)
    assert general == [accept_greedy(d, picks) for d, picks in zip(drafted, logits.argmax(-1).tolist())]


def test_sampled_speculative_generation_keeps_the_target_distribution():
    """End to end on an 8-token vocabulary: the second generated token (the first one a speculative round produces,
    here with an untrained draft, so drafts are often rejected) has the target's distribution sum_a p(a) p(b | a)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_dict({**TINY, "vocab_size": 8})).eval()
    randomise(model, 1)
    configure_kda(model, backend="recurrent")  # the cheapest form for a handful of tokens
    draft = EagleDraft(model)
    prompt = [1, 5, 2, 7, 3]
    params = dict(max_tokens=2, temperature=1.5)
    with torch.no_grad(), one_thread():
        p_first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float() / 1.5, -1)
        nexts = torch.stack([torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1].float() / 1.5, -1)
                             for a in range(8)])
        want = p_first @ nexts
        counts, stats = torch.zeros(8), SpeculationStats()
        for seed in range(600):
            out = speculative_generate(model, draft, prompt, 2, SamplingParams(seed=seed, **params), 2, stats=stats)
            counts[out[1]] += 1
    assert stats.accepted < stats.drafted  # rejections happened
    assert (want > 0.02).sum() >= 3  # a distribution worth testing
    assert chi_square_p_value(counts, want) > FALSE_ALARM
