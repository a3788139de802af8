"""Per-head Muon with AdamW for the rest (SPEC §6).

Muon step for a matrix parameter W with gradient G (momentum mu = 0.95, Nesterov):
    M <- mu M + G;   U = G + mu M
    O = NewtonSchulz5(U) per block;   W <- W (1 - lr wd) - lr * 0.2 sqrt(max(rows, cols)) * O
where the rows/cols are the block's, and weight decay is decoupled and uses the unscaled lr.

Blocks ("split" of a param group), declared by the module that owns the weight in its `muon_blocks()` method
({parameter name: split}; KDA, MLA and the routed experts have one), "whole" for every other matrix:
  "whole"       the matrix as one block (MLA q_a/kv_a/o/g, KDA gates, router, dense FFN, shared experts, ...)
  "rows:H"      [H*d, in] cut into H blocks [d, in]: the output features of head h are rows h*d..(h+1)*d-1
  "cols:H"      [out, H*d] cut into H blocks [out, d]: an output projection reads head h from columns h*d..
  "experts"     [E, out, in] stacked expert weights, one block per expert
Why per head: each head is its own attention map, and orthogonalising the concatenation couples their update
magnitudes (a head with large gradients takes the spectrum from the others). One block per head gives every head
an orthogonal update of the same RMS, is more stable at scale, and is cheaper (H small Newton-Schulz iterations
instead of one large one). Experts likewise: each expert is a separate FFN seen by different tokens.

Speed: the blocks are independent, so one optimizer step stacks every block of the same shape (the heads and
experts of one parameter and of every other parameter with blocks of that shape: all layers' q/k/v heads, all
layers' experts) and runs one batched Newton-Schulz chain per shape (`muon_updates`), in bf16 on CUDA and fp32
on CPU. `muon_update_reference` is the plain per-block loop it must equal.

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
from torch.optim.adamw import adamw

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MUON_MOMENTUM = 0.95
MUON_RMS_SCALE = 0.2  # 0.2 sqrt(max(rows, cols)) matches AdamW's update RMS
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximate orthogonalisation U V^T of each matrix in a batch [..., r, c] (quintic iteration), returned in
    fp32. The normalisation is fp32; the iteration's matmuls run in `dtype` (bf16 keeps the singular values in
    the iteration's band, as Muon's reference implementation runs it on GPUs)."""
    a, b, c = NS_COEFFS
    x = g.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    batch = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:]).to(dtype)
    for _ in range(steps):  # x <- a x + (b A + c A A) x,  A = x x^T: three batched matmuls
        A = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(A, A, A, beta=b, alpha=c), x, beta=a)
    x = x.float().reshape(*batch, *x.shape[-2:])
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


def _rms_scale(block_shape: tuple[int, ...]) -> float:
    return MUON_RMS_SCALE * math.sqrt(max(block_shape[-2], block_shape[-1]))


def muon_update_reference(update: torch.Tensor, split: str) -> torch.Tensor:
    """The specification of one parameter's update (no lr): each block orthogonalised on its own, one after the
    other, in fp32, scaled by 0.2 sqrt(max(rows, cols)). `muon_updates` is the batched form of the same."""
    blocks = to_blocks(update, split)
    ortho = torch.stack([newton_schulz(block) for block in blocks])
    return from_blocks(ortho * _rms_scale(blocks.shape), split, update.shape)


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bf16 matmuls on CUDA (tensor cores; Muon is insensitive to it), fp32 elsewhere (CPU bf16 is slow)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def muon_updates(updates: list[torch.Tensor], splits: list[str],
                 dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """`muon_update_reference` for many parameters at once: the blocks of all of them are grouped by shape (tall
    blocks transposed: Newton-Schulz commutes with transposition) and device, and each group is one batched
    Newton-Schulz chain. dtype: the iteration's (None: by device)."""
    blocks = [to_blocks(u, s) for u, s in zip(updates, splits, strict=True)]
    tall = [b.shape[-2] > b.shape[-1] for b in blocks]
    wide = [b.mT if t else b for b, t in zip(blocks, tall)]
    groups: dict[tuple, list[int]] = {}
    for i, b in enumerate(wide):
        groups.setdefault((tuple(b.shape[1:]), b.device), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(blocks)
    for (shape, device), members in groups.items():
        stacked = torch.cat([wide[i] for i in members])
        ortho = newton_schulz(stacked, dtype=dtype or newton_schulz_dtype(device)) * _rms_scale(shape)
        for i, part in zip(members, ortho.split([wide[i].shape[0] for i in members]), strict=True):
            out[i] = from_blocks(part.mT if tall[i] else part, splits[i], updates[i].shape)
    return out


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
        self._muon_step([g for g in self.param_groups if g["algorithm"] == "muon"])
        for group in self.param_groups:
            if group["algorithm"] != "muon":
                self._adamw_group(group)
        return loss

    def _muon_step(self, groups: list[dict]) -> None:
        """Every Muon group at once: momentum (multi-tensor ops per group), then one batched Newton-Schulz per block
        shape, then the decayed update (multi-tensor ops per group)."""
        todo: list[tuple[list[torch.Tensor], dict]] = []
        updates, splits = [], []
        for group in groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            grads = [p.grad for p in params]
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            mu = group["momentum"]
            torch._foreach_mul_(bufs, mu)
            torch._foreach_add_(bufs, grads)
            nesterov = torch._foreach_add(grads, bufs, alpha=mu)
            todo.append((params, group))
            updates += [n.full_tensor() if _is_dtensor(n) else n for n in nesterov]
            splits += [group["split"]] * len(params)
        results = iter(muon_updates(updates, splits))
        for params, group in todo:
            steps = []
            for p in params:
                update = next(results).to(p.dtype)
                if _is_dtensor(p):
                    from torch.distributed.tensor import distribute_tensor

                    update = distribute_tensor(update, p.device_mesh, p.placements, src_data_rank=None)
                steps.append(update)
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            torch._foreach_add_(params, steps, alpha=-group["lr"])

    def _adamw_group(self, group: dict) -> None:
        """AdamW through torch's own implementation: its fused kernels when every parameter is a plain CUDA tensor
        (one pass over each parameter's four tensors), multi-tensor otherwise (a loop over the parameters took 8% of
        a k3-debug step on an H200, bench/RESULTS.md). Fused, the step counters live on the device."""
        params = [p for p in group["params"] if p.grad is not None]
        fused = bool(params) and all(p.is_cuda and type(p.data) is torch.Tensor for p in params)  # not DTensors
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            where = p.device if fused else torch.device("cpu")  # a counter loaded from a checkpoint may be elsewhere
            if state["step"].device != where:
                state["step"] = state["step"].to(where)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
              [], [s["step"] for s in states], amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False, fused=fused or None)


# ---- which parameter goes where ------------------------------------------------------------------------------

EMBEDDING_NAMES = ("embed_tokens", "lm_head", "pos_emb")  # AdamW with weight decay (pos_emb: the vision tower's)


def muon_splits(model: nn.Module) -> dict[str, str]:
    """{parameter name: split} from every module's `muon_blocks()`; ValueError for a name that is no parameter."""
    params = dict(model.named_parameters())
    splits = {}
    for prefix, module in model.named_modules():
        declare = getattr(module, "muon_blocks", None)
        for leaf, split in (declare() if callable(declare) else {}).items():
            name = f"{prefix}.{leaf}" if prefix else leaf
            if name not in params:
                raise ValueError(f"{type(module).__name__}.muon_blocks() names {leaf!r}, which is not a parameter "
                                 f"of {prefix or 'the model'}")
            if split not in ("whole", "experts"):
                parse_head_split(split)
            splits[name] = split
    return splits


def rule_for(name: str, p: torch.Tensor, splits: dict[str, str]) -> str:
    """"adamw" (with weight decay), "adamw-plain" (without) or a Muon split for the parameter called `name`.

    AdamW without decay: every 1-D parameter (norm weights, A_log, dt_bias), depthwise conv kernels [C, 1, W] and
    the AttnRes pseudo-queries [1, D] (vectors stored as matrices). AdamW with decay: embeddings and the LM head.
    Muon: the split its module declares (`muon_splits`), else the matrix whole.
    """
    if p.ndim < 2 or min(p.shape) == 1:
        return "adamw-plain"
    if any(key in name for key in EMBEDDING_NAMES):
        return "adamw"
    if name not in splits and p.ndim > 2:
        raise ValueError(f"parameter {name} {list(p.shape)} has more than two dimensions and no Muon split: "
                         "declare one in its module's muon_blocks()")
    return splits.get(name, "whole")


def param_groups(model: nn.Module, weight_decay: float, optimizer: str = "muon") -> list[dict]:
    """Parameter groups for MuonAdamW, one per Muon split and two for AdamW (with / without weight decay).
    optimizer="adamw" puts every parameter under AdamW (the baseline), keeping the decay choice."""
    splits = muon_splits(model)
    buckets: dict[str, list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            rule = rule_for(name, p, splits)
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
