"""Shared by the interop tests: fill a model (openk3's or transformers') with random weights that matter."""

import math

import torch


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and buffer random: matrices ~ N(0, 1/fan_in), norm weights near 1, A_log = log U(1, 16),
    dt_bias and the routing bias spread enough to change which experts win."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            noise = torch.randn(t.shape, generator=gen)
            if name.endswith("A_log"):
                t.copy_(torch.empty(t.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif "norm" in name:
                t.copy_(1.0 + 0.2 * noise)
            elif name.endswith(("dt_bias", "e_score_correction_bias")):
                t.copy_(0.5 * noise)
            else:
                t.copy_(noise / math.sqrt(t.shape[-1]))
