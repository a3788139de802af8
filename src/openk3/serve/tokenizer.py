"""Tokenizers for serving and the chat template.

- `ByteTokenizer` (the fallback, e.g. for a random-init preset): ids 0-255 are the UTF-8 bytes; four special
  tokens follow: 256 <|bos|>, 257 <|eos|>, 258 <|im_start|>, 259 <|im_end|>. It needs a vocab of >= 260; the
  engine never samples ids the tokenizer cannot decode.
- `HFTokenizer`: a checkpoint directory's `tokenizer.json` (the `tokenizers` library).

Chat template (both): every message renders as `<|im_start|>{role}\\n{content}<|im_end|>\\n`, then the prompt
ends with `<|im_start|>assistant\\n`. The reply ends at <|im_end|> (or the end-of-sequence token).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class ByteTokenizer:
    BOS, EOS, IM_START_ID, IM_END_ID = 256, 257, 258, 259
    SPECIALS = {"<|bos|>": BOS, "<|eos|>": EOS, IM_START: IM_START_ID, IM_END: IM_END_ID}
    vocab_size = 260

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes; the special-token strings of the chat template become their single ids."""
        ids: list[int] = []
        rest = text
        while rest:
            cut = min((i for i in (rest.find(s) for s in self.SPECIALS) if i >= 0), default=-1)
            if cut < 0:
                ids.extend(rest.encode("utf-8"))
                break
            ids.extend(rest[:cut].encode("utf-8"))
            special = next(s for s in self.SPECIALS if rest.startswith(s, cut))
            ids.append(self.SPECIALS[special])
            rest = rest[cut + len(special):]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes to text; special tokens are dropped; an incomplete UTF-8 tail shows as U+FFFD."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @property
    def stop_ids(self) -> set[int]:
        return {self.EOS, self.IM_END_ID}


class HFTokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    @property
    def stop_ids(self) -> set[int]:
        names = (IM_END, "<|eos|>", "<|endoftext|>", "</s>", "[EOS]")
        return {i for i in (self.tok.token_to_id(n) for n in names) if i is not None}


def load_tokenizer(ckpt_dir: str | None, model_vocab: int) -> ByteTokenizer | HFTokenizer:
    """The checkpoint's tokenizer.json when there is one, else the byte-level fallback."""
    if ckpt_dir is not None and os.path.exists(os.path.join(ckpt_dir, "tokenizer.json")):
        return HFTokenizer(os.path.join(ckpt_dir, "tokenizer.json"))
    if model_vocab < ByteTokenizer.vocab_size:
        raise ValueError(f"the byte-level tokenizer needs a vocab of >= {ByteTokenizer.vocab_size}, "
                         f"the model has {model_vocab}")
    return ByteTokenizer()


def render_chat(messages: Sequence[dict[str, str]]) -> str:
    """The chat template documented above."""
    turns = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return f"{turns}{IM_START}assistant\n"
