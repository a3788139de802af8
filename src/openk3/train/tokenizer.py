"""Byte-level BPE tokenizer: trained with `tokenizers` on first use and cached, or loaded from a tokenizer.json.

Byte-level means every byte sequence is encodable (no unknown token) and decoding is exact. The special token
`<|endoftext|>` separates documents in the training stream; `<|im_start|>` / `<|im_end|>` are reserved so a
trained checkpoint can be served with the chat template. The cache key is the corpus content hash
and the vocabulary size, so a changed corpus trains a fresh tokenizer and an unchanged one is reused.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")  # reserved for the serving chat template (openk3.serve)


def cache_dir() -> Path:
    """Where trained tokenizers live: $OPENK3_CACHE, else $XDG_CACHE_HOME/openk3, else ~/.cache/openk3."""
    if os.environ.get("OPENK3_CACHE"):
        return Path(os.environ["OPENK3_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "openk3"


class TextTokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the few calls training and generation need."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        eos = tokenizer.token_to_id(EOS)
        if eos is None:
            raise ValueError(f"tokenizer has no {EOS!r} token; openk3 needs it to separate documents")
        self.eos_id = eos

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        return cls(Tokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self.tokenizer.save(str(path))


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
