"""Tokenizers for training, `openk3 generate` and serving, and the chat template.

Two tokenizers with one interface:
- `TextTokenizer`: a `tokenizer.json` (the `tokenizers` library). Training trains a byte-level BPE on first use
  and caches it (`load_or_train`), or takes the user's file; checkpoints carry it. Byte-level means every byte
  sequence is encodable (no unknown token) and decoding is exact. `<|endoftext|>` separates documents in the
  training stream; `<|im_start|>` / `<|im_end|>` are reserved for the chat template.
- `ByteTokenizer`: the fallback for a model without a tokenizer.json (e.g. a random-init preset): ids 0-255 are
  the UTF-8 bytes, then 256 <|bos|>, 257 <|eos|>, 258 <|im_start|>, 259 <|im_end|> (a vocab of >= 260 needed).

Control tokens: `encode(text)` turns the special-token strings in the text into their ids (text the operator
writes: the training corpus, `openk3 generate --prompt`). `encode_plain(text)` never does: the strings stay
plain characters. The server encodes everything a request carries with `encode_plain`, so a user cannot forge a
chat turn by typing `<|im_start|>system`; only the chat template (`encode_chat`) inserts control tokens, by id.
`decode_plain` drops control tokens from the text it returns (what a client sees). Both encoders run in time
linear in the text. `token_bytes(id)` is the bytes one token adds to that text (None for a control token), for
per-token log-probabilities; where those bytes concatenate to the text (`streams_bytes`: the byte tokenizer and
byte-level BPE), `TextStream` keeps decode_plain's text of a growing reply in time linear in its length.

Chat template: every message is `<|im_start|>{role}\\n{content}<|im_end|>\\n`, then the prompt ends with
`<|im_start|>assistant\\n`. The reply ends at <|im_end|> (or the end-of-sequence token). A tokenizer.json
without the chat tokens gets the template as plain text. A content may also be a list of parts: text, or token
ids inserted as given (an image's run of placeholder ids, openk3.serve.vision).
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TOKENS = (IM_START, IM_END)
STOP_TOKENS = (IM_END, "<|eos|>", EOS, "</s>", "[EOS]")  # whichever a tokenizer.json has end a reply


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted (character -> byte): the printable bytes stand for
    themselves and the other 68 take the code points from 256 up, in byte order (the GPT-2 convention that
    `tokenizers`' ByteLevel pre-tokenizer and decoder use)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


class TextTokenizer:
    """A `tokenizers.Tokenizer` with the calls training, generation and serving need."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._plain = Tokenizer.from_str(tokenizer.to_str())  # a copy that reads special-token strings as text
        self._plain.encode_special_tokens = True
        self._control_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._byte_level = byte_level_alphabet() if isinstance(tokenizer.decoder, decoders.ByteLevel) else None
        # decode_plain is the lossy UTF-8 of the tokens' bytes only under the plain byte-level decoder (another one,
        # e.g. sentencepiece's, rewrites text across tokens: a leading space stripped, byte-fallback pieces fused)
        self.streams_bytes = self._byte_level is not None

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise ValueError(f"{path} is not a tokenizer.json (the tokenizers library read: {exc})") from None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def eos_id(self) -> int:
        """The document separator of training (and the end of `openk3 generate`'s text)."""
        eos = self.tokenizer.token_to_id(EOS)
        if eos is None:
            raise ValueError(f"tokenizer has no {EOS!r} token; openk3 needs it to separate documents")
        return eos

    @property
    def stop_ids(self) -> set[int]:
        return {i for i in map(self.special_id, STOP_TOKENS) if i is not None}

    def special_id(self, name: str) -> int | None:
        return self.tokenizer.token_to_id(name)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def encode_plain(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def decode_plain(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes | None:
        """The bytes `token` adds to `decode_plain`'s text (None for a control token or an unknown id): a byte-level
        piece mapped back through the byte alphabet, else (another decoder, an added token) the token decoded alone."""
        piece = self.tokenizer.id_to_token(token)
        if piece is None or token in self._control_ids:
            return None
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        return self.tokenizer.decode([token], skip_special_tokens=False).encode("utf-8")

    def tokens_at_least(self, text: str) -> int:
        """A lower bound on len(encode_plain(text)), in time linear in the text: with no normalizer, every token
        covers a run of the (pre-tokenized, never shorter) text of at most `longest_piece` bytes; 0 otherwise."""
        if self.tokenizer.normalizer is not None:
            return 0
        return -(-len(text.encode("utf-8", errors="surrogatepass")) // self.longest_piece)

    @functools.cached_property
    def longest_piece(self) -> int:
        """The most UTF-8 bytes of any vocabulary entry or added token (a byte-level piece's characters count 1-2
        bytes each for 1 byte of text: an overestimate, which keeps `tokens_at_least` a lower bound)."""
        return max(1, *(len(piece.encode("utf-8")) for piece in self.tokenizer.get_vocab(with_added_tokens=True)))

    def save(self, path: str | Path) -> None:
        self.tokenizer.save(str(path))


class ByteTokenizer:
    BOS, EOS, IM_START_ID, IM_END_ID = 256, 257, 258, 259
    SPECIALS = {"<|bos|>": BOS, "<|eos|>": EOS, IM_START: IM_START_ID, IM_END: IM_END_ID}
    NAMES = {i: s for s, i in SPECIALS.items()}
    SPLIT = re.compile("(" + "|".join(map(re.escape, SPECIALS)) + ")")  # one left-to-right scan
    vocab_size = 260
    streams_bytes = True  # decode_plain is the lossy UTF-8 of the concatenated token_bytes

    @property
    def stop_ids(self) -> set[int]:
        return {self.EOS, self.IM_END_ID}

    def special_id(self, name: str) -> int | None:
        return self.SPECIALS.get(name)

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes; the special-token strings become their single ids."""
        ids: list[int] = []
        for i, piece in enumerate(self.SPLIT.split(text)):  # odd pieces are the matched specials
            if i % 2:
                ids.append(self.SPECIALS[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def encode_plain(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def tokens_at_least(self, text: str) -> int:
        """len(encode_plain(text)) without building it."""
        return len(text.encode("utf-8"))

    def token_bytes(self, token: int) -> bytes | None:
        return bytes([token]) if 0 <= token < 256 else None

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes to text with the special tokens written out; an incomplete UTF-8 tail shows as U+FFFD."""
        parts, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
            else:
                parts += [run.decode("utf-8", errors="replace"), self.NAMES[i]]
                run = bytearray()
        return "".join(parts) + run.decode("utf-8", errors="replace")

    def decode_plain(self, ids: Sequence[int]) -> str:
        """Bytes to text; special tokens are dropped; an incomplete UTF-8 tail shows as U+FFFD."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TextStream:
    """decode_plain's text of a token sequence that grows one token at a time (a reply as it is sampled).

    After each `push`, `text` is `tokenizer.decode_plain(tokens pushed so far)`, and its first `stable` characters
    are final: no later token changes them. A tokenizer that `streams_bytes` takes each token's bytes through an
    incremental UTF-8 decoder: a character whose last bytes have not come yet shows as U+FFFD, as in a full decode,
    and only that end is not stable; a push costs time independent of the text before it (but for copying the
    string). Any other tokenizer re-decodes the whole sequence at every push, and nothing is stable."""

    def __init__(self, tokenizer: TextTokenizer | ByteTokenizer):
        self.tokenizer = tokenizer
        self.text, self.stable = "", 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if tokenizer.streams_bytes else None
        self._tokens: list[int] = []  # what a re-decoding stream decodes

    def push(self, token: int) -> None:
        if self._utf8 is None:
            self._tokens.append(token)
            self.text = self.tokenizer.decode_plain(self._tokens)
            return
        done = self.text[:self.stable] + self._utf8.decode(self.tokenizer.token_bytes(token) or b"")
        partial = self._utf8.getstate()[0]  # the bytes of an unfinished character (a valid start: one U+FFFD)
        self.text, self.stable = done + partial.decode("utf-8", errors="replace"), len(done)


class PromptTooLong(ValueError):
    """A prompt that reaches the token limit `encode_chat` was given (found while encoding, which then stops)."""


def chat_segments(role: str, content: str | Sequence) -> Iterator[str | list[int]]:
    """One message's body in order: runs of adjacent texts (the role line first) joined into one string each, to be
    encoded as one text, and id lists as they are. Joined once per run: linear in the number of parts."""
    run = [f"{role}\n"]
    for part in [content] if isinstance(content, str) else content:
        if isinstance(part, str):
            run.append(part)
            continue
        if run:
            yield "".join(run)
        run = []
        yield part
    if run:
        yield "".join(run)


def encode_chat(tokenizer: TextTokenizer | ByteTokenizer, messages: Sequence[dict],
                limit: int | None = None) -> list[int]:
    """The chat template (module docstring): control tokens by id, every role and text with `encode_plain`; a
    content that is a list of parts takes its text parts as text and its id lists as they are. `limit`: raise
    PromptTooLong as soon as the prompt reaches this many tokens, before encoding a text that is sure to reach it
    (`tokens_at_least`), so an oversized prompt costs little more than reading it."""
    def marker(name: str) -> list[int]:
        token = tokenizer.special_id(name)
        return tokenizer.encode_plain(name) if token is None else [token]

    start, end, newline = marker(IM_START), marker(IM_END), tokenizer.encode_plain("\n")
    ids: list[int] = []

    def add(more: Sequence[int] | str) -> None:
        if isinstance(more, str):
            if limit is not None and (least := len(ids) + tokenizer.tokens_at_least(more)) >= limit:
                raise PromptTooLong(f"the prompt has at least {least} tokens; the context holds {limit}")
            more = tokenizer.encode_plain(more)
        ids.extend(more)
        if limit is not None and len(ids) >= limit:
            raise PromptTooLong(f"the prompt has at least {len(ids)} tokens; the context holds {limit}")

    for m in messages:
        add(start)
        for segment in chat_segments(m["role"], m["content"]):
            add(segment)
        add(end + newline)
    add(start)
    add("assistant\n")
    return ids


def load_tokenizer(ckpt_dir: str | Path | None, model_vocab: int) -> TextTokenizer | ByteTokenizer:
    """Serving: the checkpoint's tokenizer.json when there is one, else the byte-level fallback."""
    if ckpt_dir is not None and os.path.exists(os.path.join(ckpt_dir, "tokenizer.json")):
        return TextTokenizer.from_file(os.path.join(ckpt_dir, "tokenizer.json"))
    if model_vocab < ByteTokenizer.vocab_size:
        raise ValueError(f"the byte-level tokenizer needs a vocab of >= {ByteTokenizer.vocab_size}, "
                         f"the model has {model_vocab}")
    return ByteTokenizer()


# ---- training's BPE: trained on first use, cached by corpus hash and vocabulary size --------------------------

def cache_dir() -> Path:
    """Where trained tokenizers live: $OPENK3_CACHE, else $XDG_CACHE_HOME/openk3, else ~/.cache/openk3."""
    if os.environ.get("OPENK3_CACHE"):
        return Path(os.environ["OPENK3_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "openk3"


def train_bpe(texts: list[str], vocab_size: int) -> TextTokenizer:
    """Train a byte-level BPE of exactly `vocab_size` entries (fewer only if the corpus runs out of merges)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return TextTokenizer(tok)


def corpus_fingerprint(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        data = t.encode("utf-8", errors="surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def load_or_train(texts: list[str], vocab_size: int, path: str | Path | None = None,
                  cache: Path | None = None) -> TextTokenizer:
    """A user tokenizer.json when `path` is given, else the cached BPE for this corpus (trained if missing).

    The vocabulary must fit the model's embedding table (`vocab_size`); a larger user tokenizer is an error.
    """
    if path is not None:
        tok = TextTokenizer.from_file(path)
        if tok.vocab_size > vocab_size:
            raise ValueError(f"tokenizer {path} has {tok.vocab_size} tokens but the model's vocab_size is "
                             f"{vocab_size}; use a smaller tokenizer or raise vocab_size with --config")
        return tok
    cache = cache if cache is not None else cache_dir() / "tokenizers"
    target = cache / f"bpe-{vocab_size}-{corpus_fingerprint(texts)}.json"
    if target.is_file():
        return TextTokenizer.from_file(target)
    tok = train_bpe(texts, vocab_size)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tok.save(tmp)
    os.replace(tmp, target)  # atomic: concurrent first runs never read a half-written file
    return tok
