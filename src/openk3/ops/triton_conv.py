"""The short conv + SiLU of the KDA layer (SPEC-K3 §2) in Triton, one pass forward and two backward on x [B, T, C]
as it is laid out (channels contiguous), fp32 math on operands rounded to the compute dtype:

    full = [state | x] along time (state [B, C, W-1], zeros when None),   full[p] = x[p - (W-1)] for p >= W-1
    pre[t] = sum_{i<W} w[c, i] full[t + i]                               rounded to the compute dtype
    y[t] = silu(pre[t])
    g[t] = dy[t] silu'(pre[t]),   silu'(p) = sigmoid(p) (1 + p (1 - sigmoid(p)))
    d_full[u] = sum_{i<W} w[c, i] g[u - i]       dx[t] = d_full[t + W-1],   dstate[j] = d_full[j] for j < W-1
    dw[c, i] = sum_{b, t} g[t] full[t + i]

Forward: one program per [BLOCK_T, BLOCK_C] tile; each of the W taps is a shifted load of the tile (the shifts
overlap, so they come from cache), nothing but x, w and the state is read and y written. With `groups` (the KDA
layer's q|k|v) y is written as that many tensors of C / groups channels each, and their gradients are read from
where they are: no copy to or from the channel slices either way. Backward recomputes pre
(the Function keeps only x, w and the state, as `ops.conv._ConvSiLU`) in two passes, each W shifted loads per
element: the first, a program per run of time steps, recomputes pre, writes g to a [B, T, C] buffer in the compute
dtype (the rounding autograd's SiLU backward applies in `_ConvSiLU`) and sums dw from the fp32 g and the same taps
in registers, one partial per program, summed after (as `ops.triton_norm` does). The second, a program per tile,
reads g at W shifted positions for dx and, in the first tile of a sequence, for dstate. The references are
`ops.conv.causal_conv1d_reference` and `_ConvSiLU`.

Packed documents (`starts` [B, T], each token's document start; no state): tap i of output t reads x[t - (W-1) + i]
only from starts[t] on, zero before (`ops.conv`'s document reset), in the forward, in pass 1's taps (so pre, g and
dw) and in pass 2, where d_full[u] takes g[u - i] only for the outputs whose tap i is live.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# forward: [16, 256] tiles at 4 warps. At k3-debug's shape on an H200 (x [8, 4096, 3072] bf16, W = 4) 0.18-0.21 ms
# without a state and 0.44 ms with a bf16 one (0.57 while its strides were specialised and every tile issued its
# masked loads), against 0.25-0.28 / 0.61 ms for [64, 128] and 0.20-0.23 / 0.38 ms for [32, 128], the same bits
# (`python bench/conv_bwd.py --sweep`; bench/RESULTS.md, 2026-12-01)
BLOCK_T = 16  # forward: time steps per tile (at most)
BLOCK_C = 256  # forward: channels per tile (at most)
FWD_WARPS = 4
# backward pass 1 (g and dw): [BWD_G_ROWS time steps, BWD_G_BLOCK_C channels] per program, [BWD_G_BLOCK_T,
# BWD_G_BLOCK_C] tiles at BWD_G_WARPS warps. On an H200 at k3-debug's shape (x [8, 4096, 3072] bf16, W = 4) both
# passes took 0.545 ms without a state and 1.91 ms with a bf16 one, against 0.78 / 2.37 ms for the per-tile dw of
# before (4 warps over [64, 64] tiles, the taps loaded twice); [8, 128] tiles were as fast without a state (0.528)
# but 7.8 ms with one, [4, 256] 0.75 / 8.6 ms (`python bench/conv_bwd.py --sweep`; bench/RESULTS.md, 2026-12-01)
BWD_G_BLOCK_T = 8
BWD_G_BLOCK_C = 64
BWD_G_ROWS = 256
BWD_G_WARPS = 1
# backward pass 2 (dx): [64, 64] tiles at 4 warps, within 4% of the best of the sweep's others with the pass 1 above
# (0.516-0.552 ms for both passes without a state), the same dx to the bit
BWD_BLOCK_T = 64
BWD_BLOCK_C = 64
BWD_WARPS = 4


@triton.jit
def _load_full(x_ptr, s_ptr, w_ptr, b, pos, p0, c, T, C, s_sb, s_sc, s_sj, W: tl.constexpr,
               HAS_STATE: tl.constexpr, lo):
    """full[b, pos, c] for positions `pos` (the least p0) and channels `c` broadcast against each other (e.g. pos
    [R, 1] and c [1, BC]), rounded to the compute dtype (w's), in fp32; zero outside [0, W-1+T), past C and before
    x's time index `lo` (a document start, broadcast like pos)."""
    mc = c < C
    src = pos - (W - 1)  # x's time index
    x = tl.load(x_ptr + b * T * C + src.to(tl.int64) * C + c, mask=(src >= lo) & (src >= 0) & (src < T) & mc,
                other=0.0)
    v = x.to(w_ptr.dtype.element_ty).to(tl.float32)
    if HAS_STATE:
        if p0 < W - 1:  # only a sequence's first tile reaches the state (masked loads elsewhere still cost issue slots)
            s = tl.load(s_ptr + b * s_sb + c.to(tl.int64) * s_sc + pos * s_sj,
                        mask=(pos >= 0) & (pos < W - 1) & mc, other=0.0)
            v += s.to(w_ptr.dtype.element_ty).to(tl.float32)
    return v


@triton.jit
def _doc_starts(st_ptr, b, t, T, HAS_DOCS: tl.constexpr):
    """The document start of each time index t (0 without documents; t outside [0, T) reads 0)."""
    if HAS_DOCS:
        return tl.load(st_ptr + b * T + t, mask=(t >= 0) & (t < T), other=0)
    return tl.zeros(t.shape, dtype=tl.int32)


@triton.jit
def _pre(x_ptr, s_ptr, w_ptr, b, pos, p0, c, T, C, s_sb, s_sc, s_sj, W: tl.constexpr, HAS_STATE: tl.constexpr,
         lo):
    """pre[b, pos, c] = sum_i w[c, i] full[pos + i] (p0: the least of pos; full read from x's index lo[pos] on), fp32
    sums rounded to the compute dtype (the conv's output)."""
    acc = tl.zeros([pos.shape[0], c.shape[0]], dtype=tl.float32)
    for i in tl.static_range(W):
        w_i = tl.load(w_ptr + c * W + i, mask=c < C, other=0.0).to(tl.float32)
        acc += w_i[None, :] * _load_full(x_ptr, s_ptr, w_ptr, b, (pos + i)[:, None], p0 + i, c[None, :], T,
                                         C, s_sb, s_sc, s_sj, W, HAS_STATE, lo[:, None])
    return acc.to(w_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _grouped(p0, p1, p2, b, t, c, c0, T, C, G, GROUPS: tl.constexpr):
    """Addresses of [b, t, c] (t [R, 1], c [1, BC] from the tile's first channel c0) in the outputs of `GROUPS` (1
    or 3) equal channel groups of G channels: p0 [B, T, C], or p0 / p1 / p2 [B, T, G] for channels [0, G),
    [G, 2G), [2G, C). A tile lies in one group (its width divides G: `_group_tile`), so the group is chosen once
    per tile and the addresses stay contiguous along the channels (chosen per element, they cost the accesses
    their width, several times the forward's time); G is an argument, not C / 3 computed here, so the compiler
    knows its divisibility, and so each row's alignment, which 16-byte accesses need."""
    if GROUPS == 1:
        return p0 + b * T * C + t.to(tl.int64) * C + c
    g = c0 // G
    base = tl.where(g == 0, p0, tl.where(g == 1, p1, p2))
    return base + b * T * G + t.to(tl.int64) * G + (c - g * G)


# The state's strides are not specialised: as constants (the last one is 1) they make the state's loads contiguous
# along time, and the compiler added layout conversions for them to every tile (an sm_90 compile of pass 1: 9
# barriers and 2 KB of shared memory against 5 and 1 KB)
@triton.jit(do_not_specialize=["T", "s_sb", "s_sc", "s_sj"])  # T: one compile for every prompt length (serving)
def _conv_fwd_kernel(x_ptr, s_ptr, w_ptr, st_ptr, y_ptr, y1_ptr, y2_ptr, T, C, G, s_sb, s_sc, s_sj,
                     W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_DOCS: tl.constexpr, GROUPS: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    lo = _doc_starts(st_ptr, b, t, T, HAS_DOCS)
    pre = _pre(x_ptr, s_ptr, w_ptr, b, t, tl.program_id(0) * BLOCK_T, c, T, C, s_sb, s_sc, s_sj, W, HAS_STATE, lo)
    y = pre * tl.sigmoid(pre)
    tl.store(_grouped(y_ptr, y1_ptr, y2_ptr, b, t[:, None], c[None, :], tl.program_id(1) * BLOCK_C, T, C, G,
                      GROUPS), y.to(y_ptr.dtype.element_ty), mask=(t < T)[:, None] & (c < C)[None, :])


@triton.jit(do_not_specialize=["s_sb", "s_sc", "s_sj"])
def _conv_bwd_g_kernel(x_ptr, s_ptr, w_ptr, st_ptr, dy_ptr, dy1_ptr, dy2_ptr, g_ptr, dw_part_ptr, T, C, G, s_sb, s_sc,
                       s_sj, ROWS, W: tl.constexpr, WP: tl.constexpr, HAS_STATE: tl.constexpr,
                       HAS_DOCS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Backward pass 1, one program per ROWS time steps of a sequence and BLOCK_C channels, [BLOCK_T, BLOCK_C] tiles
    at a time: g (stored in g's dtype) and the program's share of dw, dw_part[b, split, c, i] = sum_t g[t] full[t + i]
    from the fp32 g. Each tile's taps are one [BLOCK_T, WP, BLOCK_C] load (WP = W rounded up to a power of 2) that
    gives both pre (over the taps) and the dw terms (sums over time): with the warps side by side over the channels,
    both stay in a thread's registers, and dw is stored once per program."""
    split = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    mc = c < C
    i = tl.arange(0, WP)
    live = (i < W)[:, None] & mc[None, :]
    dw = tl.zeros([WP, BLOCK_C], dtype=tl.float32)
    for t0 in range(split * ROWS, tl.minimum(split * ROWS + ROWS, T), BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        lo = _doc_starts(st_ptr, b, t, T, HAS_DOCS)
        taps = _load_full(x_ptr, s_ptr, w_ptr, b, (t[:, None] + i[None, :])[:, :, None], t0, c[None, None, :], T, C,
                          s_sb, s_sc, s_sj, W, HAS_STATE, lo[:, None, None])  # [BLOCK_T, WP, BLOCK_C]: full[t + i]
        pre = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(W):  # tap by tap in `_pre`'s order: the forward's pre to the bit
            w_j = tl.load(w_ptr + c * W + j, mask=mc, other=0.0).to(tl.float32)
            pre += w_j[None, :] * tl.sum(tl.where(i[None, :, None] == j, taps, 0.0), axis=1)
        pre = pre.to(w_ptr.dtype.element_ty).to(tl.float32)
        valid = (t < T)[:, None] & mc[None, :]
        offs = b * T * C + t.to(tl.int64)[:, None] * C + c[None, :]
        dy = tl.load(_grouped(dy_ptr, dy1_ptr, dy2_ptr, b, t[:, None], c[None, :], tl.program_id(1) * BLOCK_C, T, C,
                              G, GROUPS), mask=valid, other=0.0).to(w_ptr.dtype.element_ty).to(tl.float32)
        sig = tl.sigmoid(pre)
        g = tl.where(valid, dy * sig * (1.0 + pre * (1.0 - sig)), 0.0)
        tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=valid)
        dw += tl.sum(g[:, None, :] * taps, axis=0)
    part = dw_part_ptr + (b * tl.num_programs(0) + split) * C * W
    tl.store(part + c[None, :] * W + i[:, None], dw, mask=live)


@triton.jit
def _d_full(g_ptr, w_ptr, st_ptr, b, pos, c, T, C, W: tl.constexpr, HAS_DOCS: tl.constexpr):
    """d_full[b, pos, c] = sum_i w[c, i] g[pos - i] for a [R] tile of positions of [state | x], g zero outside
    [0, T) and where output pos - i's tap i lies before its document start, fp32."""
    mc = c < C
    acc = tl.zeros([pos.shape[0], c.shape[0]], dtype=tl.float32)
    for i in tl.static_range(W):
        src = pos - i  # g's time index
        live = (src >= 0) & (src < T)
        if HAS_DOCS:  # x's index pos - (W-1), read by output src's tap i, lies in that output's document
            live = live & (pos - (W - 1) >= _doc_starts(st_ptr, b, src, T, HAS_DOCS))
        g = tl.load(g_ptr + b * T * C + src.to(tl.int64)[:, None] * C + c[None, :],
                    mask=live[:, None] & mc[None, :], other=0.0)
        acc += tl.load(w_ptr + c * W + i, mask=mc, other=0.0).to(tl.float32)[None, :] * g.to(tl.float32)
    return acc


@triton.jit
def _conv_bwd_dx_kernel(g_ptr, w_ptr, st_ptr, dx_ptr, ds_ptr, T, C, W: tl.constexpr, HAS_STATE: tl.constexpr,
                        HAS_DOCS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """Backward pass 2, one program per [BLOCK_T, BLOCK_C] tile of dx = d_full[t + W-1]; the first tile of each
    sequence also writes dstate = d_full[:W-1] ([BLOCK_S] positions) when there is a state."""
    pid_t = tl.program_id(0)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    mc = c < C
    dx = _d_full(g_ptr, w_ptr, st_ptr, b, t + (W - 1), c, T, C, W, HAS_DOCS)
    tl.store(dx_ptr + b * T * C + t.to(tl.int64)[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & mc[None, :])
    if HAS_STATE:
        if pid_t == 0:
            j = tl.arange(0, BLOCK_S)
            ds = _d_full(g_ptr, w_ptr, st_ptr, b, j, c, T, C, W, HAS_DOCS)
            tl.store(ds_ptr + b * C * (W - 1) + c.to(tl.int64)[None, :] * (W - 1) + j[:, None],
                     ds.to(ds_ptr.dtype.element_ty), mask=(j < W - 1)[:, None] & mc[None, :])


def _tiles(T: int, C: int, block_t: int, block_c: int, groups: int = 1) -> dict:
    return dict(BLOCK_T=min(block_t, triton.next_power_of_2(max(T, 1))),
                BLOCK_C=_group_tile(min(block_c, triton.next_power_of_2(max(C, 1))), C, groups))


def _group_tile(block_c: int, C: int, groups: int) -> int:
    """The channel tile for `groups` output groups: a power of 2 that divides C / groups (for groups > 1), so no
    tile straddles two groups (`_grouped`)."""
    return block_c if groups == 1 else math.gcd(block_c, C // groups)


def _state_args(state: torch.Tensor | None) -> tuple:
    """(pointer, strides, HAS_STATE): a state with no columns (W = 1) counts as none."""
    if state is None or state.shape[-1] == 0:
        return None, (0, 0, 0), False
    return state, state.stride(), True


def _forward(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor | None, dtype: torch.dtype,
             tile: tuple[int, int, int] | None = None, groups: int = 1,
             starts: torch.Tensor | None = None) -> list[torch.Tensor]:
    """silu(conv([state | x])) [B, T, C] in `dtype` for contiguous x [B, T, C] and w [C, W] in `dtype`, as `groups`
    (1 or 3) contiguous tensors [B, T, C / groups] of consecutive channels; `tile`: (block_t, block_c, warps),
    default the module's (bench/conv_bwd.py --sweep tries others)."""
    B, T, C = x.shape
    ys = [torch.empty(B, T, C // groups, dtype=dtype, device=x.device) for _ in range(groups)]
    y = ys[0]
    s, strides, has_state = _state_args(state)
    block_t, block_c, warps = tile or (BLOCK_T, BLOCK_C, FWD_WARPS)
    # one tile height for every T (not fitted to short inputs): a prompt of any length reuses one compiled kernel
    kw = _tiles(block_t, C, block_t, block_c, groups)
    if y.numel():
        grid = (triton.cdiv(T, kw["BLOCK_T"]), triton.cdiv(C, kw["BLOCK_C"]), B)
        _conv_fwd_kernel[grid](x, s if has_state else x, w, x if starts is None else starts, *_three(ys), T, C,
                               C // groups, *strides, W=w.shape[-1], HAS_STATE=has_state,
                               HAS_DOCS=starts is not None, GROUPS=groups, num_warps=warps, **kw)
    return ys


def _three(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The kernels' three group pointers: the groups' tensors, the first repeated when there is one group."""
    return ts if len(ts) == 3 else [ts[0]] * 3


def _backward(x, w, state, dy, tile: tuple[int, int, int] | None = None,
              g_tile: tuple[int, int, int, int] | None = None, starts: torch.Tensor | None = None):
    """(dx in x's dtype, d of the kernel [C, W] in fp32, dstate in the state's dtype or None) for contiguous x, w
    [C, W] in the compute dtype and dy, the output's gradient as contiguous tensors (one [B, T, C], or one per
    channel group as `_forward` wrote them); `tile`: (block_t, block_c, warps) of pass 2, `g_tile`: (block_t,
    block_c, rows, warps) of pass 1, default the module's (bench/conv_bwd.py --sweep tries others)."""
    B, T, C = x.shape
    W = w.shape[-1]
    if not x.numel():
        return torch.zeros_like(x), torch.zeros(C, W, device=x.device), None if state is None else \
            torch.zeros_like(state)
    s, strides, has_state = _state_args(state)
    g_block_t, g_block_c, rows, g_warps = g_tile or (BWD_G_BLOCK_T, BWD_G_BLOCK_C, BWD_G_ROWS, BWD_G_WARPS)
    gkw = _tiles(T, C, g_block_t, g_block_c, len(dy))
    rows = triton.cdiv(min(rows, T), gkw["BLOCK_T"]) * gkw["BLOCK_T"]
    g_grid = (triton.cdiv(T, rows), triton.cdiv(C, gkw["BLOCK_C"]), B)
    g = torch.empty(x.shape, dtype=w.dtype, device=x.device)  # in the compute dtype, as autograd's SiLU backward
    dw_part = torch.empty(B * g_grid[0], C, W, dtype=torch.float32, device=x.device)
    st = x if starts is None else starts
    _conv_bwd_g_kernel[g_grid](x, s if has_state else x, w, st, *_three(dy), g, dw_part, T, C, C // len(dy),
                               *strides, rows, W=W, WP=triton.next_power_of_2(W), HAS_STATE=has_state,
                               HAS_DOCS=starts is not None, GROUPS=len(dy), num_warps=g_warps, **gkw)
    block_t, block_c, warps = tile or (BWD_BLOCK_T, BWD_BLOCK_C, BWD_WARPS)
    kw = _tiles(T, C, block_t, block_c)
    grid = (triton.cdiv(T, kw["BLOCK_T"]), triton.cdiv(C, kw["BLOCK_C"]), B)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dstate = torch.empty(state.shape, dtype=state.dtype, device=x.device) if state is not None else None
    _conv_bwd_dx_kernel[grid](g, w, st, dx, dstate if has_state else dx, T, C, W=W, HAS_STATE=has_state,
                              HAS_DOCS=starts is not None, BLOCK_S=triton.next_power_of_2(max(W - 1, 1)),
                              num_warps=warps, **kw)
    return dx, dw_part.sum(0), dstate


class _ConvSiLUTriton(torch.autograd.Function):
    """Keeps x, w and the state as given (as `ops.conv._ConvSiLU`); backward recomputes pre. Returns the `groups`
    outputs (`_forward`) as they are when x's dtype is the compute dtype."""

    @staticmethod
    def forward(ctx, x, w, state, dtype, groups, starts):
        ctx.dtype = dtype
        ctx.save_for_backward(x, w, state, starts)
        ys = _forward(x.contiguous(), w.to(dtype).contiguous(), state, dtype, groups=groups, starts=starts)
        return tuple(y.to(x.dtype) for y in ys)

    @staticmethod
    def backward(ctx, *dys):  # (an output the loss does not use has a zero gradient here, autograd's default)
        x, w, state, starts = ctx.saved_tensors
        dx, dw, dstate = _backward(x.contiguous(), w.to(ctx.dtype).contiguous(), state, [dy.contiguous() for dy in dys],
                                   starts=starts)
        need_x, need_w, need_state = ctx.needs_input_grad[:3]
        return (dx if need_x else None, dw.to(w.dtype) if need_w else None,
                dstate if need_state and dstate is not None else None, None, None, None)


def conv_silu_triton(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor | None = None,
                     dtype: torch.dtype | None = None, groups: int = 1,
                     starts: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """silu(depthwise causal conv) of x [B, T, C] with the kernel w [C, W] after `state` [B, C, W-1] (the W-1
    inputs before x, oldest first; zeros when None), computed in `dtype` (default w's) -> [B, T, C] in x's dtype;
    with groups=3, the three channel thirds as contiguous tensors [B, T, C/3] (the KDA layer's q, k, v); differentiable
    in x, w and the state. The new state is the caller's (`ops.conv.causal_conv1d`). `starts` [B, T]: each token's
    document start, the window resetting there (module docstring; no state then)."""
    if x.dim() != 3 or w.dim() != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"need x [B, T, C] and w [C, W], got x {tuple(x.shape)} and w {tuple(w.shape)}")
    B, _, C = x.shape
    if state is not None and state.shape != (B, C, w.shape[-1] - 1):
        raise ValueError(f"state must be [{B}, {C}, {w.shape[-1] - 1}], got {tuple(state.shape)}")
    if groups not in (1, 3) or C % groups:
        raise ValueError(f"groups must be 1 or 3 and divide the {C} channels, got {groups}")
    if starts is not None:
        if state is not None or starts.shape != x.shape[:2]:
            raise ValueError(f"starts must be [B, T] = {tuple(x.shape[:2])} and come without a state, got "
                             f"{tuple(starts.shape)}{' and a state' if state is not None else ''}")
        starts = starts.to(torch.int32).contiguous()
    ys = _ConvSiLUTriton.apply(x, w, state, w.dtype if dtype is None else dtype, groups, starts)
    return ys if groups > 1 else ys[0]
