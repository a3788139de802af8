"""openk3.sampling's OpenAI parts against plain references: logit bias and presence / frequency penalties (OpenAI's
formula, before the temperature), the sampling distribution and the draw by inversion, a batch sampled together
against each row alone, per-choice seeds and token logprobs; the stop-string
helpers and the logprob text offsets of the server's responses."""

import math
import random

import pytest
import torch

from openk3.sampling import (
    LOGPROB_FLOOR,
    SamplingParams,
    adjust_logits,
    adjusted_logits,
    choice_seed,
    draw_by_inversion,
    request_rng,
    sample_token,
    sample_tokens,
    sampling_probs,
    token_logprobs,
)
from openk3.serve.responses import ChoiceLogprobs, TokenNames
from openk3.serve.stop_strings import first_stop, held_back

INF = float("inf")


def adjust_reference(logits: list[float], previous: list[int], params: SamplingParams) -> list[float]:
    """OpenAI's definition, token by token in float64: mu[j] + bias[j] - c[j] * frequency - [c[j] > 0] * presence,
    c[j] the count of j among the tokens generated so far."""
    out = []
    for j, mu in enumerate(logits):
        c = previous.count(j)
        out.append(mu + params.logit_bias.get(j, 0.0) - c * params.frequency_penalty
                   - (params.presence_penalty if c > 0 else 0.0))
    return out


def random_case(rng: random.Random, vocab: int):
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) * rng.choice([1, 30])
    previous = [rng.randrange(vocab + 3) for _ in range(rng.randint(0, 40))]  # ids past the vocab are ignored
    bias = {rng.randrange(vocab + 2): rng.uniform(-100, 100) for _ in range(rng.randint(0, 4))}
    params = SamplingParams(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                            logit_bias=bias, temperature=rng.choice([0.3, 1.0, 2.5]))
    return logits, previous, params


def test_bias_and_penalties_follow_the_openai_formula():
    rng = random.Random(0)
    for vocab in (1, 2, 37, 1001):
        for _ in range(20):
            logits, previous, params = random_case(rng, vocab)
            got = adjust_logits(logits, params, previous)
            expected = torch.tensor(adjust_reference(logits.tolist(), previous, params), dtype=torch.float64)
            assert got.dtype == torch.float32
            assert torch.allclose(got.double(), expected, rtol=1e-6, atol=1e-4)
    # extreme values: infinities stay what they are, the largest finite fp32 does not overflow under a penalty
    logits = torch.tensor([-INF, INF, 3e38, -3e38, 0.0])
    params = SamplingParams(presence_penalty=2.0, frequency_penalty=-2.0, logit_bias={4: -100.0})
    got = adjust_logits(logits, params, [0, 0, 1, 2, 3, 3, 3])
    assert got[0] == -INF and got[1] == INF and torch.isfinite(got[2:]).all()
    assert got.tolist()[4] == -100.0 and got.tolist()[3] < -3e38 + 1e33
    assert adjust_logits(logits, SamplingParams(), [0, 1, 2]) is logits  # nothing to apply: untouched


def test_the_batched_adjustment_equals_each_row_alone():
    """adjusted_logits over a batch (rows with and without bias or penalties, ids past the vocabulary, empty
    histories, NaN logits) equals adjust_logits row by row, bitwise."""
    rng = random.Random(9)
    for _ in range(30):
        vocab, rows = rng.randint(1, 30), []
        for _ in range(rng.randint(1, 6)):
            logits, previous, params = random_case(rng, vocab)
            if rng.random() < 0.3:
                params = SamplingParams(temperature=params.temperature)  # nothing to adjust
            if rng.random() < 0.2:
                logits[rng.randrange(vocab)] = float("nan")
            rows.append((logits, previous, params))
        logits = torch.stack([r[0] for r in rows])
        got = adjusted_logits(logits, [r[2] for r in rows], [r[1] for r in rows])
        for row, (x, previous, params) in zip(got, rows):
            want = adjust_logits(x.masked_fill(x.isnan(), -INF), params, previous)
            assert torch.equal(row, want)


def test_the_distribution_applies_penalties_before_the_temperature():
    rng = random.Random(1)
    for _ in range(30):
        logits, previous, params = random_case(rng, 53)
        probs = sampling_probs(adjust_logits(logits, params, previous), params)
        adjusted = torch.tensor(adjust_reference(logits.tolist(), previous, params), dtype=torch.float64)
        expected = torch.softmax(adjusted / params.temperature, dim=-1)
        assert torch.allclose(probs.double(), expected, atol=1e-6)
    # the order matters: a presence penalty of 1 at temperature 0.5 ties tokens 1 and 2 ([0, 1, 2] -> [0, 1, 1]);
    # subtracting it after the temperature would not ([0, 2, 4] -> [0, 2, 3])
    params = SamplingParams(temperature=0.5, presence_penalty=1.0)
    probs = sampling_probs(adjust_logits(torch.tensor([0.0, 1.0, 2.0]), params, [2]), params)
    assert probs[1] == probs[2] > 0.4
    # greedy picks the argmax of the adjusted logits: a penalty can move it off the raw argmax
    logits = torch.tensor([0.0, 5.0, 4.0])
    greedy = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert sample_token(logits, greedy, random.Random(0), [1]) == 1  # 5 - 1 > 4
    assert sample_token(logits, greedy, random.Random(0), [1, 1]) == 2  # 5 - 2 < 4
    biased = SamplingParams(temperature=0, logit_bias={0: 100.0})
    assert sample_token(logits, biased, random.Random(0)) == 0


def test_top_k_and_top_p_reference():
    """sampling_probs' cuts against a plain sort: top-k keeps the k largest (ties kept), top-p the most likely
    tokens until their mass reaches p (the one crossing it included: the most likely token always)."""
    rng = random.Random(2)
    for _ in range(40):
        vocab = rng.randint(1, 40)
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        params = SamplingParams(temperature=rng.choice([0.5, 1.0]), top_k=rng.choice([0, 1, 3, 100]),
                                top_p=rng.choice([1.0, 0.9, 0.3, 1e-6, 1e-300]))  # 1e-300: 0 in fp32
        probs = sampling_probs(logits, params).double()
        scaled = [x / params.temperature for x in logits.tolist()]
        keep = set(range(vocab))
        if params.top_k:
            kth = sorted(scaled, reverse=True)[min(params.top_k, vocab) - 1]
            keep = {j for j in keep if scaled[j] >= kth}
        if params.top_p < 1:
            z = sum(math.exp(scaled[j]) for j in keep)
            mass, nucleus = 0.0, set()
            for j in sorted(keep, key=lambda j: (-scaled[j], j)):
                if mass >= params.top_p:
                    break
                nucleus.add(j)
                mass += math.exp(scaled[j]) / z
            keep = nucleus
        z = sum(math.exp(scaled[j]) for j in keep)
        expected = torch.tensor([math.exp(scaled[j]) / z if j in keep else 0.0 for j in range(vocab)])
        assert torch.allclose(probs, expected.double(), atol=1e-6)


def test_draw_by_inversion_gives_each_token_its_mass():
    """A grid of N evenly spaced uniforms lands on each token N * p times (to one), never on a zero-mass token, and
    the extreme uniforms 0 and the largest below 1 pick the first and the last token of positive mass."""
    rng = random.Random(5)
    for _ in range(30):
        vocab = rng.randint(1, 60)
        probs = torch.rand(vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        probs[torch.rand(vocab) < 0.4] = 0.0  # zero-mass tokens among the others, at the ends too
        probs[rng.randrange(vocab)] += 1e-3  # at least one token has mass
        probs *= rng.choice([1.0, 1e-30, 1e30])  # unnormalised, at extreme scales
        n = 4000
        grid = (torch.arange(n, dtype=torch.float64) + 0.5) / n
        drawn = draw_by_inversion(probs.expand(n, vocab), grid)
        counts = torch.bincount(drawn, minlength=vocab).double()
        expected = n * probs.double() / probs.double().sum()
        assert ((counts - expected).abs() <= 1 + 1e-6 * n).all() and (counts[probs == 0] == 0).all()
        edges = draw_by_inversion(probs.expand(2, vocab), torch.tensor([0.0, 1 - 2.0**-53], dtype=torch.float64))
        positive = (probs > 0).nonzero().flatten()
        assert edges.tolist() == [positive[0].item(), positive[-1].item()]


def test_a_batch_samples_each_row_as_it_samples_alone():
    """sample_tokens over a batch of mixed rows (greedy, temperatures, top-k / top-p cuts, penalties and bias, rows
    with NaN, +inf or no finite logit) picks what sample_token picks for each row alone with a copy of its
    random source, and leaves every source in the same state."""
    rng = random.Random(6)
    vocab = 37
    for _ in range(20):
        rows, params, previous = [], [], []
        for _ in range(rng.randint(1, 9)):
            logits, prev, adjusted = random_case(rng, vocab)
            kind = rng.choice(["plain", "adjusted", "greedy", "cut", "nan", "inf", "dead"])
            p = SamplingParams(temperature=rng.choice([0.3, 1.0, 2.5]))
            if kind == "adjusted":
                p = adjusted
            elif kind == "greedy":
                p = SamplingParams(temperature=0.0, presence_penalty=adjusted.presence_penalty)
            elif kind == "cut":
                p = SamplingParams(temperature=0.7, top_k=rng.choice([1, 5, 100]), top_p=rng.choice([1.0, 0.5]))
            elif kind == "nan":
                logits[rng.randrange(vocab)] = float("nan")
            elif kind == "inf":
                logits[rng.randrange(vocab)] = INF
            elif kind == "dead":
                logits.fill_(-INF)
            rows.append(logits)
            params.append(p)
            previous.append(prev)
        seeds = [rng.randrange(1 << 40) for _ in rows]
        batch_gens = [random.Random(s) for s in seeds]
        alone_gens = [random.Random(s) for s in seeds]
        together = sample_tokens(torch.stack(rows), params, batch_gens, previous).tolist()
        alone = [sample_token(x, p, g, prev) for x, p, g, prev in zip(rows, params, alone_gens, previous)]
        assert together == alone
        assert [g.getstate() for g in batch_gens] == [g.getstate() for g in alone_gens]


def test_choice_seeds():
    seeds = [choice_seed(7, i) for i in range(64)]
    assert seeds[0] == 7 and len(set(seeds)) == 64 and seeds == [choice_seed(7, i) for i in range(64)]
    assert choice_seed(8, 1) != seeds[1]
    streams = {tuple(request_rng(choice_seed(seed, i)).random() for _ in range(2))
               for seed in (-(1 << 63), (1 << 63) - 1, 0, 7, -7) for i in range(3)}
    assert len(streams) == 15  # every (seed, choice) its own random source, negative seeds too


def test_a_seeded_draw_does_not_depend_on_other_generators():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, presence_penalty=0.5)

    def draws(interleave: bool) -> list[int]:
        mine, other, out = random.Random(11), random.Random(12), []
        for _ in range(20):
            if interleave:
                sample_token(logits, SamplingParams(temperature=2.0), other)
                torch.rand(3)  # the global generator too
            out.append(sample_token(logits, params, mine, out))
        return out

    assert draws(False) == draws(True)


def test_token_logprobs_reference():
    rng = random.Random(4)
    for vocab in (1, 3, 97):
        for _ in range(10):
            logits = torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) * 10
            logits[rng.randrange(vocab)] = logits[rng.randrange(vocab)]  # a tie
            token, top = rng.randrange(vocab), rng.randint(0, 6)
            got = token_logprobs(logits, token, top)
            reference = torch.log_softmax(logits.double(), dim=-1).tolist()
            assert got.token == token and abs(got.logprob - reference[token]) < 1e-5
            order = sorted(range(vocab), key=lambda j: (-reference[j], j))[:top]
            assert [t for t, _ in got.top] == order
            assert all(abs(lp - reference[t]) < 1e-5 for t, lp in got.top)
    # NaN counts as -inf, +inf takes all the mass, nothing is below the floor or NaN (JSON has neither)
    got = token_logprobs(torch.tensor([float("nan"), 0.0, INF, -INF]), 0, 4)
    assert got.logprob == LOGPROB_FLOOR and got.top[0] == (2, 0.0)
    assert all(LOGPROB_FLOOR <= lp <= 0 for _, lp in got.top)
    assert token_logprobs(torch.full((5,), -INF), 1, 2).logprob == LOGPROB_FLOOR
    assert [t for t, _ in token_logprobs(torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0]), 0, 2).top] == [1, 2]  # ties by id
    half = token_logprobs(torch.tensor([1.0, 2.0, 3.0]).half(), 2, 1)
    assert abs(half.logprob - torch.log_softmax(torch.tensor([1.0, 2.0, 3.0]), 0)[2].item()) < 1e-6


def test_stop_string_helpers_against_brute_force():
    rng = random.Random(5)
    for _ in range(3000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(0, 4))]
        starts = [i for i in range(len(text)) for s in stops if s and text.startswith(s, i)]
        assert first_stop(text, stops) == min(starts, default=-1)
        if first_stop(text, stops) == -1:
            assert held_back(text, stops) == max((k for s in stops for k in range(1, len(s))
                                                  if text.endswith(s[:k])), default=0)


class ListedBytes:
    """TokenNames over token ids 0..n-1 whose bytes are given (any split of a byte string)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def text_bytes(self, token):
        return self.pieces[token]


def offsets_reference(pieces: list[bytes]) -> list[int]:
    """The character (of the whole reply decoded with U+FFFD replacement) each piece's first byte lands in: the text
    of the bytes before the last character boundary at or before it, where the boundaries are the split points that
    do not change the decoding. A piece without bytes sits after the text before it."""
    data = b"".join(pieces)

    def decode(b):
        return b.decode("utf-8", errors="replace")

    bounds = [s for s in range(len(data) + 1) if decode(data[:s]) + decode(data[s:]) == decode(data)]
    out, pos = [], 0
    for piece in pieces:
        at = max(s for s in bounds if s <= pos) if piece else pos
        out.append(len(decode(data[:at])))
        pos += len(piece)
    return out


def test_logprob_offsets_follow_the_decoded_text():
    rng = random.Random(6)
    alphabet = [b"a", b"\xe2", b"\x82", b"\xac", b"\xc3", b"\xa9", b"\xff", b"\xf0\x9f", b"\x98\x80", b"",
                "日".encode(), b"\xed\xa0", b"\x80", b"\xf4\x90"]  # pieces of valid and invalid UTF-8
    for _ in range(2000):
        pieces = [b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 2))) for _ in range(rng.randint(1, 8))]
        track = ChoiceLogprobs(ListedBytes(pieces))
        assert [track.offset(p) for p in pieces] == offsets_reference(pieces)


def test_logprobs_are_released_with_their_text_and_stop_strings_are_left_out():
    from openk3.sampling import TokenLogprob
    from openk3.tokenizer import ByteTokenizer

    names = TokenNames(ByteTokenizer(), {ByteTokenizer.EOS})
    entries = [TokenLogprob(t, -1.0, []) for t in b"ab\xe2\x82\xacX"] + [TokenLogprob(ByteTokenizer.EOS, -2.0, [])]
    track = ChoiceLogprobs(names)
    track.add(entries[:4])  # "ab" and two bytes of "€": only "ab" is text yet
    assert [e.token for _, e in track.release(2, False, None)] == list(b"ab")
    track.add(entries[4:])
    # the reply stopped at a stop string "X" (or at <|eos|>): "€" is sent, "X" and <|eos|> are not reported
    assert [(o, e.token) for o, e in track.release(3, True, "stop")] == [(2, 0xe2), (2, 0x82), (2, 0xac)]
    whole = ChoiceLogprobs(names)
    whole.add(entries)
    assert len(whole.release(4, True, "length")) == len(entries)  # ended by length: every sampled token
    assert names.describe(0xe2) == ("bytes:\\xe2", [0xe2]) and names.describe(ord("a")) == ("a", [97])
    assert names.describe(ByteTokenizer.EOS) == ("<|eos|>", None)


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                                 dict(presence_penalty=float("nan")), dict(logit_bias={3: 101.0}),
                                 dict(logit_bias={-1: 0.0}), dict(logprobs=-1)])
def test_invalid_parameters_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
