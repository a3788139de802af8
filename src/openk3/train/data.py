"""Training text: the embedded default corpus, user data, tokenised streams and resumable batches.

Default corpus: the running interpreter's own standard-library modules (the top-level `*.py` files of
`sysconfig`'s stdlib directory, sorted by name). Every Python install has them, nothing is downloaded, and
code suits a coding-flavoured model. `--data PATH` takes a text file, a JSONL file (one object per line with a
`text` field), or a directory (every UTF-8 file below it, sorted, `.jsonl` files read as JSONL).

Held-out split: a document is held out when crc32(its name) % 20 == 0 (about 5%, stable across runs and
machines); with fewer than 20 documents the last 5% of the token stream is held out instead.

Batches: the documents' tokens, each document followed by EOS, make one stream; a batch is random windows of
seq_len + 1 tokens of it (`BatchStream`). With `--packing concat` a window is just tokens, documents running into
each other. With `--packing docs` (the default when the data has more than one document) each token also carries
its document's index in the stream (its segment id), so a window is a packed row of whole documents and pieces
of the documents cut at its ends: the model then works within each document (openk3.model.documents) and the
loss counts no prediction across a boundary (openk3.train.loop.lm_losses). The piece of a document that a
window's end cuts off starts the next window from a fresh state.
"""

from __future__ import annotations

import json
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from openk3.tokenizer import TextTokenizer

HELD_OUT_MODULUS = 20  # one document in 20 is held out
MIN_DOCS_FOR_DOC_SPLIT = 20


@dataclass
class Document:
    name: str
    text: str


def stdlib_documents() -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no standard-library sources under {root}; pass --data PATH")
    return [Document(p.name, p.read_text(encoding="utf-8", errors="replace")) for p in files]


def _jsonl_documents(path: Path, label: str) -> list[Document]:
    docs = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{lineno}: each JSONL line needs a string field 'text'")
            docs.append(Document(f"{label}:{lineno}", record["text"]))
    return docs


def _read_text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None  # binary
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def load_documents(path: str | Path | None) -> list[Document]:
    """Documents from `path` (file, JSONL or directory), or the embedded stdlib corpus when `path` is None."""
    if path is None:
        return stdlib_documents()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--data {path} does not exist")
    if path.is_file():
        if path.suffix == ".jsonl":
            return _holding_text(path, _jsonl_documents(path, path.name))
        text = _read_text(path)
        if text is None:
            raise ValueError(f"--data {path} is not a UTF-8 text file")
        return _holding_text(path, [Document(path.name, text)])
    docs = []
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        rel = p.relative_to(path)
        if any(part.startswith(".") for part in rel.parts):
            continue  # .git and friends
        if p.suffix == ".jsonl":
            docs.extend(_jsonl_documents(p, str(rel)))
        elif (text := _read_text(p)) is not None:
            docs.append(Document(str(rel), text))
    if not docs:
        raise ValueError(f"--data {path}: no UTF-8 text files found")
    return _holding_text(path, docs)


def _holding_text(path: Path, docs: list[Document]) -> list[Document]:
    if not any(d.text.strip() for d in docs):
        raise ValueError(f"--data {path} holds no text; pass a file or directory with some")
    return docs


def split_documents(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """(train, held-out) by document name; ([], []) held-out means: split the token stream instead."""
    if len(docs) < MIN_DOCS_FOR_DOC_SPLIT:
        return docs, []
    held = [d for d in docs if zlib.crc32(d.name.encode()) % HELD_OUT_MODULUS == 0]
    train = [d for d in docs if zlib.crc32(d.name.encode()) % HELD_OUT_MODULUS != 0]
    return train, held


def tokenize_documents(docs: list[Document], tok: TextTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, segments): one int64 stream, each document's tokens followed by EOS, and each token's document
    index (EOS included in its document)."""
    ids: list[int] = []
    segments: list[int] = []
    for index, doc_ids in enumerate(tok.encode_batch([d.text for d in docs])):
        ids.extend(doc_ids)
        ids.append(tok.eos_id)
        segments.extend([index] * (len(doc_ids) + 1))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(segments, dtype=torch.long)


def tokenize(docs: list[Document], tok: TextTokenizer) -> torch.Tensor:
    """One int64 stream: each document's tokens followed by EOS."""
    return tokenize_documents(docs, tok)[0]


Split = tuple[torch.Tensor, torch.Tensor]  # (tokens, segments) of one stream


def train_and_heldout_documents(docs: list[Document], tok: TextTokenizer) -> tuple[Split, Split]:
    """((train tokens, segments), (held-out tokens, segments)) by the held-out rule of the module docstring."""
    train_docs, held_docs = split_documents(docs)
    if held_docs:
        return tokenize_documents(train_docs, tok), tokenize_documents(held_docs, tok)
    tokens, segments = tokenize_documents(train_docs, tok)
    cut = len(tokens) - max(2, len(tokens) // HELD_OUT_MODULUS)
    return (tokens[:cut], segments[:cut]), (tokens[cut:], segments[cut:])


def train_and_heldout_streams(docs: list[Document], tok: TextTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    (train, _), (held, _) = train_and_heldout_documents(docs, tok)
    return train, held


def unigram_cross_entropy(train: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> float:
    """Nats/token of `targets` under the add-one-smoothed unigram distribution of `train`: the baseline to beat."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    logp = counts.log() - counts.sum().log()
    return float(-logp[targets].mean())


def resolve_packing(packing: str, num_documents: int, cp: int = 1) -> str:
    """--packing as the run uses it: "auto" is "docs" when the data has more than one document (and the run has
    no context parallelism, whose packed stream has its own layout), else "concat"."""
    if packing == "docs" and cp > 1:
        raise ValueError(f"--packing docs is not supported with --cp {cp} yet (context parallelism packs the "
                         "windows itself); use --packing concat")
    if packing == "auto":
        return "docs" if num_documents > 1 and cp == 1 else "concat"
    return packing


class PackedRows(NamedTuple):
    """A batch with its document boundaries (--packing docs): tokens [B, T+1] on the device, segment ids
    [B, T+1] on the host (each token's document index)."""

    tokens: torch.Tensor
    segments: torch.Tensor


class BatchStream:
    """Resumable random batches of non-overlapping windows of `seq_len + 1` tokens (an error names `shown`, e.g.
    "--seq-len 32", where the user's setting is not `seq_len` itself).

    Each epoch is a permutation of all windows drawn from its own generator seeded by (seed, epoch), so the
    position (epoch, cursor) is the whole state: `state_dict` / `load_state_dict` resume exactly. `next()`
    returns the global batch [batch_size, seq_len + 1]; data-parallel ranks each take a contiguous slice. Given
    the stream's `segments` (its tokens' document indices), `next_packed()` returns the same windows with their
    segment ids (--packing docs).
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int,
                 segments: torch.Tensor | None = None, shown: str | None = None):
        if segments is not None and segments.shape != tokens.shape:
            raise ValueError(f"segments must match the tokens' shape {tuple(tokens.shape)}, got "
                             f"{tuple(segments.shape)}")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.segments = segments
        self.num_windows = max(0, (len(tokens) - 1) // seq_len)
        if self.num_windows < batch_size:
            raise ValueError(f"{len(tokens)} training tokens give {self.num_windows} windows at "
                             f"{shown or f'--seq-len {seq_len}'}, fewer than --batch-size {batch_size}; use more data "
                             "or a smaller --seq-len or --batch-size")
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_windows, generator=g)

    def _next_starts(self) -> list[int]:
        starts = []
        while len(starts) < self.batch_size:
            if self.cursor == self.num_windows:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            starts.append(int(self._order[self.cursor]) * self.seq_len)
            self.cursor += 1
        return starts

    def next(self) -> torch.Tensor:
        return torch.stack([self.tokens[s:s + self.seq_len + 1] for s in self._next_starts()])

    def next_packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, segment ids), both [batch_size, seq_len + 1]: the next batch with its document boundaries."""
        if self.segments is None:
            raise ValueError("this BatchStream was built without segments")
        starts = self._next_starts()
        return tuple(torch.stack([t[s:s + self.seq_len + 1] for s in starts]) for t in (self.tokens, self.segments))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len", "batch_size", "num_windows"):
            if state[key] != getattr(self, key):
                raise ValueError(f"checkpoint data position was saved with {key}={state[key]}, this run has "
                                 f"{getattr(self, key)}; resume with the same data, --seq-len, --batch-size, --seed")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._permutation(self.epoch)


def heldout_windows(tokens: torch.Tensor, seq_len: int, max_windows: int, shown: str | None = None) -> torch.Tensor:
    """Fixed evaluation windows [n, seq_len + 1]: evenly spaced over the held-out stream, at most `max_windows`
    (`shown`: the setting an error names, as BatchStream's)."""
    n_total = (len(tokens) - 1) // seq_len
    if n_total <= 0:
        shown = shown or f"--seq-len {seq_len}"
        raise ValueError(f"the held-out split has {len(tokens)} tokens, fewer than one window at {shown}; use more "
                         f"data or a smaller {shown.split()[0]}")
    picks = torch.linspace(0, n_total - 1, min(n_total, max_windows)).round().long().unique()
    return torch.stack([tokens[int(w) * seq_len:int(w) * seq_len + seq_len + 1] for w in picks])
