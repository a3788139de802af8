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

Speed: the blocks are independent, so one optimizer step copies every block of the same shape (the heads and
experts of one parameter and of every other parameter with blocks of that shape: all layers' q/k/v heads, all
layers' experts) into one batch, cast to bf16 on CUDA (fp32 on CPU) on the way, and runs one batched
Newton-Schulz chain per shape (`BlockBatches`). Each parameter then takes its part of the batch in place,
through its block view, so no update is transposed, cast or scaled in a pass of its own (the RMS scale rides on
the last iteration). On a GPU the elementwise work is two Triton launches over all Muon parameters
(`ops.triton_muon`: momentum + Nesterov update written into the batches; weight decay + update), elsewhere (CPU,
FSDP2's DTensors) multi-tensor PyTorch passes. `muon_update_reference` is the plain per-block loop the batched
form must equal.

AdamW (betas 0.9/0.95) takes embeddings, the LM head, norms, every 1-D parameter, KDA's A_log and dt_bias, and
depthwise conv kernels. The router's `e_score_correction_bias` is a buffer, not a parameter: no optimizer sees it
(Quantile Balancing owns it, see balance.py).

FSDP2: parameters are DTensors sharded on dim 0; a block can straddle shards, so the Nesterov update is gathered
(`full_tensor`), orthogonalised whole and each rank keeps its own shard of the result.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn
from torch.optim.adamw import adamw

from openk3.ops.fused import triton_available

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MUON_MOMENTUM = 0.95
MUON_RMS_SCALE = 0.2  # 0.2 sqrt(max(rows, cols)) matches AdamW's update RMS
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8


def _newton_schulz_batch(x: torch.Tensor, steps: int, scale: float) -> torch.Tensor:
    """The quintic iteration on a batch [N, r, c] in x's dtype; x is normalised in place first (norms in fp32,
    so spectral norm <= Frobenius norm <= 1), and the last iteration's output is multiplied by `scale`.

    Each step forms the r x r polynomial P = a I + b A + c A^2 (A = x x^T) and then x <- P x, one product with
    no accumulate input: x a + (b A + c A A) x as one GEMM would first copy x into its output. A tall batch
    (r > c) iterates on its c x c Gram matrix, x <- x P with A = x^T x: the transpose of the same step, so tall
    blocks are never transposed in memory."""
    a, b, c = NS_COEFFS
    norms = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    x.mul_((1 / (norms + 1e-7)).to(x.dtype))
    tall = x.shape[-2] > x.shape[-1]
    for step in range(steps):  # three batched matmuls a step
        s = scale if step == steps - 1 else 1.0
        A = torch.bmm(x.mT, x) if tall else torch.bmm(x, x.mT)
        P = torch.baddbmm(A, A, A, beta=b * s, alpha=c * s)
        P.diagonal(dim1=-2, dim2=-1).add_(a * s)
        x = torch.bmm(x, P) if tall else torch.bmm(P, x)  # P is symmetric
    return x


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximate orthogonalisation U V^T of each matrix in a batch [..., r, c] (quintic iteration), returned in
    fp32. The norms are fp32; the iteration's matmuls run in `dtype` (bf16 keeps the singular values in the
    iteration's band, as Muon's reference implementation runs it on GPUs)."""
    x = g.reshape(-1, *g.shape[-2:]).to(dtype, copy=True)
    return _newton_schulz_batch(x, steps, 1.0).float().reshape(g.shape)


def parse_head_split(split: str) -> tuple[str, int]:
    """"rows:4" -> ("rows", 4). Splits are strings so they survive any state-dict serialisation unchanged."""
    kind, _, heads = split.partition(":")
    if kind not in ("rows", "cols") or not heads.isdigit():
        raise ValueError(f"unknown Muon split {split!r}; expected whole, experts, rows:H or cols:H")
    return kind, int(heads)


def to_blocks(t: torch.Tensor, split: str) -> torch.Tensor:
    """The parameter as a batch of blocks [N, r, c] (see the module docstring): a view of t whatever its strides
    (only one dimension is split), so writing the blocks writes t."""
    if split == "whole":
        return t.unsqueeze(0)
    if split == "experts":
        return t
    kind, heads = parse_head_split(split)
    if kind == "rows":
        return t.view(heads, t.shape[0] // heads, t.shape[1])
    return t.view(t.shape[0], heads, t.shape[1] // heads).transpose(0, 1)


def from_blocks(blocks: torch.Tensor, split: str, shape: torch.Size) -> torch.Tensor:
    if split.startswith("cols:"):
        return blocks.transpose(0, 1).reshape(shape)
    return blocks.reshape(shape)


def _rms_scale(block_shape: tuple[int, ...]) -> float:
    return MUON_RMS_SCALE * math.sqrt(max(block_shape[-2], block_shape[-1]))


def muon_update_reference(update: torch.Tensor, split: str) -> torch.Tensor:
    """The specification of one parameter's update (no lr): each block orthogonalised on its own, one after the
    other, in fp32, scaled by 0.2 sqrt(max(rows, cols)). `muon_block_updates` is the batched form of the same."""
    blocks = to_blocks(update, split)
    ortho = torch.stack([newton_schulz(block) for block in blocks])
    return from_blocks(ortho * _rms_scale(blocks.shape), split, update.shape)


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bf16 matmuls on CUDA (tensor cores; Muon is insensitive to it), fp32 elsewhere (CPU bf16 is slow)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class BlockBatches:
    """Empty batches, one per block shape and device, that the updates' blocks are written into: `parts[i]` is
    the i-th update's blocks (`to_blocks(update, split)`'s shape [N_i, r, c]) as a contiguous part of its batch.
    `orthogonalised()` runs one batched Newton-Schulz chain per batch and returns each update's part of the
    result (scaled by the RMS factor), in the same order."""

    def __init__(self, block_shapes: list[torch.Size], devices: list[torch.device], dtype: torch.dtype | None = None):
        groups: dict[tuple, list[int]] = {}
        for i, (shape, device) in enumerate(zip(block_shapes, devices, strict=True)):
            groups.setdefault((tuple(shape[1:]), device), []).append(i)
        self.parts: list[torch.Tensor] = [torch.empty(0)] * len(block_shapes)
        self._batches = []
        for (shape, device), members in groups.items():
            sizes = [block_shapes[i][0] for i in members]
            batch = torch.empty(sum(sizes), *shape, dtype=dtype or newton_schulz_dtype(device), device=device)
            self._batches.append((batch, members, sizes))
            for i, part in zip(members, batch.split(sizes), strict=True):
                self.parts[i] = part

    def orthogonalised(self) -> list[torch.Tensor]:
        out = list(self.parts)
        for batch, members, sizes in self._batches:
            ortho = _newton_schulz_batch(batch, NS_STEPS, _rms_scale(batch.shape))
            for i, part in zip(members, ortho.split(sizes), strict=True):
                out[i] = part
        return out


def muon_block_updates(updates: list[torch.Tensor], splits: list[str],
                       dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """`muon_update_reference` for many parameters at once, in block form: for each update its blocks
    (`to_blocks(update, split)`'s shape) orthogonalised and scaled, in the iteration's dtype (None: by device),
    as views of one batch per block shape (`BlockBatches`; the blocks are copied in, cast on the way)."""
    blocks = [to_blocks(u, s) for u, s in zip(updates, splits, strict=True)]
    batches = BlockBatches([b.shape for b in blocks], [b.device for b in blocks], dtype)
    for part, b in zip(batches.parts, blocks, strict=True):
        part.copy_(b)
    return batches.orthogonalised()


def _cols_heads(split: str) -> int:
    """H for a "cols:H" split (whose blocks reorder the parameter's elements), 1 for every other split."""
    return parse_head_split(split)[1] if split.startswith("cols:") else 1


def _fused_muon_blocker(params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor]) -> str | None:
    """Why Muon's elementwise passes cannot run as the Triton kernels of `ops.triton_muon`, or None when they can:
    plain contiguous CUDA tensors of one dtype a list (CPU tensors under TRITON_INTERPRET=1, the tests')."""
    if not triton_available():
        return "triton is not installed"
    if not params[0].is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the parameters are on {params[0].device}, not on a CUDA device"
    from openk3.ops import triton_muon

    if not all(triton_muon.supports(ts) for ts in (params, grads, bufs)):
        return ("the parameters, gradients or momentum buffers are not all plain contiguous tensors of one float "
                "dtype on one device (FSDP2's DTensors take the PyTorch form)")
    return None


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer, two rules: groups with algorithm="muon" (and a "split") or algorithm="adamw"."""

    def __init__(self, groups: list[dict], lr: float, weight_decay: float = 0.0, fused: bool | None = None):
        """fused: Muon's elementwise passes as Triton kernels: None where the tensors allow (CUDA, not sharded),
        True always (ValueError at the step where they cannot run), False never (PyTorch passes)."""
        defaults = dict(lr=lr, weight_decay=weight_decay, algorithm="adamw", split="whole",
                        momentum=MUON_MOMENTUM, betas=ADAM_BETAS, eps=ADAM_EPS)
        super().__init__(groups, defaults)
        self.fused = fused

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
        """Every Muon group at once: the momentum M <- mu M + G in place and the Nesterov update G + mu M written
        into one batch per block shape, one batched Newton-Schulz chain per batch, then weight decay and the
        updates applied through the parameters' block views. On a GPU the two elementwise parts are one Triton
        launch each (`ops.triton_muon`); otherwise multi-tensor passes per group (`_muon_group_updates`), where
        sharded parameters gather their Nesterov update first."""
        work = []  # (group, its parameters with a gradient, their momentum buffers)
        for group in groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            if params:
                work.append((group, params, [self.state[p]["momentum_buffer"] for p in params]))
        params = [p for _, ps, _ in work for p in ps]
        bufs = [b for _, _, bs in work for b in bs]
        if not params:
            return
        blocker = "fused=False" if self.fused is False else _fused_muon_blocker(params, [p.grad for p in params], bufs)
        if blocker is not None and self.fused:
            raise ValueError(f"MuonAdamW(fused=True): {blocker}")
        if blocker is not None:
            self._muon_group_updates(work)
            return
        from openk3.ops import triton_muon

        def per_param(value) -> list:
            return [value(group) for group, ps, _ in work for _ in ps]

        splits = per_param(lambda g: g["split"])
        heads = [_cols_heads(s) for s in splits]
        batches = BlockBatches([to_blocks(p, s).shape for p, s in zip(params, splits, strict=True)],
                               [p.device for p in params])
        triton_muon.momentum_into_blocks([p.grad for p in params], bufs, batches.parts, heads,
                                         per_param(lambda g: g["momentum"]))
        triton_muon.apply_block_updates(params, batches.orthogonalised(), heads, per_param(lambda g: g["lr"]),
                                        per_param(lambda g: 1 - g["lr"] * g["weight_decay"]))

    @staticmethod
    def _muon_group_updates(work: list[tuple[dict, list[torch.Tensor], list[torch.Tensor]]]) -> None:
        """`_muon_step` in PyTorch operations (the reference of the fused form, and FSDP2's path). (An
        out-of-place momentum, one pass fewer, made the eager training step slower: 196 new buffers a step
        against the backward's allocations, bench/RESULTS.md.)"""
        updates, splits = [], []
        for group, params, bufs in work:
            grads, mu = [p.grad for p in params], group["momentum"]
            torch._foreach_mul_(bufs, mu)
            torch._foreach_add_(bufs, grads)
            updates += [n.full_tensor() if _is_dtensor(n) else n for n in torch._foreach_add(grads, bufs, alpha=mu)]
            splits += [group["split"]] * len(params)
        results = iter(muon_block_updates(updates, splits))
        for group, params, _ in work:
            lr, split = group["lr"], group["split"]
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            if not _is_dtensor(params[0]):  # each parameter's block view takes its update in place, cast on the fly
                torch._foreach_add_([to_blocks(p, split) for p in params], [next(results) for _ in params],
                                    alpha=-lr)
                continue
            from torch.distributed.tensor import distribute_tensor

            for p in params:
                update = from_blocks(next(results), split, p.shape).to(p.dtype)
                p.add_(distribute_tensor(update, p.device_mesh, p.placements, src_data_rank=None), alpha=-lr)

    def _adamw_group(self, group: dict) -> None:
        """AdamW through torch's own implementation: its fused kernels when every parameter is a plain CUDA tensor
        (one pass over each parameter's four tensors), multi-tensor otherwise (never a loop over the parameters).
        Fused, the step counters live on the device."""
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


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, optimizer: str = "muon",
                    fused: bool | None = None) -> MuonAdamW:
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"--optimizer must be 'muon' or 'adamw', got {optimizer!r}")
    return MuonAdamW(param_groups(model, weight_decay, optimizer), lr=lr, weight_decay=weight_decay, fused=fused)
