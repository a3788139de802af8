"""The embedded vision-language task of `openk3 train --preset k3-tiny-vl`: pictures of coloured shapes drawn with
Pillow and captioned by their attributes. Nothing is downloaded; every scene follows from its seed.

Scene: 1-3 shapes of one kind (circle, square, triangle) and one colour (red, green, blue, yellow), all inside one
quadrant of a canvas of one of three sizes (112x112, 168x112, 112x168 pixels, width x height: 16, 24 and 24 image
tokens at patch 14 and merge 2, so a batch packs images of different sizes), with jittered shape sizes (18-22
pixels across), positions, shades and background. The attributes are drawn independently and uniformly.
Caption: "<count> <colour> <shape> <quadrant>", e.g. "2 red circle top-left": four words, one token each in the
task's word-level tokenizer (`caption_tokenizer`).
Sequence: the chat template of a user message holding the image alone, then the caption as the assistant's reply:
<|im_start|> user [one placeholder per image token] <|im_end|> <|im_start|> assistant caption <|endoftext|> (the
role words are words of the task's tokenizer; the newlines vanish in its whitespace split); the loss covers the
caption and the end token only (targets elsewhere are IGNORE). Served (`openk3 serve --ckpt`), a chat message
whose content is the image alone, with no text part, is exactly the training prompt.
Scenes: training scene i of run seed s is drawn from Random("s:i"), held-out scene j from Random("held-out:j"), so
no run ever trains on a held-out scene.

Text-only baseline: every prompt is the same apart from the picture, so a model that cannot see the image can at
best predict each attribute from its training frequencies (`AttributePrior`): its accuracy is that of the most
frequent value (about 1/3 or 1/4: chance), its loss the cross-entropy of the held-out captions under those
frequencies (about log 3 or log 4 per word).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

import torch
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, models, pre_tokenizers

from openk3.config import VisionConfig
from openk3.images import prepare_image
from openk3.model.vision import ImageBatch
from openk3.tokenizer import EOS, IM_END, IM_START, TextTokenizer, encode_chat

ATTRIBUTES = {
    "count": ("1", "2", "3"),
    "colour": ("red", "green", "blue", "yellow"),
    "shape": ("circle", "square", "triangle"),
    "quadrant": ("top-left", "top-right", "bottom-left", "bottom-right"),
}
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 230), "yellow": (230, 210, 40)}
CANVASES = ((112, 112), (168, 112), (112, 168))  # (width, height), multiples of 28
UNK = "<|unk|>"
IGNORE = -100


@dataclass(frozen=True)
class Scene:
    count: str
    colour: str
    shape: str
    quadrant: str
    canvas: tuple[int, int]
    seed: int  # the drawing's jitter

    @property
    def words(self) -> list[str]:
        return [getattr(self, name) for name in ATTRIBUTES]

    @property
    def caption(self) -> str:
        return " ".join(self.words)


def scene(seed: int | str, index: int) -> Scene:
    """Scene `index` of the training stream of run seed `seed`, or of the held-out set (seed "held-out")."""
    rng = random.Random(f"{seed}:{index}")  # a string seed: the same scene on every machine and Python run
    values = {name: rng.choice(options) for name, options in ATTRIBUTES.items()}
    return Scene(canvas=rng.choice(CANVASES), seed=rng.getrandbits(32), **values)


def held_out_scenes(n: int) -> list[Scene]:
    return [scene("held-out", j) for j in range(n)]


def draw(s: Scene) -> Image.Image:
    """The scene as an RGB image: the shapes inside their quadrant, not overlapping."""
    rng = random.Random(s.seed)
    width, height = s.canvas
    shade = rng.randint(0, 60) if rng.random() < 0.5 else rng.randint(190, 250)
    image = Image.new("RGB", s.canvas, (shade, shade, shade))
    pen = ImageDraw.Draw(image)
    left = s.quadrant.endswith("right") * width // 2
    top = s.quadrant.startswith("bottom") * height // 2
    colour = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in COLOURS[s.colour])
    placed: list[tuple[float, float, float]] = []
    tries = 0
    while len(placed) < int(s.count):
        tries += 1
        if tries % 200 == 0:  # the first shapes left no room for the rest: start over
            placed = []
        r = rng.uniform(9.0, 11.0)
        x = rng.uniform(left + r + 1, left + width // 2 - r - 1)
        y = rng.uniform(top + r + 1, top + height // 2 - r - 1)
        if all(math.hypot(x - px, y - py) > r + pr + 2 for px, py, pr in placed):
            placed.append((x, y, r))
    for x, y, r in placed:
        box = (x - r, y - r, x + r, y + r)
        if s.shape == "circle":
            pen.ellipse(box, fill=colour)
        elif s.shape == "square":
            pen.rectangle(box, fill=colour)
        else:
            pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=colour)
    return image


# the role words of the prompt's chat template (prompt_ids). As <|unk|> both (one token twice, the caption's first
# word predicted after the same token as the image's first placeholder follows) the task stalled at colour alone:
# held-out loss 0.74 at step 650 against 0.17 without the template, 3.5% of captions exact (2026-12-07)
ROLE_WORDS = ("user", "assistant")


def caption_tokenizer() -> TextTokenizer:
    """Word-level: the control tokens, <|unk|>, the chat roles, then every attribute value (ids in that order, 20 in
    all)."""
    words = [EOS, IM_START, IM_END, UNK, *ROLE_WORDS] + [w for options in ATTRIBUTES.values() for w in options]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOS, IM_START, IM_END, UNK])
    return TextTokenizer(tok)


@dataclass
class CaptionBatch:
    """inputs / targets [B, T] (right-padded with EOS; targets IGNORE outside the captions), the packed images."""

    inputs: torch.Tensor
    targets: torch.Tensor
    images: ImageBatch
    scenes: list[Scene]

    def to(self, device: torch.device | str) -> CaptionBatch:
        return CaptionBatch(self.inputs.to(device), self.targets.to(device), self.images.to(device), self.scenes)


def prompt_ids(tok: TextTokenizer, num_tokens: int, image_token_id: int) -> list[int]:
    """What precedes the caption: the chat template of one user message holding the image's placeholders alone
    (openk3.tokenizer.encode_chat), which is the prompt `openk3 serve` builds for a chat request whose content is
    the image alone, so a served model is prompted exactly as it was trained."""
    return encode_chat(tok, [{"role": "user", "content": [[image_token_id] * num_tokens]}])


def make_batch(scenes: list[Scene], tok: TextTokenizer, vc: VisionConfig) -> CaptionBatch:
    prepared = [prepare_image(draw(s), vc) for s in scenes]
    rows, starts = [], []
    for s, im in zip(scenes, prepared):
        prompt = prompt_ids(tok, im.num_tokens, vc.image_token_id)
        rows.append(prompt + tok.encode(s.caption) + [tok.eos_id])
        starts.append(len(prompt))
    T = max(map(len, rows)) - 1
    inputs = torch.full((len(rows), T), tok.eos_id, dtype=torch.long)
    targets = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for b, (row, start) in enumerate(zip(rows, starts)):
        inputs[b, :len(row) - 1] = torch.tensor(row[:-1])
        targets[b, start - 1:len(row) - 1] = torch.tensor(row[start:])  # position t predicts token t + 1
    return CaptionBatch(inputs, targets, ImageBatch.pack([im.batch for im in prepared]), list(scenes))


class SceneStream:
    """Resumable training batches: the global batch of step k holds scenes k*B .. k*B+B-1 of the run's seed;
    data-parallel ranks each draw their contiguous share. The cursor is the whole state."""

    def __init__(self, seed: int, batch_size: int):
        self.seed, self.batch_size, self.cursor = seed, batch_size, 0

    def next(self, rank: int = 0, world: int = 1) -> list[Scene]:
        share = self.batch_size // world
        first = self.cursor + rank * share
        self.cursor += self.batch_size
        return [scene(self.seed, i) for i in range(first, first + share)]

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seed": self.seed, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"checkpoint data position was saved with {key}={state[key]}, this run has "
                                 f"{getattr(self, key)}; resume with the same --batch-size and --seed")
        self.cursor = state["cursor"]


class AttributePrior:
    """The text-only baseline (module docstring): per attribute, the value frequencies of training scenes."""

    def __init__(self, scenes: list[Scene]):
        self.counts = {name: Counter(getattr(s, name) for s in scenes) for name in ATTRIBUTES}

    def accuracy(self, scenes: list[Scene]) -> dict[str, float]:
        """Per attribute, and "exact" (all four), of always answering the most frequent value."""
        guess = {name: c.most_common(1)[0][0] for name, c in self.counts.items()}
        hits = [[getattr(s, name) == guess[name] for name in ATTRIBUTES] for s in scenes]
        return score(hits)

    def loss(self, scenes: list[Scene]) -> float:
        """Mean cross-entropy (nats) per caption token, end token included (it is certain), as the model's loss:
        add-one-smoothed frequencies."""
        total = 0.0
        for name, c in self.counts.items():
            n = sum(c.values()) + len(ATTRIBUTES[name])
            total -= sum(math.log((c[getattr(s, name)] + 1) / n) for s in scenes)
        return total / (len(scenes) * (len(ATTRIBUTES) + 1))


def score(hits: list[list[bool]]) -> dict[str, float]:
    """Per-attribute accuracy and "exact" (every attribute right) from one row of hits per scene."""
    out = {name: sum(row[i] for row in hits) / len(hits) for i, name in enumerate(ATTRIBUTES)}
    out["exact"] = sum(all(row) for row in hits) / len(hits)
    return out
