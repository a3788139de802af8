"""A reply's text kept token by token: `TextStream` is decode_plain's text of the tokens so far after every token
(the byte tokenizer, byte-level BPE, and the re-decoding fallback of a decoder that rewrites text across tokens),
and the stop-string helpers that look only at the end of a growing text agree with brute force on the whole text."""

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from openk3.serve.stop_strings import first_stop, sendable
from openk3.tokenizer import EOS, IM_END, IM_START, ByteTokenizer, TextStream, TextTokenizer

MULTILINGUAL = "héllo wörld, ∑ 日本語 🙂 the agent calls a tool; ünïcödé ✓ 🙂🙂 "


def byte_level_bpe() -> TextTokenizer:
    """Merges over multi-byte characters, so that tokens hold parts of characters and several at once."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([MULTILINGUAL] * 10, trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS, IM_START, IM_END], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return TextTokenizer(tok)


def sentencepiece_like() -> TextTokenizer:
    """Sentencepiece's decoder: "▁" is a space, the text's first space is stripped and byte-fallback pieces fuse
    into characters, so a token's text depends on its neighbours (its token_bytes do not add up to the text)."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["▁", "▁the", "▁agent", "h", "é", "llo", "▁wörld", "日本", "語", ","]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(EOS, special=True)])
    return TextTokenizer(tok)


TOKENIZERS = {"byte": ByteTokenizer, "bpe": byte_level_bpe, "sentencepiece": sentencepiece_like}


def random_tokens(rng: random.Random, tok, n: int) -> list[int]:
    """Any id, or the bytes of multi-byte characters one at a time (split over tokens), as the byte tokenizer's ids
    or the ids of a text's real tokenization."""
    pieces = tok.encode_plain(MULTILINGUAL)
    out: list[int] = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.4:
            out.append(rng.randrange(tok.vocab_size))
        else:
            start = rng.randrange(len(pieces))
            out += pieces[start:start + rng.randint(1, 4)]
    return out[:n]


@pytest.mark.parametrize("which", sorted(TOKENIZERS))
def test_text_stream_is_the_full_decode_after_every_token(which):
    tok = TOKENIZERS[which]()
    assert tok.streams_bytes == (which != "sentencepiece")
    rng = random.Random(len(which))
    for _ in range(150):
        tokens = random_tokens(rng, tok, rng.randint(1, 24))
        stream, seen = TextStream(tok), []
        for k, token in enumerate(tokens):
            stream.push(token)
            assert stream.text == tok.decode_plain(tokens[:k + 1])
            seen.append((stream.text, stream.stable))
            if tok.streams_bytes:  # only a character still missing bytes (one U+FFFD) is not final
                assert stream.text[stream.stable:] in ("", "\ufffd")
            else:
                assert stream.stable == 0
        assert all(stream.text.startswith(text[:stable]) for text, stable in seen)


def occurrences(text: str, stops: list[str]) -> list[tuple[int, int]]:
    """(start, end) of every occurrence of every non-empty stop string that a stop can be: one made of complete
    characters, so not ending with a final U+FFFD (which may be a character whose last bytes are to come)."""
    complete = len(text) - text.endswith("\ufffd")
    return [(i, i + len(s)) for s in stops if s for i in range(len(text)) if text.startswith(s, i)
            and i + len(s) <= complete]


def test_stop_search_after_a_clean_prefix_and_sendable_against_brute_force():
    """first_stop(text, stops, after) is the earliest start of a stop string of complete characters whenever none
    ends before `after`; sendable is the whole-text rule: all but trailing U+FFFD and the longest end that begins a
    stop string, never below what was sent."""
    rng = random.Random(11)
    alphabet = "ab\ufffd"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(0, 4))]
        found = occurrences(text, stops)
        clean = min((end for _, end in found), default=len(text))  # no stop ends before this
        after = rng.randint(0, min(clean, len(text)))
        assert first_stop(text, stops, after=after) == min((i for i, _ in found), default=-1)
        if not found:
            sent = rng.randint(0, len(text))
            body = text.rstrip("\ufffd")
            hold = max((k for s in stops for k in range(1, len(s)) if body.endswith(s[:k])), default=0)
            assert sendable(text, stops, sent) == max(len(body) - hold, sent)


def test_a_stop_string_matches_complete_characters_only():
    """U+FFFD as a stop string: the U+FFFD a stream shows for a character still missing bytes is not a match
    ("é" arrives as two byte tokens), a real one (an invalid byte) is, once the text goes on or at once."""
    tok = ByteTokenizer()
    for reply, stop, expected in [("é!", "\ufffd", -1), ("aé", "a\ufffd", -1), ("日本", "\ufffd", -1)]:
        stream = TextStream(tok)
        for token in tok.encode_plain(reply):
            searched = stream.stable
            stream.push(token)
            assert first_stop(stream.text, [stop], after=searched) == expected
    stream, cuts = TextStream(tok), []
    for token in [0x61, 0xFF, 0x62]:  # "a", an invalid byte (a complete U+FFFD), "b"
        searched = stream.stable
        stream.push(token)
        cuts.append(first_stop(stream.text, ["\ufffd"], after=searched))
    assert stream.text == "a\ufffdb" and cuts == [-1, -1, 1]
