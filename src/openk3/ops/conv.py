"""Depthwise causal (short) convolution with a carried state, SiLU after (SPEC-K3 §2).

weight [C, W] (one kernel of width W per channel; an nn.Conv1d-style [C, 1, W] weight is accepted too).
y_t[c] = silu( sum_{w=0}^{W-1} weight[c, w] * x_{t-W+1+w}[c] ), with x_{<0} taken from `state` (zeros if None).
state [B, C, W-1]: the last W-1 inputs (pre-conv, oldest first). Both forms return the new state so decoding
carries it; the full form over T tokens equals T single steps.

Packed documents (`openk3.model.documents`): `starts` [B,T] gives the row index where token t's document begins;
the window then resets there, y_t reading x_s only for s >= starts[t] (zeros before, as at a sequence start):
    y_t[c] = silu( sum_{d=0}^{W-1} weight[c, W-1-d] * x_{t-d}[c] * [t - d >= starts[t]] )
so a packed row gives each document what a call on that document alone gives. No state is taken then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.fused import use_triton
from openk3.ops.norms import compute_dtype


def _kernel(weight: torch.Tensor) -> torch.Tensor:
    return weight.reshape(weight.shape[0], weight.shape[-1])


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None, activation: bool = True,
    groups: int = 1, starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
    """Full-sequence form. x [B,T,C] -> (y [B,T,C], new state [B,C,W-1]); with groups = 3, y as its three channel
    thirds [B,T,C/3] (the KDA layer's q, k, v: on CUDA contiguous tensors of their own, so that neither they nor
    their gradients are copied out of or into one [B,T,C] tensor; elsewhere views). With the SiLU, one autograd
    Function that keeps x (not the conv's input copy and output, as autograd would) and recomputes the conv in
    backward: on CUDA tensors (`ops.fused.use_triton`) the Triton kernels of `ops.triton_conv`, elsewhere
    `_ConvSiLU`; `causal_conv1d_reference` is the plain composition it must equal. While torch.compile traces,
    CUDA tensors still take the Triton kernels (the compiled graph breaks around them: Inductor's own depthwise
    conv was slower per KDA layer, docs/kernels.md) and others the reference.
    `starts` [B,T] (int64, x's device): each token's document start, the window resetting there (module docstring;
    no state then)."""
    _check_starts(x, state, starts)
    if not activation or (torch.compiler.is_compiling() and not use_triton(x, compiled=True)):
        y, new_state = causal_conv1d_reference(x, weight, state, activation, starts)
    else:
        y, new_state = _conv_silu_with_state(x, weight, state, groups, starts)
    if groups > 1 and torch.is_tensor(y):
        y = y.split(x.shape[-1] // groups, dim=-1)
    return y, new_state


def _check_starts(x: torch.Tensor, state: torch.Tensor | None, starts: torch.Tensor | None) -> None:
    if starts is None:
        return
    if state is not None:
        raise ValueError("causal_conv1d takes a state or document starts, not both (packed documents start fresh)")
    if tuple(starts.shape) != tuple(x.shape[:2]):
        raise ValueError(f"starts must be [B,T] = {tuple(x.shape[:2])}, got {tuple(starts.shape)}")


def _final_state(x: torch.Tensor, past: torch.Tensor, W: int, starts: torch.Tensor | None) -> torch.Tensor:
    """The last W-1 inputs [B,C,W-1] after x (oldest first): of the last document only when `starts` is given."""
    T = x.shape[1]
    tail = torch.cat([past.to(x.dtype), x[:, max(T - (W - 1), 0):].transpose(1, 2)], dim=-1)
    tail = tail[..., tail.shape[-1] - (W - 1):]  # positions T-(W-1) .. T-1 of x
    if starts is None:
        return tail
    position = torch.arange(T - (W - 1), T, device=x.device)
    return tail * (position >= starts[:, -1:]).unsqueeze(1).to(x.dtype)


@torch.compiler.disable
def _conv_silu_with_state(x, weight, state, groups: int = 1, starts=None):
    w = _kernel(weight)
    B, T, C = x.shape
    W = w.shape[-1]
    past = x.new_zeros(B, C, W - 1) if state is None else state
    if use_triton(x) and groups in (1, 3):
        from openk3.ops.triton_conv import conv_silu_triton  # triton is an optional dependency

        y = conv_silu_triton(x, w, state, compute_dtype(x, w.dtype), groups, starts)  # state None: none is read
    else:
        y = _ConvSiLU.apply(x, w, past, compute_dtype(x, w.dtype), starts)
    return y, _final_state(x, past, W, starts)


def _conv_silu(x, w, state, dtype, starts=None):
    """silu(conv([state | x])) with both operands in `dtype`, autocast off: [B,T,C] in `dtype`; with `starts`, the
    window reset at each document start (module docstring; the state is zeros then)."""
    if starts is not None:
        return F.silu(_document_conv(x.to(dtype), w.to(dtype), starts))
    full = torch.cat([state.to(dtype), x.transpose(1, 2).to(dtype)], dim=-1)  # [B,C,W-1+T]
    return F.silu(F.conv1d(full, w.to(dtype).unsqueeze(1), groups=w.shape[0])).transpose(1, 2)


def _document_conv(x: torch.Tensor, w: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """sum_d w[:, W-1-d] x_{t-d} [t - d >= starts[t]] for x [B,T,C], w [C,W]: W shifted, masked products."""
    T, W = x.shape[1], w.shape[-1]
    t = torch.arange(T, device=x.device)
    y = x * w[:, W - 1]
    for d in range(1, W):
        keep = (t - d >= starts).unsqueeze(-1)  # [B,T,1]
        y = y + torch.where(keep, F.pad(x, (0, 0, d, 0))[:, :T], 0) * w[:, W - 1 - d]
    return y


class _ConvSiLU(torch.autograd.Function):
    """Forward: the conv + SiLU, keeping only its inputs. Backward: the same ops again under autograd, so the
    gradients are those of the plain composition (SPEC-K3 §2's short conv)."""

    @staticmethod
    def forward(ctx, x, w, state, dtype, starts=None):
        ctx.dtype = dtype
        ctx.save_for_backward(x, w, state, starts)
        with torch.autocast(x.device.type, enabled=False):
            return _conv_silu(x, w, state, dtype, starts).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w, state, starts = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip((x, w, state), ctx.needs_input_grad)]
        with torch.enable_grad(), torch.autocast(x.device.type, enabled=False):
            y = _conv_silu(*inputs, ctx.dtype, starts)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(y, wanted, dy.to(y.dtype))) if wanted else iter(())
        return *(next(grads) if t.requires_grad else None for t in inputs), None, None


def conv_windows(state: torch.Tensor, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The conv state after ends[b] of the T inputs of row b: state [B,C,W-1] before them, x [B,T,C] -> the last W-1
    inputs up to that point [B,C,W-1] (the state itself where ends[b] = 0). Window position j holds position
    ends[b] + j of the history [state | x^T], gathered from where it lies: the history itself is never formed (a
    prefill's x is [B, T, 3 H K]; transposing all of it cost ~1 ms a KDA layer at 8k tokens)."""
    B, C, window = state.shape
    if x.shape[1] == 0:  # (then every end is 0)
        return state.clone()
    pos = ends.view(B, 1).long() + torch.arange(window, device=x.device)  # [B, W-1]: history positions
    rows = torch.arange(B, device=x.device).view(B, 1)
    from_x = x[rows, (pos - window).clamp_min(0)]  # [B, W-1, C]
    from_state = state[rows, :, pos.clamp_max(window - 1)]  # [B, W-1, C] (advanced indices first)
    return torch.where((pos < window).unsqueeze(-1), from_state, from_x.to(state.dtype)).transpose(1, 2).contiguous()


def conv_window_after(state: torch.Tensor, x: torch.Tensor, end: int) -> torch.Tensor:
    """`conv_windows` with one end for every row, a host integer 0 <= end <= T: state [B,C,W-1], x [B,T,C] ->
    [B,C,W-1] from slices (no index tensors, nothing read back)."""
    window = state.shape[-1]
    recent = x[:, max(end - window, 0):end].transpose(1, 2).to(state.dtype)
    return torch.cat([state[..., min(end, window):], recent], dim=-1)


def causal_conv1d_reference(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None, activation: bool = True,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain composition (what autograd keeps: the conv's input copy and its output); with `starts`, the
    masked sum of shifted inputs (module docstring)."""
    B, T, C = x.shape
    w = _kernel(weight)
    W = w.shape[-1]
    _check_starts(x, state, starts)
    if starts is not None:
        y = _document_conv(x.to(w.dtype), w, starts)
        y = F.silu(y) if activation else y
        return y.to(x.dtype), _final_state(x, x.new_zeros(B, C, W - 1), W, starts)
    xt = x.transpose(1, 2).to(w.dtype)  # [B,C,T]
    if state is None:
        state = xt.new_zeros(B, C, W - 1)
    full = torch.cat([state.to(w.dtype), xt], dim=-1)  # [B,C,W-1+T]
    y = F.conv1d(full, w.unsqueeze(1), groups=C)  # [B,C,T]
    if activation:
        y = F.silu(y)
    new_state = full[..., full.shape[-1] - (W - 1):]
    return y.transpose(1, 2).to(x.dtype), new_state.to(x.dtype)


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, activation: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-token form. x [B,C], state [B,C,W-1] -> (y [B,C], new state [B,C,W-1])."""
    w = _kernel(weight)
    window = torch.cat([state.to(w.dtype), x.to(w.dtype).unsqueeze(-1)], dim=-1)  # [B,C,W]
    y = (window * w).sum(-1)
    if activation:
        y = F.silu(y)
    return y.to(x.dtype), window[..., 1:].to(x.dtype)
