"""KDA on the Triton kernels with a state exchange between its kernels: KCP's layer (openk3.parallel.kcp).

`kda_triton_exchange` runs `kda_triton` over one packed row of sequences whose first sequence may start from a
state another process produces and whose last may hand its state on; the caller's `StateExchange` does the
collectives. What it exchanges is what `ops.kda.transition` computes, but from the chunk terms the layer's own
kernels form anyway:

  forward   the prepare kernel; the last sequence's affine map (S_ext, M) by the state-only pass from [0 | I] over
            the prepare kernel's terms (cut into pieces, composed: transition.py); `exchange.forward` turns it into
            the first sequence's initial state; the ordinary state pass from there.
  backward  the first sequence's initial-state gradient with a zero final-state gradient, by the reverse pass from
            [0 | I] over the saved terms (in pieces); `exchange.backward` turns it into the last sequence's
            final-state gradient; the ordinary backward with it.

So the exchange runs no prepare kernel of its own, and a rank's own prepare kernel runs while it waits for the other
ranks' maps. Pieces consist of whole chunks of the layer's layout (their chunk-indexed terms are the layer's), so
`piece` must be a multiple of CHUNK tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from openk3.ops.kda.checks import check_kda_inputs, check_kda_options
from openk3.ops.kda.transition import compose_pieces, identity_start, piece_size
from openk3.ops.kda.triton.chunk_bwd import chunk_kda_bwd, reverse_pass
from openk3.ops.kda.triton.chunk_fwd import chunk_kda_fwd, gate_spec, state_block, state_pass
from openk3.ops.kda.triton.layout import CHUNK, ChunkLayout, chunk_layout


class StateExchange(Protocol):
    """The collectives around one call: every process calls `forward` once in the forward and `backward` once in
    the backward (when one is taken), in the same order."""

    head_continues: bool  # the row's first sequence started on an earlier process
    tail_continues: bool  # its last sequence goes on past this process

    def forward(self, tail_map: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
        """This process's (S_ext [H,K,V], M [H,K,K]) of its last sequence (None unless tail_continues) -> the
        initial state [H,K,V] of its first sequence (None unless head_continues)."""

    def backward(self, head_grad: torch.Tensor | None) -> torch.Tensor | None:
        """The gradient of this process's outputs w.r.t. its first sequence's initial state (None unless
        head_continues) -> the gradient of its last sequence's final state (None when it has none)."""


def _span_layout(bounds: list[int], start: int, end: int, piece: int, device) -> tuple[ChunkLayout, int]:
    """The layout of tokens [start, end) of the row (a sequence: start is a sequence start) cut into pieces of
    `piece` tokens, its chunks numbered as the row's layout numbers them; and the number of pieces."""
    cuts = list(range(start, end, piece)) + [end]
    lay = chunk_layout(1, end - start, torch.tensor(cuts), device)
    before = sum(-(-(b - a) // CHUNK) for a, b in zip(bounds, bounds[1:]) if b <= start)  # chunks ahead of `start`
    return dataclasses.replace(lay, chunk_offsets=lay.chunk_offsets + before), len(cuts) - 1


def last_sequence_map(terms, v, bounds: list[int], dtype, piece: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_ext, M) of the row's last sequence from the prepare kernel's terms (flat v [T,H,V]; `dtype`: q's, which
    set the terms' precision): each piece's state-only pass from [0 | I] (values [v | 0]), composed."""
    T, H, K = terms[0].shape
    V = v.shape[-1]
    start = bounds[-2]
    lay, n = _span_layout(bounds, start, T, piece_size([T - start], H, piece) or T - start, v.device)
    maps = state_pass(terms, v, dtype, identity_start(n, H, K, V, torch.float32, v.device), True, lay, False,
                      with_output=False)[1]
    M, S = compose_pieces(maps, [n], V, reverse=False)
    return S[0], M[0]


def first_sequence_state_grad(saved, do, bounds: list[int], dtype, piece: int | None) -> torch.Tensor:
    """The gradient of the outputs (flat dO [T,H,V]) w.r.t. the initial state of the row's first sequence, its
    final state taking none, from what the forward saved (`chunk_kda_fwd`): each piece's reverse pass from
    [0 | I] ([Y | M^T]), composed last first."""
    W, QG, KG, AQK, GC = saved[2:7]
    T, H, K = W.shape
    V = do.shape[-1]
    lay, n = _span_layout(bounds, 0, bounds[1], piece_size([bounds[1]], H, piece) or bounds[1], do.device)
    dht = identity_start(n, H, K, V, torch.float32, do.device)
    maps = reverse_pass((W, None, QG, KG, AQK, GC), do, dht, True, lay, state_block(n, H, V + K), dtype,
                        store=False)[2]
    return compose_pieces(maps, [n], V, reverse=True)[1][0]


class _ExchangeKDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, bounds, gate_min, exchange, piece):
        T, H, K = q.shape[1:]
        V = v.shape[-1]
        flat = [x.reshape(T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
        lay = chunk_layout(1, T, torch.tensor(bounds), q.device)
        gate = gate_spec(gate_min)

        def initial_state(terms):
            tail = last_sequence_map(terms, flat[2], bounds, q.dtype, piece) if exchange.tail_continues else None
            S0 = exchange.forward(tail)
            if S0 is None:
                return None
            h0 = S0.new_zeros(len(bounds) - 1, H, K, V)
            h0[0] = S0
            return h0

        o, _, saved, _ = chunk_kda_fwd(*flat, scale, initial_state, False, lay, True, gate)
        ctx.save_for_backward(*flat, *saved)
        ctx.lay, ctx.scale, ctx.gate, ctx.bounds, ctx.exchange, ctx.piece = lay, scale, gate, bounds, exchange, piece
        return o.reshape(1, T, H, V)

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, *saved = ctx.saved_tensors
        T, H, V = v.shape
        do = do.reshape(T, H, V).to(v.dtype).contiguous()
        exchange = ctx.exchange
        head = None
        if exchange.head_continues:
            head = first_sequence_state_grad(saved, do, ctx.bounds, q.dtype, ctx.piece)
        terminal = exchange.backward(head)
        dht = None
        if terminal is not None:
            dht = terminal.new_zeros(len(ctx.bounds) - 1, H, q.shape[-1], V)
            dht[-1] = terminal
        dq, dk, dv, dg, dbeta, _ = chunk_kda_bwd(q, k, v, g, beta, ctx.scale, saved, do, dht, False, ctx.lay,
                                                 ctx.gate)
        grads = [x.reshape(1, T, H, -1) for x in (dq, dk, dv, dg)]
        return (*grads, dbeta.reshape(1, T, H), *[None] * 5)


@torch.compiler.disable
def kda_triton_exchange(q, k, v, g, beta, cu_seqlens: list[int], exchange: StateExchange, *,
                        scale: float | None = None, gate_min: float | None = None,
                        piece: int | None = None) -> torch.Tensor:
    """`kda_triton` over one packed row q, k, g [1,T,H,K], v [1,T,H,V], beta [1,T,H] (activated) with sequences at
    `cu_seqlens` (host ints), the first sequence's initial state and the last one's final-state gradient coming
    from `exchange` (module docstring); the other sequences start from zero and hand nothing on. Returns o in v's
    dtype. `piece`: tokens per piece of the exchange's passes, a multiple of CHUNK (default `piece_tokens`)."""
    cu = torch.tensor(cu_seqlens)
    check_kda_inputs(q, k, v, g, beta, None, cu)
    check_kda_options(gate_min, None, q.shape[1], cu)
    if piece is not None and (piece < CHUNK or piece % CHUNK):
        raise ValueError(f"piece must be a positive multiple of {CHUNK} tokens (whole chunks), got {piece}")
    out_dtype = v.dtype
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):  # fp64 computes in fp32, as kda_triton
        q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _ExchangeKDA.apply(q, k, v, g, beta, scale, list(cu_seqlens), gate_min, exchange, piece).to(out_dtype)
