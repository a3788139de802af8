"""The language-model loss: LM head + cross-entropy, chunked over tokens so that no [tokens, vocab] tensor outlives
a chunk (the training loss of SPEC §5: next-token and MTP cross-entropy through the shared LM head).

`linear_cross_entropy(hidden, weight, targets)` equals `cross_entropy_reference` (F.linear, then F.cross_entropy on
fp32 logits). Per chunk of tokens the forward computes the logits in the matmul dtype (the autocast dtype under
autocast, as F.linear would), the log-sum-exp and the loss in fp32, and right there the chunk's gradients:
    d loss_i / d logits_i = softmax(logits_i) - onehot(target_i)      (times 1/count for the mean, 0 if ignored)
    grad_hidden[chunk] = g @ W          grad_weight += g^T @ hidden[chunk]   (accumulated in fp32)
On a GPU the softmax part runs as one Triton program per row (`ops.triton_loss`) on the matmul's own bf16 logits,
which it overwrites with their gradient, and the weight gradient accumulates in the GEMM's epilogue. Backward
only scales the stored gradients by grad_output.
What stays alive between forward and backward is grad_hidden [N, D] and grad_weight [V, D] instead of fp32
log-probabilities [N, V] plus the CE backward's buffers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.fused import use_triton
from openk3.ops.norms import acc_dtype, compute_dtype, fp32_island

# tokens per chunk: as many as make 256 MiB of logits in the dtype the chunk holds them in (fp32 for the PyTorch
# form: 2048 tokens of a 32k vocabulary; the Triton form keeps the matmul's bf16, so twice as many). At k3-debug's
# step on an H200, 4096-token chunks took 1.3 ms less of GEMM time than 2048-token ones (the weight gradient's
# product, accumulated per chunk, is longer) for 0.2 GiB more peak memory (bench/RESULTS.md, 2026-12-02)
CHUNK_LOGITS_BYTES = 256 << 20
REDUCTIONS = ("mean", "sum")


def cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                            ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """The plain computation: logits = F.linear(hidden, weight) (autocast applies), then CE on fp32 logits."""
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=ignore_index, reduction=reduction)


def rows_reference(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, ignore_index: int,
                   write_grad: bool, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-row loss [c] in `acc`, d loss/d logits [c, V] times the row's scale in logits' dtype, or None) for one
    chunk of logits [c, V], which it may overwrite: the PyTorch form of `ops.triton_loss.ce_rows_triton`, on an
    `acc` copy of the logits (or the logits themselves when they are in `acc` already)."""
    keep = targets != ignore_index
    safe = torch.where(keep, targets, 0).unsqueeze(1)
    x = logits.to(acc)  # [c, V]
    picked = x.gather(1, safe).squeeze(1)
    top = x.amax(dim=-1, keepdim=True)
    e = x.sub_(top).exp_()  # in place: the chunk's only [c, V] fp32 buffer, exp taken once
    denom = e.sum(dim=-1)
    losses = torch.where(keep, top.squeeze(1) + denom.log() - picked, 0)
    if not write_grad:
        return losses, None
    row_scale = torch.where(keep, scale, 0)
    g = e.mul_((row_scale / denom).unsqueeze(1))  # softmax, times the row's scale
    return losses, g.scatter_add_(1, safe, -row_scale.unsqueeze(1)).to(logits.dtype)  # minus onehot


def _ce_rows(logits, targets, scale, ignore_index, write_grad, acc):
    """The Triton kernel on GPUs (`ops.fused.use_triton`), `rows_reference` elsewhere and for fp64."""
    if use_triton(logits):
        from openk3.ops.triton_loss import ce_rows_triton  # triton is an optional dependency

        return ce_rows_triton(logits, targets, scale, ignore_index, write_grad), logits if write_grad else None
    return rows_reference(logits, targets, scale, ignore_index, write_grad, acc)


def _add_weight_grad(grad_weight: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """grad_weight += g^T h in grad_weight's dtype; on a GPU one GEMM whose epilogue adds into the fp32 sum (no
    [V, D] product in g's dtype, then its copy, then the add)."""
    if g.dtype == grad_weight.dtype:
        grad_weight.addmm_(g.t(), h)
    elif grad_weight.is_cuda:
        torch.addmm(grad_weight, g.t(), h, out_dtype=grad_weight.dtype, out=grad_weight)
    else:
        grad_weight += (g.t() @ h).to(grad_weight.dtype)


def default_chunk(hidden: torch.Tensor, vocab: int, dtype: torch.dtype) -> int:
    """Tokens per chunk for `CHUNK_LOGITS_BYTES` of logits: in `dtype` where the kernel runs, in fp32 otherwise."""
    held = dtype if use_triton(hidden) else acc_dtype(dtype)
    return max(1, CHUNK_LOGITS_BYTES // (vocab * torch.finfo(held).bits // 8))


def chunked_loss_and_grads(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                           ignore_index: int, reduction: str, dtype: torch.dtype, grad_hidden_needed: bool,
                           grad_weight_needed: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss, d loss/d hidden, d loss/d weight) chunk by chunk (module docstring); matmuls in `dtype` as given."""
    acc = acc_dtype(dtype)
    w = weight.to(dtype)
    valid = targets != ignore_index
    # mean: each kept token's gradient carries 1/count (no host sync; count 0: loss nan and gradients 0, as
    # F.cross_entropy gives)
    scale = 1.0 / valid.sum().to(acc) if reduction == "mean" else torch.ones((), dtype=acc, device=hidden.device)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if grad_hidden_needed else None
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if grad_weight_needed else None
    write_grad = grad_hidden_needed or grad_weight_needed
    for lo in range(0, hidden.shape[0], chunk):
        h = hidden[lo:lo + chunk].to(dtype)
        losses, g = _ce_rows(h @ w.t(), targets[lo:lo + chunk], scale, ignore_index, write_grad, acc)
        total += losses.sum()
        if grad_hidden is not None:
            grad_hidden[lo:lo + chunk] = g @ w
        if grad_weight is not None:
            _add_weight_grad(grad_weight, g, h)
    return total * scale, grad_hidden, grad_weight


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, ignore_index, reduction, dtype, grad_hidden_needed,
                grad_weight_needed):
        with fp32_island(hidden):  # the matmuls run in `dtype`, chosen by the caller as autocast would
            loss, grad_hidden, grad_weight = chunked_loss_and_grads(hidden, weight, targets, chunk, ignore_index,
                                                                    reduction, dtype, grad_hidden_needed,
                                                                    grad_weight_needed)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_output.to(grad_weight.dtype)).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk: int | None = None, ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """cross_entropy(hidden @ weight^T, targets) without materialising the [N, V] logits (module docstring).

    hidden [N, D], weight [V, D] (the LM head's), targets [N]; ignore_index rows count neither in the loss nor in
    the mean. reduction "mean" (over the kept rows) or "sum"; chunk: tokens per chunk (default
    `default_chunk`). Returns an fp32 scalar (fp64 for fp64 inputs).
    Gradients flow to hidden and weight (grad_weight accumulated in fp32, returned in weight's dtype)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, D] and weight [V, D] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [{hidden.shape[0]}], got {tuple(targets.shape)}")
    grad = torch.is_grad_enabled()
    dtype = compute_dtype(hidden, torch.promote_types(hidden.dtype, weight.dtype))  # as F.linear would run
    chunk = chunk or default_chunk(hidden, weight.shape[0], dtype)
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, ignore_index, reduction, dtype,
                                     grad and hidden.requires_grad, grad and weight.requires_grad)
