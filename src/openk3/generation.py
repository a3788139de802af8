"""The plain decode loop: new tokens from a model's incremental cache, one forward per token.

The prompt is prefilled once into `model.new_cache(1)`; every new token is one forward of a single position that
appends to the cache (KDA states and MLA latents), so each step costs the same however long the text grows.
Sampling (greedy / temperature / top-k / top-p, seeded) is `openk3.sampling.sample_token`, as in serving. Used by
`openk3 generate` and training's end-of-run sample, and the reference the engine and speculative decoding are
tested against. It takes any model with `new_cache` and the `cache=` / `logits_to_keep=` forward (openk3.model).
"""

from __future__ import annotations

import operator

import torch
from torch import nn

from openk3.sampling import SamplingParams, request_rng, sample_token


@torch.no_grad()
def generate_ids(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                 stop_ids: set[int] | frozenset = frozenset(), device: torch.device | str = "cpu") -> list[int]:
    """New token ids after `prompt_ids` (a list of ints, or a 1-D integer tensor; stops early at a stop id, which
    is not returned); the model's train/eval mode is restored afterwards, also when a forward fails."""
    prompt_ids = prompt_list(prompt_ids)
    if isinstance(max_new_tokens, bool) or not hasattr(max_new_tokens, "__index__") or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    was_training = model.training
    model.eval()
    try:
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
    finally:
        model.train(was_training)
    return out


def prompt_list(prompt_ids) -> list[int]:
    """`prompt_ids` as a non-empty list of ints: TypeError for a string or a non-integer tensor, ValueError for an
    empty prompt or a tensor that is not 1-D (one sequence)."""
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError("prompt_ids must be token ids (a list of ints or a 1-D tensor), not text: encode it with "
                        "the tokenizer first")
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dtype.is_floating_point or prompt_ids.dtype.is_complex or prompt_ids.dtype == torch.bool:
            raise TypeError(f"prompt_ids must hold integer token ids, got a tensor of dtype {prompt_ids.dtype}")
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids must be one sequence (a 1-D tensor), got shape {list(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise ValueError("the prompt must have at least one token")
    for t in prompt_ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise TypeError(f"prompt_ids must be ints, got {t!r} ({type(t).__name__})")
    return [operator.index(t) for t in prompt_ids]
