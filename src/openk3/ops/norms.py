"""Normalisations (computed in fp32, returned in the input dtype)."""

from __future__ import annotations

import contextlib

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The compute dtype for "fp32" math: fp32, or fp64 for fp64 inputs (so fp64 references stay exact)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def autocast_enabled(x: torch.Tensor) -> bool:
    """Whether autocast is on for x's device. (CUDA and the CPU always have autocast: asking torch.amp first for
    them would break a torch.compile graph, as Dynamo cannot trace it on torch 2.11.)"""
    device = x.device.type
    return (device in ("cuda", "cpu") or torch.amp.is_autocast_available(device)) and torch.is_autocast_enabled(device)


def compute_dtype(x: torch.Tensor, default: torch.dtype | None = None) -> torch.dtype:
    """The dtype a matmul or conv reading x runs in: autocast's when autocast is on for x's device, else `default`
    (x's dtype when None)."""
    if autocast_enabled(x):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype if default is None else default


def fp32_island(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off on x's device: inside, matmuls run in their operands' dtype, so an fp32 island (DESIGN.md:
    AttnRes, the router) keeps fp32 products under a bf16 autocast, which would otherwise cast them down."""
    return torch.autocast(x.device.type, enabled=False) if autocast_enabled(x) else contextlib.nullcontext()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, times `weight` if given. fp32 compute, x's dtype out."""
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                 eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm residual step; the sum in the promoted dtype."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's l2norm: eps added, not clamped). fp32 compute."""
    xf = x.to(acc_dtype(x.dtype))
    return (xf / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """rms_norm(x, weight) * sigmoid(z), fp32 compute, x's dtype out: the KDA output's per-head norm and gate
    (SPEC-K3 §2); `ops.triton_norm.gated_rms_norm_triton` is its fused form."""
    acc = acc_dtype(x.dtype)
    return (rms_norm(x.to(acc), weight, eps) * torch.sigmoid(z.to(acc))).to(x.dtype)
