"""The plain decode loop: new tokens from a model's incremental cache, one forward per token.

The prompt is prefilled once into `model.new_cache(1)`; every new token is one forward of a single position that
appends to the cache (KDA states and MLA latents), so each step costs the same however long the text grows.
Sampling (greedy / temperature / top-k / top-p, seeded) is `openk3.sampling.sample_token`, as in serving. Used by
`openk3 generate` and training's end-of-run sample, and the reference the engine and speculative decoding are
tested against. It takes any model with `new_cache` and the `cache=` / `logits_to_keep=` forward (openk3.model).
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.sampling import SamplingParams, request_rng, sample_token


@torch.no_grad()
def generate_ids(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                 stop_ids: set[int] | frozenset = frozenset(), device: torch.device | str = "cpu") -> list[int]:
    """New token ids after `prompt_ids` (stops early at a stop id, which is not returned)."""
    if not prompt_ids:
        raise ValueError("the prompt must have at least one token")
    was_training = model.training
    model.eval()
    rng = request_rng(params.seed)
    cache = model.new_cache(1)
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache, logits_to_keep=1).logits[0, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = sample_token(logits, params, rng)
        if token in stop_ids:
            break
        out.append(token)
        logits = model(torch.tensor([[token]], device=device), cache=cache, logits_to_keep=1).logits[0, -1]
    model.train(was_training)
    return out
