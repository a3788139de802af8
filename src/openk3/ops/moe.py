"""Mixture-of-experts routing and expert compute (SPEC-K3 §5).

Routing: s = sigmoid(logits) per expert; the top-k experts are *selected* on s + b (b = the correction bias,
never trained by gradient); the combine weights are the *unbiased* s of the selected experts, renormalised
to sum to 1, times routed_scaling_factor.

Expert weights are 3-D tensors, one slice per expert, in nn.Linear's [out, in] layout:
  gate_up [E, 2*I, Din]   rows [:I] the gate projection, rows [I:] the up projection (HF's `gate_up_proj`)
  down    [E, Dout, I]
`experts_forward` permutes tokens into expert-contiguous groups once and calls `grouped_glu_mlp` on them, which
runs one grouped GEMM per projection (`torch._grouped_mm`, SPEC §14) on a Hopper-class GPU in bf16 and a loop over
the experts elsewhere (the loop is the reference). Neither the dispatch nor the grouped path reads a tensor's
values on the host, so a CUDA step has no host-device sync here. Experts kept MXFP4 (SPEC §13) take
`experts_forward_mxfp4`: the same sorted dispatch around grouped W4A16 Triton GEMMs (`ops.triton_mxfp4`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from openk3.ops.activations import apply_glu
from openk3.ops.fused import triton_available, use_triton
from openk3.ops.norms import acc_dtype, compute_dtype

# Each expert's group of rows is padded to a multiple of 16 bytes' worth of rows: in the weight-gradient GEMM the
# token dimension is the contracted unit-stride one, which TMA wants 16-byte aligned (SPEC §14).
GROUP_ALIGN_BYTES = 16


class Routing(NamedTuple):
    weights: torch.Tensor  # [N,k] fp32 combine weights (fp64 for fp64 logits)
    indices: torch.Tensor  # [N,k] int64 selected experts
    scores: torch.Tensor  # [N,E] fp32 unbiased sigmoid scores


def sigmoid_topk_routing(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    *,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> Routing:
    """logits [N,E] -> Routing. Selection on sigmoid(logits) + bias; weights from the unbiased scores. fp32 logits
    on a GPU take one Triton pass (`ops.triton_routing`, a custom op: compiled code too): all of the routing without
    autograd; with it the kernel's picks only (no gradient flows through them), the weights then differentiable from
    the scores, where torch.topk costs two sort kernels a layer."""
    kernel = logits.dtype == torch.float32 and use_triton(logits, compiled=True) and top_k <= logits.shape[-1]
    if kernel:
        from openk3.ops.triton_routing import sigmoid_topk_routing_triton  # triton is an optional dependency

        if not (torch.is_grad_enabled() and logits.requires_grad):
            return Routing(*sigmoid_topk_routing_triton(logits, bias, top_k, renormalize, scaling))
    scores = torch.sigmoid(logits.to(acc_dtype(logits.dtype)))
    if kernel:
        indices = sigmoid_topk_routing_triton(logits.detach(), bias, top_k, renormalize, scaling)[1]
    else:
        choice = scores if bias is None else scores + bias.to(scores.dtype)
        indices = torch.topk(choice, k=top_k, dim=-1).indices
    return routing_with(scores, indices, renormalize=renormalize, scaling=scaling)


def routing_with(scores: torch.Tensor, indices: torch.Tensor, *, renormalize: bool = True,
                 scaling: float = 1.0) -> Routing:
    """The Routing of chosen experts indices [N,k]: combine weights from the unbiased scores [N,E]."""
    weights = scores.gather(-1, indices)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return Routing(weights * scaling, indices, scores)


def group_by_expert(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [N,k] -> (order [N*k]: flat (token, slot) ids sorted by expert, counts [E] tokens per expert)."""
    flat = indices.reshape(-1)
    # the narrowest key type that holds the expert ids: a GPU radix sort takes one pass per key byte (8 for int64:
    # 58 us a layer for k3-debug's 131k rows on an H200)
    keys = flat.to(torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 1 << 15 else flat.dtype)
    order = torch.argsort(keys, stable=True)
    # the counts as a comparison summed over the rows: no host sync (bincount reads the max index on the host,
    # which CUDA graphs cannot capture), no atomics (a scatter_add onto E counters: 47 us a layer there)
    counts = (flat.unsqueeze(1) == torch.arange(num_experts, device=flat.device)).sum(0)
    return order, counts


def grouped_glu_mlp(
    x_sorted: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Rows of x_sorted [M,Din] grouped by expert (counts [E]) -> [M,Dout]: act(x W_gate_up^T) W_down^T per group.

    Grouped GEMMs where `grouped_mm_usable` says so, else the loop over experts."""
    if grouped_mm_usable(x_sorted, gate_up, down):
        return grouped_glu_mlp_gemm(x_sorted, counts, gate_up, down, act)
    return grouped_glu_mlp_loop(x_sorted, counts, gate_up, down, act)


def grouped_glu_mlp_loop(x_sorted, counts, gate_up, down, act) -> torch.Tensor:
    """`grouped_glu_mlp` as a loop over the active experts (the reference; reads counts on the host).

    The rows are split and the weights unbound once, so backward assembles each gradient with one cat / stack;
    indexing `gate_up[e]` or slicing rows per expert would instead add a zero-padded full-size gradient per
    expert (E times the traffic of the weights and of x_sorted)."""
    sizes = counts.tolist()
    outs = []
    for xe, w_gate_up, w_down, n in zip(x_sorted.split(sizes), gate_up.unbind(0), down.unbind(0), sizes):
        if n:
            outs.append(F.linear(apply_glu(act, F.linear(xe, w_gate_up)), w_down))
    return torch.cat(outs) if outs else x_sorted.new_empty(0, down.shape[1])


def _grouped_mm_fn():
    """torch's grouped GEMM: F.grouped_mm (public from torch 2.10) or torch._grouped_mm, None if neither exists."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_usable(x_sorted: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """The grouped-GEMM fast path: CUDA, compute capability >= 9.0 (its CUTLASS kernel), bf16, and widths whose
    rows are whole multiples of 16 bytes (strides the kernel accepts)."""
    if not x_sorted.is_cuda or _grouped_mm_fn() is None or compute_dtype(x_sorted) != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x_sorted.device) < (9, 0):
        return False
    align = GROUP_ALIGN_BYTES // 2
    return all(n % align == 0 for n in (gate_up.shape[1], gate_up.shape[2], down.shape[1], down.shape[2]))


class GroupedLayout(NamedTuple):
    offsets: torch.Tensor  # [E] int32 end row of each expert's group in the padded buffer (the last one = capacity)
    dest: torch.Tensor  # [M] int64 row of the padded buffer that each sorted row goes to
    source: torch.Tensor  # [capacity] int64 the sorted row each padded row holds, M for a padding row
    capacity: int  # rows of the padded buffer (a bound that depends on M and E only: no host sync)


def grouped_layout(counts: torch.Tensor, num_rows: int, align: int) -> GroupedLayout:
    """Place the M sorted rows (counts [E] per expert) in a zero-padded buffer for the grouped GEMM: every group
    starts on a multiple of `align` rows and holds at least `align` rows (empty groups have tripped the kernels'
    stride checks and left their weight gradients unwritten, SPEC §14; padding rows are zeros, so they add
    nothing to any gradient), and the last group runs to the end of the buffer, so no row is left outside the
    groups (the kernel leaves such rows, and their gradients, uninitialised). On a GPU one Triton launch
    (`ops.triton_layout`) does what these twenty-odd small operations do."""
    E = counts.numel()
    capacity = -(-(num_rows + E * align) // align) * align  # >= sum(padded): each group adds < align + count rows
    if counts.is_cuda and not torch.compiler.is_compiling() and triton_available():
        from openk3.ops.triton_layout import grouped_layout_triton  # triton is an optional dependency

        return GroupedLayout(*grouped_layout_triton(counts, num_rows, align, capacity), capacity)
    padded = (counts.clamp_min(1) + align - 1) // align * align
    ends = padded.cumsum(0)
    offsets = torch.cat([ends[:-1], ends.new_full((1,), capacity)]).to(torch.int32)
    shift = (ends - padded) - (counts.cumsum(0) - counts)  # padded start - unpadded start, per expert
    expert_of_row = torch.repeat_interleave(torch.arange(E, device=counts.device), counts, output_size=num_rows)
    rows = torch.arange(num_rows, device=counts.device)
    dest = rows + shift[expert_of_row]
    source = torch.full((capacity,), num_rows, dtype=dest.dtype, device=counts.device)
    source[dest] = rows
    return GroupedLayout(offsets, dest, source, capacity)


def _gather_rows(x: torch.Tensor, index: torch.Tensor, zero_row: bool) -> torch.Tensor:
    """x[index], where with `zero_row` index may also name one row past x's last: a row of zeros."""
    return (torch.cat([x, x.new_zeros(1, x.shape[1])]) if zero_row else x).index_select(0, index)


class _MoveRows(torch.autograd.Function):
    """Rows moved between the sorted order and the grouped GEMM's padded buffer (`GroupedLayout`'s source / dest
    maps): each row lands in one place, so the gradient is the gather by the inverse map, where index_select's
    backward is an index_add (atomic adds, slow for bf16 rows: bench/RESULTS.md).
    Exact: every gradient row is one incoming row or zero, as index_add into zeros gives it."""

    @staticmethod
    def forward(ctx, x, forward_map, backward_map, zero_row: bool):
        ctx.save_for_backward(backward_map)
        ctx.zero_row = zero_row
        return _gather_rows(x, forward_map, zero_row)

    @staticmethod
    def backward(ctx, grad):
        (backward_map,) = ctx.saved_tensors
        return _gather_rows(grad, backward_map, not ctx.zero_row), None, None, None


def grouped_glu_mlp_gemm(x_sorted, counts, gate_up, down, act, *, mm=None) -> torch.Tensor:
    """`grouped_glu_mlp` as two grouped GEMMs over a padded copy of the rows (`grouped_layout`), the GLU between
    them on the packed [gate | up] product. Runs in `compute_dtype(x_sorted)`; `mm` defaults to torch's grouped
    GEMM (whose CPU kernel takes fp32 / bf16 with 16-byte row strides, which the tests use)."""
    mm = mm or _grouped_mm_fn()
    dtype = compute_dtype(x_sorted)
    M = x_sorted.shape[0]
    layout = grouped_layout(counts, M, GROUP_ALIGN_BYTES * 8 // torch.finfo(dtype).bits)
    # the padded rows gathered from the rows plus one zero row: a gather keeps only its index for backward, where
    # index_copy into a zero buffer would keep a copy of all the rows
    x_pad = _MoveRows.apply(x_sorted.to(dtype), layout.source, layout.dest, True)
    h = mm(x_pad, gate_up.to(dtype).transpose(-2, -1), offs=layout.offsets)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # the GLU's output is recomputed in backward from h (kept anyway for the GLU's own backward) instead of
        # being kept for the down projection's weight gradient; the checkpoint stops recomputing once that output
        # is back, before the second GEMM runs again. (Compiled, Inductor's partitioner makes that choice.)
        y = checkpoint(_glu_down, act, h, down, dtype, layout.offsets, mm, use_reentrant=False,
                       preserve_rng_state=False)
    else:
        y = _glu_down(act, h, down, dtype, layout.offsets, mm)
    return _MoveRows.apply(y, layout.dest, layout.source, False)


def _glu_down(act, h, down, dtype, offsets, mm) -> torch.Tensor:
    return mm(apply_glu(act, h), down.to(dtype).transpose(-2, -1), offs=offsets)


def experts_forward(
    x: torch.Tensor,
    routing_indices: torch.Tensor,
    routing_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_k w[n,k] * Expert_{idx[n,k]}(x[n]) for x [N,Din] -> [N,Dout] (x's dtype; combined in fp32).

    Without autograd: one token (decode at batch 1) takes `experts_forward_gathered` when `gathers` says so; a few
    tokens that pick at least as many rows as there are experts (decode batches: most experts are read anyway) take
    `experts_forward_dense`; fewer rows than experts take the row kernel on a GPU (`experts_forward_rows`: only the
    experts picked are read). Everything else sorts the rows by expert for the grouped GEMM."""
    N, k = routing_indices.shape
    E = gate_up.shape[0]
    if not torch.is_grad_enabled():
        rows = N * k < E and use_triton(x, compiled=True) and gate_up.dtype == down.dtype == compute_dtype(x)
        if gathers(N, k, E, (gate_up[0].numel() + down[0].numel()) * gate_up.element_size(), rows):
            return experts_forward_gathered(x, routing_indices, routing_weights, gate_up, down, act)
        if N <= DENSE_MAX_TOKENS and N * k >= E and E * N * gate_up.shape[1] <= DENSE_MAX_ELEMENTS:
            return experts_forward_dense(x, routing_indices, routing_weights, gate_up, down, act)
        if rows:
            return experts_forward_rows(x, routing_indices, routing_weights, gate_up, down, act)
    return experts_forward_sorted(x, routing_indices, routing_weights, E,
                                  lambda x_sorted, counts: grouped_glu_mlp(x_sorted, counts, gate_up, down, act))


def experts_forward_rows(x, routing_indices, routing_weights, gate_up, down, act) -> torch.Tensor:
    """`experts_forward` over the rows sorted by expert with the row kernel (`ops.triton_expert_rows`: one row a
    program, each row reading its own expert's weights), the GLU between: for fewer rows than experts, where the
    grouped GEMM would read all E experts' weights. Forward only; no host sync."""
    from openk3.ops.triton_expert_rows import expert_rows_matmul  # triton is an optional dependency

    return sorted_glu(x, routing_indices, routing_weights, expert_rows_matmul, (gate_up,), (down,), act)


def sorted_glu(x, routing_indices, routing_weights, matmul: Callable[..., torch.Tensor], gate_up: tuple,
               down: tuple, act) -> torch.Tensor:
    """`experts_forward_sorted` in x's compute dtype with the experts' GLU MLP as two grouped products
    matmul(rows, counts, *weights) (weights: one tensor, or MXFP4's codes and scales) and the GLU between them."""
    def mlp(x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return matmul(apply_glu(act, matmul(x_sorted, counts, *gate_up)), counts, *down)

    return experts_forward_sorted(x.to(compute_dtype(x)), routing_indices, routing_weights, gate_up[0].shape[0],
                                  mlp).to(x.dtype)


def experts_forward_sorted(x: torch.Tensor, routing_indices: torch.Tensor, routing_weights: torch.Tensor,
                           num_experts: int, mlp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`experts_forward` with the rows sorted by expert: mlp(x_sorted [N*k, Din], counts [E]) -> [N*k, Dout] runs
    the experts on the groups, whose outputs are combined per token in fp32. No host sync."""
    N, k = routing_indices.shape
    order, counts = group_by_expert(routing_indices, num_experts)
    token_of = order // k  # which token each sorted row came from
    y_sorted = mlp(x[token_of], counts)
    if not torch.is_grad_enabled():  # the rows put back in (token, slot) order and summed: no atomic adds
        if use_triton(y_sorted):  # (in one launch; while torch.compile traces, Inductor fuses the reference)
            from openk3.ops.triton_combine import combine_sorted_triton

            return combine_sorted_triton(y_sorted, order, routing_weights, x.dtype)
        return weighted_sum(torch.empty_like(y_sorted).index_copy_(0, order, y_sorted).view(N, k, -1),
                            routing_weights, x.dtype)
    w_sorted = routing_weights.reshape(-1)[order].unsqueeze(-1)
    return combine_rows(y_sorted, w_sorted, token_of, N, acc_dtype(x.dtype)).to(x.dtype)


def weighted_sum(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each token's k expert outputs y [N, k, D] combined with its routing weights [N, k] in `dtype`'s accumulation
    type, cast to `dtype`."""
    acc = acc_dtype(dtype)
    return (y.to(acc) * weights.unsqueeze(-1).to(acc)).sum(1).to(dtype)


def grouped_matmul_loop(x_sorted: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x_sorted [M, K] grouped by expert (counts [E]) -> [M, N]: each group times its expert's w [E, N, K]
    transposed, one product per expert (a reference for one grouped GEMM; reads counts on the host)."""
    return torch.cat([F.linear(xe, we) for xe, we in zip(x_sorted.split(counts.tolist()), w.unbind(0))])


def experts_forward_mxfp4(x: torch.Tensor, routing_indices: torch.Tensor, routing_weights: torch.Tensor,
                          gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor],
                          act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                          method: str = "auto") -> torch.Tensor:
    """`experts_forward` with each projection's weights MXFP4 (packed codes, E8M0 scales: `ops.triton_mxfp4`'s
    layout), dequantized inside two grouped W4A16 Triton GEMMs over the sorted rows (`method`: as
    `mxfp4_grouped_matmul_triton` takes them), the GLU between them: the weights are read at 4.25 bits each and never
    expanded in memory. Method "expand" instead expands all the experts' weights to x's dtype in one pass each
    (`expand_mxfp4`) and runs `experts_forward` on them, at the price of a transient copy of the layer's experts in
    that dtype (kimi-linear-48b: 3.4 GiB in bf16); "auto" takes it for prefill-sized batches (EXPAND_MIN_ROWS) where
    the bf16 grouped GEMM runs. Forward only; no host sync."""
    from openk3.ops.triton_mxfp4 import expand_mxfp4, mxfp4_grouped_matmul_triton  # (triton: optional)

    dtype = compute_dtype(x)
    if method == "expand" or (method == "auto" and expands(dtype, routing_indices, gate_up[0].shape[0])):
        return experts_forward(x, routing_indices, routing_weights, expand_mxfp4(*gate_up, dtype),
                               expand_mxfp4(*down, dtype), act)
    return sorted_glu(x, routing_indices, routing_weights, functools.partial(mxfp4_grouped_matmul_triton,
                      method=method), gate_up, down, act)


# Mean rows per expert from which MXFP4 experts are expanded to bf16 for the grouped GEMM (method "auto"):
# kimi-linear-48b's layer on an H200 (bench/RESULTS.md 2026-12-07, ninth session): 4096 tokens (128 rows an
# expert) 4.75 ms expanded against 5.33 with tl.dot_scaled, 16384 tokens 11.3 against 17.7; 256 tokens 3.09 against
# 1.19 with the W4A16 tiles. Where the Gluon tiles run (bf16 rows on Hopper, `ops.gluon_mxfp4`), from 512: on an
# H100 (twelfth session) 4096 tokens 3.74 ms in the Gluon tiles against 5.48 expanded, 16384 tokens 12.62 against
# 12.54
EXPAND_MIN_ROWS = 128
GLUON_EXPAND_MIN_ROWS = 512


def expands(dtype: torch.dtype, routing_indices: torch.Tensor, num_experts: int) -> bool:
    """Whether "auto" expands MXFP4 experts: at least EXPAND_MIN_ROWS rows an expert on average (GLUON_EXPAND_MIN_ROWS
    where the Gluon tiles run), computing in bf16 where the grouped GEMM runs (`grouped_mm_usable`'s conditions)."""
    from openk3.ops import gluon_mxfp4

    device = routing_indices.device
    if device.type != "cuda" or _grouped_mm_fn() is None or dtype != torch.bfloat16 or \
            torch.cuda.get_device_capability(device) < (9, 0):
        return False
    gluon = gluon_mxfp4.usable(dtype, device)
    return routing_indices.numel() >= (GLUON_EXPAND_MIN_ROWS if gluon else EXPAND_MIN_ROWS) * num_experts


# Weights a single token's experts may gather (`experts_forward_gathered`): the k experts read three times (the
# gather's read and write, the matmul's read) instead of once, against the sort, the group layout and the grouped
# GEMM's set-up for k rows. k3-debug (4 experts of 1.5 MiB) on an H200, CUDA graphs without compile: batch-1 decode
# 4.75 -> 3.68 ms per step (bench/RESULTS.md). Larger experts gather too when 3 k < E: the grouped GEMM gives every
# expert a group of at least 8 rows (`grouped_layout`), so it reads all E experts' weights (kimi-linear-48b, one
# token: 1.42 ms a layer on an H100, the read time of all 256 experts, bench/RESULTS.md 2026-12-07).
GATHER_MAX_BYTES = 16 << 20


def gathers(tokens: int, k: int, num_experts: int, expert_bytes: int, row_kernel: bool = False) -> bool:
    """Whether `experts_forward` (without autograd) gathers the experts' weights: one token, and its k experts small
    (GATHER_MAX_BYTES: fewer launches than the sorted paths), or, where the row kernel does not run (it reads them
    once), few against all E (3 k < E: three reads of k experts against the grouped GEMM's one of all E)."""
    return tokens == 1 and (k * expert_bytes <= GATHER_MAX_BYTES or (not row_kernel and 3 * k < num_experts))


# `experts_forward_dense`: when N tokens pick N * k >= E rows, at least 1 - 1/e of the experts are picked on average,
# so reading all E experts' weights costs at most ~1.6x the sorted path's reads, and saves its sort, group layout
# and grouped-GEMM set-up. Bounded to decode-sized batches (the FLOPs are E / k times the routed ones) and to an
# [E, N, 2I] intermediate of 32M elements.
DENSE_MAX_TOKENS = 64
DENSE_MAX_ELEMENTS = 1 << 25


def experts_forward_dense(x, routing_indices, routing_weights, gate_up, down, act) -> torch.Tensor:
    """`experts_forward` with every expert applied to every token (two batched matmuls over the E experts), then
    each token's k picked outputs gathered and combined in fp32: no sort and no group layout."""
    N, k = routing_indices.shape
    dtype = compute_dtype(x)
    h = torch.matmul(x.to(dtype), gate_up.to(dtype).transpose(-2, -1))  # [E, N, 2I], the packed [gate | up]
    y = torch.matmul(apply_glu(act, h), down.to(dtype).transpose(-2, -1))  # [E, N, Dout]
    picked = y[routing_indices, torch.arange(N, device=x.device).unsqueeze(-1)]  # [N, k, Dout]
    return weighted_sum(picked, routing_weights, x.dtype)


def experts_forward_gathered(x, routing_indices, routing_weights, gate_up, down, act) -> torch.Tensor:
    """`experts_forward` as two batched matmuls over the (token, slot) rows, each with its own expert's weights
    gathered: no sort, no group layout, a handful of kernels. For a few rows only: the weights are copied per
    row."""
    N, k = routing_indices.shape
    dtype = compute_dtype(x)
    flat = routing_indices.reshape(-1)
    rows = x.to(dtype).repeat_interleave(k, dim=0).unsqueeze(-1)  # [N*k, Din, 1]: row n*k + j is token n
    h = torch.bmm(gate_up[flat].to(dtype), rows).squeeze(-1)  # [N*k, 2I], the packed [gate | up]
    y = torch.bmm(down[flat].to(dtype), apply_glu(act, h).unsqueeze(-1)).squeeze(-1)  # [N*k, Dout]
    return weighted_sum(y.view(N, k, -1), routing_weights, x.dtype)


def combine_rows(y_sorted: torch.Tensor, w_sorted: torch.Tensor, token_of: torch.Tensor, num_tokens: int,
                 acc: torch.dtype) -> torch.Tensor:
    """out [num_tokens, D] in `acc`: out[token_of[r]] += w_sorted[r] * y_sorted[r] (y_sorted [M, D], w_sorted
    [M, 1]), the products and sums in `acc`. Backward keeps y_sorted in its own dtype (the experts' bf16 output
    under autocast) where autograd would keep its `acc` copy and the products (3x the bytes in fp32). While
    torch.compile traces, the reference (Inductor's partitioner chooses what backward keeps): Dynamo's trace of
    the autograd.Function gave no gradient past it on CUDA, torch 2.11 (bench/decode_profile_runs/101-*)."""
    if torch.compiler.is_compiling():
        return combine_rows_reference(y_sorted, w_sorted, token_of, num_tokens, acc)
    return _CombineRows.apply(y_sorted, w_sorted, token_of, num_tokens, acc)


def combine_rows_reference(y_sorted, w_sorted, token_of, num_tokens, acc) -> torch.Tensor:
    """`combine_rows` in autograd's hands (the reference: the same values and gradients, to the bit)."""
    out = torch.zeros(num_tokens, y_sorted.shape[1], dtype=acc, device=y_sorted.device)
    return out.index_add_(0, token_of, y_sorted.to(acc) * w_sorted.to(acc))


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_sorted, w_sorted, token_of, num_tokens, acc):
        ctx.save_for_backward(y_sorted, w_sorted, token_of)
        return combine_rows_reference(y_sorted, w_sorted, token_of, num_tokens, acc)

    @staticmethod
    def backward(ctx, grad):
        # the ops autograd runs for the reference: index_add's source gradient is grad's rows at token_of, then
        # the product's (w broadcast over D: summed back over D), then the casts back to the inputs' dtypes
        y_sorted, w_sorted, token_of = ctx.saved_tensors
        rows = grad.index_select(0, token_of)
        dy = (rows * w_sorted.to(grad.dtype)).to(y_sorted.dtype) if ctx.needs_input_grad[0] else None
        dw = (rows * y_sorted.to(grad.dtype)).sum(-1, keepdim=True).to(w_sorted.dtype) \
            if ctx.needs_input_grad[1] else None
        return dy, dw, None, None, None
