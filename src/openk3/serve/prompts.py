"""A request's prompt as the engine takes it: the checks every engine makes before queueing one (`check_prompt`, run
in the API's process too, so that a bad request gets its 4xx at once), and its images (`PromptImages`: where each
image's placeholder run starts, the prompt as the prefix cache keys it, and the image tokens once encoded)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openk3.config import ModelConfig
from openk3.serve.prefix_cache import image_keyed_tokens


def check_prompt(prompt: list[int], max_model_len: int, cfg: ModelConfig, images: list | None) -> PromptImages | None:
    """ValueError for a prompt no engine can take (what `Engine.add_request` refuses before queueing); else, for a
    model with a vision tower, the prompt's images located (placeholder ids without images are refused too)."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if len(prompt) >= max_model_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; a sequence holds {max_model_len} (--max-model-len)")
    if max(prompt) >= cfg.vocab_size or min(prompt) < 0:
        raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
    if images and cfg.vision is None:
        raise ValueError(f"the model {cfg.name!r} has no vision tower: it cannot take images")
    if cfg.vision is None:
        return None
    return PromptImages.locate(list(prompt), cfg.vision.image_token_id, images or [])  # ValueError: misplaced


@dataclass
class PromptImages:
    """A request's images: prepared (openk3.images.PreparedImage, prompt order), where each one's placeholder run
    starts in the prompt, the prompt as the prefix cache keys it, and each image's tokens [n, hidden] once the
    prefill first needs them (an image inside the prefix hit is never encoded)."""

    prepared: list
    starts: list[int]
    cache_prompt: list[int]
    embeds: list[torch.Tensor | None]

    @classmethod
    def locate(cls, prompt: list[int], image_token_id: int, prepared: list) -> PromptImages:
        """ValueError unless the prompt holds, in order, one contiguous run of placeholders per image."""
        cache_prompt = image_keyed_tokens(prompt, image_token_id, [(im.num_tokens, im.digest) for im in prepared])
        slots = [i for i, t in enumerate(prompt) if t == image_token_id]
        starts, seen = [], 0
        for k, im in enumerate(prepared):
            run = slots[seen:seen + im.num_tokens]
            if run[-1] - run[0] != im.num_tokens - 1:
                raise ValueError(f"the {im.num_tokens} placeholders of image {k} are not contiguous in the prompt")
            starts.append(run[0])
            seen += im.num_tokens
        return cls(list(prepared), starts, cache_prompt, [None] * len(prepared))

    def chunk_embeds(self, start: int, end: int, model: torch.nn.Module) -> list[torch.Tensor]:
        """The image tokens of the placeholders in prompt positions [start, end), in order (`model` encodes an
        image the first time a chunk reaches it)."""
        out = []
        for k, (s, im) in enumerate(zip(self.starts, self.prepared)):
            lo, hi = max(start, s), min(end, s + im.num_tokens)
            if lo < hi:
                if self.embeds[k] is None:
                    self.embeds[k] = model.encode_images(im.batch.to(next(model.parameters()).device))
                out.append(self.embeds[k][lo - s:hi - s])
        return out
