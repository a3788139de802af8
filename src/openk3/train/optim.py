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

import torch
from torch import nn

from openk3.model.common import ShortConv
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA
from openk3.model.moe import Experts

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

EMBEDDING_NAMES = ("embed_tokens", "lm_head")  # AdamW with weight decay


def _head_split(module: nn.Module | None, proj_name: str) -> str | None:
    """The per-head split of an attention projection, or None when the matrix is orthogonalised whole.

    KDA: q/k/v projections produce H heads of head_dim rows; o_proj reads H heads of head_dim columns.
    MLA: q_b_proj (q_proj without a q LoRA) produces per head [q_nope | q_slice]; kv_b_proj produces per head
    [k_nope | v]. The MLA down projections (q_a, kv_a) feed a latent shared by all heads and stay whole, and so
    does MLA's o_proj (SPEC §6 names q and kv for MLA). Gates (f_a/f_b, g_proj, b_proj) stay whole.
    """
    if isinstance(module, KimiDeltaAttention):
        if proj_name in ("q_proj", "k_proj", "v_proj"):
            return f"rows:{module.num_heads}"
        if proj_name == "o_proj":
            return f"cols:{module.num_heads}"
    if isinstance(module, GatedMLA) and proj_name in ("q_b_proj", "q_proj", "kv_b_proj"):
        return f"rows:{module.num_heads}"
    return None


def rule_for(name: str, p: torch.Tensor, modules: dict[str, nn.Module]) -> str:
    """"adamw" (with weight decay), "adamw-plain" (without) or a Muon split for the parameter called `name`.

    AdamW without decay: every 1-D parameter (norm weights, A_log, dt_bias), depthwise conv kernels [C, 1, W] and
    the AttnRes pseudo-queries [1, D] (vectors stored as matrices). AdamW with decay: embeddings and the LM head.
    Muon: stacked experts per expert, attention projections per head, every other 2-D matrix whole.
    """
    owner_name, _, leaf = name.rpartition(".")
    owner = modules.get(owner_name)
    if p.ndim < 2 or isinstance(owner, ShortConv) or min(p.shape) == 1:
        return "adamw-plain"
    if any(key in name for key in EMBEDDING_NAMES):
        return "adamw"
    if isinstance(owner, Experts):
        return "experts"
    parent_name, _, proj_name = owner_name.rpartition(".")
    return _head_split(modules.get(parent_name), proj_name) or "whole"


def param_groups(model: nn.Module, weight_decay: float, optimizer: str = "muon") -> list[dict]:
    """Parameter groups for MuonAdamW, one per Muon split and two for AdamW (with / without weight decay).
    optimizer="adamw" puts every parameter under AdamW (the baseline), keeping the decay choice."""
    modules = dict(model.named_modules())
    buckets: dict[str, list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            rule = rule_for(name, p, modules)
            if optimizer == "adamw" and not rule.startswith("adamw"):
                rule = "adamw"
            buckets.setdefault(rule, []).append(p)
    groups = []
    for rule, params in buckets.items():
        if rule == "adamw":
            groups.append(dict(params=params, algorithm="adamw", weight_decay=weight_decay))
        elif rule == "adamw-plain":
            groups.append(dict(params=params, algorithm="adamw", weight_decay=0.0))
        else:
            groups.append(dict(params=params, algorithm="muon", split=rule, weight_decay=weight_decay))
    return groups


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, optimizer: str = "muon") -> MuonAdamW:
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"--optimizer must be 'muon' or 'adamw', got {optimizer!r}")
    return MuonAdamW(param_groups(model, weight_decay, optimizer), lr=lr, weight_decay=weight_decay)
