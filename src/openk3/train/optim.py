"""Per-head Muon with AdamW for the rest (SPEC §6).

Muon step for a matrix parameter W with gradient G (momentum mu = 0.95, Nesterov):
    M <- mu M + G;   U = G + mu M
    O = NewtonSchulz5(U) per block;   W <- W (1 - lr wd) - lr * 0.2 sqrt(max(rows, cols)) * O
where the rows/cols are the block's, and weight decay is decoupled and uses the unscaled lr.

Blocks ("split" of a param group):
  "whole"       the matrix as one block (every other 2-D hidden matrix: MLA q_a/kv_a/o/g, KDA gates, router, ...)
  "rows:H"      [H*d, in] cut into H blocks [d, in]: the output features of head h are rows h*d..(h+1)*d-1
  "cols:H"      [out, H*d] cut into H blocks [out, d]: an output projection reads head h from columns h*d..
  "experts"     [E, out, in] stacked expert weights, one block per expert
Why per head: each head is its own attention map, and orthogonalising the concatenation couples their update
magnitudes (a head with large gradients takes the spectrum from the others). One block per head gives every head
an orthogonal update of the same RMS, is more stable at scale, and is cheaper (H small Newton-Schulz iterations
instead of one large one). Experts likewise: each expert is a separate FFN seen by different tokens.

AdamW (betas 0.9/0.95) takes embeddings, the LM head, norms, every 1-D parameter, KDA's A_log and dt_bias, and
depthwise conv kernels. The router's `e_score_correction_bias` is a buffer, not a parameter: no optimizer sees it
(Quantile Balancing owns it, see balance.py).

FSDP2: parameters are DTensors sharded on dim 0; a block can straddle shards, so the Nesterov update is gathered
(`full_tensor`), orthogonalised whole and each rank keeps its own shard of the result.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MUON_MOMENTUM = 0.95
MUON_RMS_SCALE = 0.2  # 0.2 sqrt(max(rows, cols)) matches AdamW's update RMS
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """Approximate orthogonalisation U V^T of each matrix in a batch [..., r, c] (quintic iteration, fp32)."""
    a, b, c = NS_COEFFS
    x = g.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = x @ x.mT
        x = a * x + (b * A + c * A @ A) @ x
    return x.mT if tall else x


def parse_head_split(split: str) -> tuple[str, int]:
    """"rows:4" -> ("rows", 4). Splits are strings so they survive any state-dict serialisation unchanged."""
    kind, _, heads = split.partition(":")
    if kind not in ("rows", "cols") or not heads.isdigit():
        raise ValueError(f"unknown Muon split {split!r}; expected whole, experts, rows:H or cols:H")
    return kind, int(heads)


def to_blocks(t: torch.Tensor, split: str) -> torch.Tensor:
    """The parameter viewed as a batch of blocks [N, r, c] (see the module docstring)."""
    if split == "whole":
        return t.unsqueeze(0)
    if split == "experts":
        return t
    kind, heads = parse_head_split(split)
    if kind == "rows":
        return t.reshape(heads, t.shape[0] // heads, t.shape[1])
    return t.reshape(t.shape[0], heads, t.shape[1] // heads).transpose(0, 1)


def from_blocks(blocks: torch.Tensor, split: str, shape: torch.Size) -> torch.Tensor:
    if split.startswith("cols:"):
        return blocks.transpose(0, 1).reshape(shape)
    return blocks.reshape(shape)


def muon_update(update: torch.Tensor, split: str) -> torch.Tensor:
    """Orthogonalised, RMS-matched update with the parameter's shape (no lr applied)."""
    blocks = to_blocks(update, split)
    scale = MUON_RMS_SCALE * math.sqrt(max(blocks.shape[-2], blocks.shape[-1]))
    return from_blocks(newton_schulz(blocks) * scale, split, update.shape)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer, two rules: groups with algorithm="muon" (and a "split") or algorithm="adamw"."""

    def __init__(self, groups: list[dict], lr: float, weight_decay: float = 0.0):
        defaults = dict(lr=lr, weight_decay=weight_decay, algorithm="adamw", split="whole",
                        momentum=MUON_MOMENTUM, betas=ADAM_BETAS, eps=ADAM_EPS)
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(p.grad)
            nesterov = p.grad.add(buf, alpha=mu)
            if _is_dtensor(p):
                from torch.distributed.tensor import distribute_tensor

                full = muon_update(nesterov.full_tensor(), group["split"]).to(p.dtype)
                update = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            else:
                update = muon_update(nesterov, group["split"]).to(p.dtype)
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr)

    def _adamw_group(self, group: dict) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t = float(state["step"])
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt_().add_(eps)
            p.mul_(1 - lr * wd)
            p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** t))


# ---- which parameter goes where ------------------------------------------------------------------------------

ADAMW_NAMES = ("embed", "lm_head", "A_log", "dt_bias")


def _head_split(module: nn.Module, param_name: str):
    """The per-head split for an attention projection, or None when the matrix is orthogonalised whole.

    KDA: q/k/v projections produce H heads of head_dim rows; o_proj reads H heads of head_dim columns.
    MLA: q_b_proj (q_proj without a q LoRA) produces per head [q_nope | q_slice]; kv_b_proj produces per head
    [k_nope | v]. The MLA down projections (q_a, kv_a) feed a shared latent and stay whole.
    """
    heads = getattr(module, "num_heads", None)
    if heads is None:
        return None
    kind = type(module).__name__.lower()
    if "kda" in kind or "delta" in kind:
        if param_name in ("q_proj", "k_proj", "v_proj"):
            return f"rows:{heads}"
        if param_name == "o_proj":
            return f"cols:{heads}"
    if "mla" in kind or "latent" in kind:
        if param_name in ("q_b_proj", "q_proj", "kv_b_proj"):
            return f"rows:{heads}"
    return None


def param_groups(model: nn.Module, weight_decay: float, optimizer: str = "muon") -> list[dict]:
    """Parameter groups for MuonAdamW. optimizer="adamw" puts every parameter under AdamW (the baseline)."""
    modules = dict(model.named_modules())
    muon: dict = {}
    adam_decay, adam_plain = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = modules.get(owner_name)
        is_adam = (p.ndim < 2 or min(p.shape[-2:]) == 1 or any(key in name for key in ADAMW_NAMES)
                   or isinstance(owner, nn.Conv1d | nn.Embedding | nn.LayerNorm))
        if is_adam or optimizer == "adamw":
            (adam_decay if p.ndim >= 2 and not is_adam_plain(name, owner) else adam_plain).append(p)
            continue
        if p.ndim == 3:
            split = "experts"
        else:
            proj_name = owner_name.rpartition(".")[2] if leaf == "weight" else leaf
            attn = modules.get(owner_name.rpartition(".")[0]) if leaf == "weight" else owner
            split = _head_split(attn, proj_name) if attn is not None else None
            split = split or "whole"
        muon.setdefault(split, []).append(p)
    groups = [dict(params=ps, algorithm="muon", split=split, weight_decay=weight_decay) for split, ps in muon.items()]
    if adam_decay:
        groups.append(dict(params=adam_decay, algorithm="adamw", weight_decay=weight_decay))
    if adam_plain:
        groups.append(dict(params=adam_plain, algorithm="adamw", weight_decay=0.0))
    return groups


def is_adam_plain(name: str, owner: nn.Module | None) -> bool:
    """No weight decay: norms, biases, gates' A_log / dt_bias, conv kernels (small, non-matrix parameters)."""
    return "A_log" in name or "dt_bias" in name or isinstance(owner, nn.Conv1d) or "norm" in name


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, optimizer: str = "muon") -> MuonAdamW:
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"--optimizer must be 'muon' or 'adamw', got {optimizer!r}")
    return MuonAdamW(param_groups(model, weight_decay, optimizer), lr=lr, weight_decay=weight_decay)


def describe_groups(opt: MuonAdamW) -> Iterable[str]:
    for g in opt.param_groups:
        n = sum(p.numel() for p in g["params"])
        tag = f"muon split={g['split']}" if g["algorithm"] == "muon" else f"adamw wd={g['weight_decay']}"
        yield f"{tag}: {len(g['params'])} tensors, {n:,} values"
