"""Chunked (WY / UT) form of Kimi Delta Attention in plain PyTorch (SPEC-K3 §2).

Per chunk of C tokens, with G the within-chunk cumulative log decay (per channel) and S_0 the incoming state:

    A   = StrictTril( Diag(beta) (Gamma ⊙ K)(K / Gamma)^T )      M = (I + A)^-1 Diag(beta)
    W   = M (Gamma ⊙ K),  U = M V                                  (pseudo-value: U - W S_0)
    O   = (Gamma ⊙ Q) S_0 + Tril( (Gamma ⊙ Q)(K / Gamma)^T ) (U - W S_0)
    S_C = Diag(gamma_C) S_0 + (K ⊙ gamma_C / Gamma)^T (U - W S_0)

The pair matrices carry Gamma_i / Gamma_j = exp(G_i - G_j), i > j, which overflows fp32 as one Gamma ⊙ K times
K / Gamma product once a chunk decays by more than ~e^-88 (Kimi Linear's unbounded gate does that in a few tokens).
So they are built from block-local anchors, as the Triton kernels' any-gate mode does (triton/chunk_fwd.py): at
level s (C/2, ..., 2, 1) the pairs with i in an odd block of s tokens and j in the block before it are
    (q_i or k_i) exp(sum of g over i's block up to i)  .  k_j exp(sum of g over j's block after j),
two matmul factors whose exponents are both <= 0 whatever the gates and add up to exactly G_i - G_j. The levels
cover every pair i > j once; the diagonal is q_i . k_i. Every exponent (these, G itself, G_C - G) is a sum of
gates over a span, computed as one matmul of g with a 0/1 span matrix: never a difference of two large cumsums,
so a gate of -400 followed by gates near 0 costs no precision (and g is clamped where exp underflows, which
changes nothing but lets g = -inf through).

Everything that does not depend on the state is computed for all chunks at once (autograd saves only
[chunk, C, K]-sized tensors); the state recurrence over chunks is `_StatePass`, whose backward is the reverse
recurrence written out. Sequences are zero-padded to a multiple of C: a token with k = v = q = g = beta = 0
leaves the state alone.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from openk3.ops.kda.reference import sequence_bounds

# default chunk: fwd+bwd at 2 x 1024 tokens, 4 heads of 64, one thread took 0.11 / 0.09 / 0.11 / 0.14 s at chunk
# 8 / 16 / 32 / 64 (bench/RESULTS.md, One training step on CPU)
CHUNK_SIZE = 16


def _underflow_floor(dtype: torch.dtype) -> float:
    """A log decay below which exp is 0 in `dtype` (5 under the log of its smallest subnormal): clamping g there
    changes no value and no gradient (exp of every span sum that holds such a gate is 0 either way), and keeps a
    gate of -inf from turning the span matmul's 0 * g into NaN."""
    info = torch.finfo(dtype)
    return math.log(info.smallest_normal * info.eps) - 5


def _levels(C: int) -> list[int]:
    """Block sizes of the anchor levels of a chunk of C tokens: C/2, ..., 2, 1."""
    return [C >> i for i in range(1, C.bit_length())]


class _AnchorPlan(NamedTuple):
    """Index tables for a chunk of C tokens (the module docstring), L = log2(C) levels of C/2 pairs each.
    spans [(2 + L) C, C]: 0/1 rows that sum a chunk's gates g [C, K] over the spans whose exponentials the chunk
        needs: G_i (t <= i), G_C - G_i (t > i), then the row factors' spans (i's block up to i) for the tokens in
        `rows`, then the column factors' spans (j's block after j) for the tokens in `cols`.
    rows, cols [L C/2]: per level in `_levels` order, the tokens of its odd blocks (pair rows) and of its even
        blocks (pair columns), block pair by block pair.
    pair_index [C * C]: where each entry of a C x C pair matrix lies in the flat list [level products (per level
        [pairs, s, s]), diagonal (C), 0]; 0 above the diagonal."""

    spans: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    pair_index: torch.Tensor


@functools.lru_cache(maxsize=16)
def _anchor_plan(C: int, dtype: torch.dtype, device: torch.device) -> _AnchorPlan:
    rows = [2 * p * s + s + a for s in _levels(C) for p in range(C // (2 * s)) for a in range(s)]
    cols = [2 * p * s + b for s in _levels(C) for p in range(C // (2 * s)) for b in range(s)]
    sizes = [s for s in _levels(C) for _ in range(C // 2)]  # the block size of each entry of rows / cols
    spans = torch.zeros(2 * C + len(rows) + len(cols), C)
    for i in range(C):
        spans[i, : i + 1] = 1
        spans[C + i, i + 1 :] = 1
    for r, (i, s) in enumerate(zip(rows, sizes)):
        spans[2 * C + r, i // s * s : i + 1] = 1
    for r, (j, s) in enumerate(zip(cols, sizes)):
        spans[2 * C + len(rows) + r, j + 1 : (j // s + 1) * s] = 1
    pairs = [(2 * p * s + s + a, 2 * p * s + b) for s in _levels(C) for p in range(C // (2 * s))
             for a in range(s) for b in range(s)]  # the order of the flattened level products
    pair_index = torch.full((C, C), len(pairs) + C, dtype=torch.long)
    pair_index[[i for i, _ in pairs], [j for _, j in pairs]] = torch.arange(len(pairs))
    pair_index[range(C), range(C)] = len(pairs) + torch.arange(C)
    index = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return _AnchorPlan(spans.to(dtype=dtype, device=device), index(rows), index(cols), pair_index.flatten().to(device))


def _span_decays(g, plan: _AnchorPlan):
    """exp of the span sums of g [..., C, K] (`_AnchorPlan.spans`): exp(G_i), exp(G_C - G_i) [..., C, K] and the
    pair rows' and columns' anchor factors [..., L C/2, K]."""
    C = g.shape[-2]
    return (plan.spans @ g).exp().split([C, C, plan.rows.numel(), plan.cols.numel()], dim=-2)


def _pair_matrices(q, k, row_decays, col_decays, plan: _AnchorPlan):
    """Tril((Gamma ⊙ Q)(K / Gamma)^T) and StrictTril((Gamma ⊙ K)(K / Gamma)^T) [..., C, C] of q, k [..., C, K],
    from the anchor factors exp(span sums) of the pair rows and columns [..., L C/2, K] (`_AnchorPlan`)."""
    C = q.shape[-2]
    qk = torch.stack([q, k], dim=-3)  # [..., 2, C, K]
    rows = (qk.index_select(-2, plan.rows) * row_decays.unsqueeze(-3)).split(C // 2, dim=-2)
    cols = (k.index_select(-2, plan.cols) * col_decays).split(C // 2, dim=-2)
    flat = []
    for s, r, c in zip(_levels(C), rows, cols):
        r, c = r.unflatten(-2, (-1, s)), c.unflatten(-2, (-1, s)).unsqueeze(-4)  # [..., (2,) pairs, s, K]
        flat.append((r @ c.transpose(-1, -2)).flatten(-3))  # [..., 2, C s / 2]
    diagonal = torch.stack([(q * k).sum(-1), torch.zeros_like(q[..., 0])], dim=-2)  # q_i . k_i; A_kk is strict
    flat += [diagonal, torch.zeros_like(diagonal[..., :1])]
    pairs = torch.cat(flat, dim=-1).index_select(-1, plan.pair_index).unflatten(-1, (C, C))
    return pairs.unbind(-3)


class _StatePass(torch.autograd.Function):
    """The state recurrence over chunks, inputs [n, batch, ...] with chunks first:
        pv_c = U_c - W_c S_c,   S_{c+1} = Diag(gamma_c) S_c + Kg_c^T pv_c       (Kg = K ⊙ gamma_C / Gamma)
    Returns the states before each chunk S_0..S_{n-1} [n, batch, K, V], the final state S_n and the
    pseudo-values pv [n, batch, C, V]. The backward runs the recurrence in reverse (no per-chunk graphs)."""

    @staticmethod
    def forward(ctx, W, U, gamma, Kg, S0):
        n = W.shape[0]
        states = S0.new_empty(n, *S0.shape)
        states[0] = S0
        pv = torch.empty_like(U)
        for c in range(n):
            torch.baddbmm(U[c], W[c], states[c], alpha=-1, out=pv[c])
            final = torch.baddbmm(gamma[c].unsqueeze(-1) * states[c], Kg[c].transpose(-1, -2), pv[c],
                                  out=states[c + 1] if c + 1 < n else None)
        ctx.save_for_backward(W, gamma, Kg, states, pv)
        return states, final, pv

    @staticmethod
    @once_differentiable
    def backward(ctx, d_states, d_final, d_pv):
        W, gamma, Kg, states, pv = ctx.saved_tensors
        n = W.shape[0]
        d_after = torch.empty_like(states)  # dL/dS_{c+1}, all of it, as chunk c sees it
        d_after[n - 1] = d_final
        d_pv_total = torch.empty_like(pv)
        for c in reversed(range(n)):
            torch.baddbmm(d_pv[c], Kg[c], d_after[c], out=d_pv_total[c])
            # dL/dS_c: what chunk c - 1 sees after it, or the initial state's gradient
            dS = torch.baddbmm(torch.addcmul(d_states[c], gamma[c].unsqueeze(-1), d_after[c]),
                               W[c].transpose(-1, -2), d_pv_total[c], alpha=-1, out=d_after[c - 1] if c else None)
        dW = -(d_pv_total @ states.transpose(-1, -2))
        d_gamma = (states * d_after).sum(-1)
        dKg = pv @ d_after.transpose(-1, -2)
        return dW, d_pv_total, d_gamma, dKg, dS


def _kda_chunked_padded(q, k, v, g, beta, initial_state):
    """q, k, g [n,B,C,K]; v [n,B,C,V]; beta [n,B,C]: n chunks of C tokens of B (sequence, head) rows.
    Returns o [n,B,C,V], the states before each chunk [n,B,K,V] and the final state [B,K,V]."""
    n, B, C, K = q.shape
    plan = _anchor_plan(C, q.dtype, q.device)
    decay_in, decay_out, row_decays, col_decays = _span_decays(g.clamp_min(_underflow_floor(g.dtype)), plan)
    A_qk, A_kk = _pair_matrices(q, k, row_decays, col_decays, plan)

    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = beta.unsqueeze(-1) * torch.cat([k * decay_in, v], dim=-1)  # (I + A)^-1 Diag(beta) [Gamma ⊙ K, V]
    W, U = torch.linalg.solve_triangular(eye + beta.unsqueeze(-1) * A_kk, rhs, upper=False,
                                         unitriangular=True).split([K, v.shape[-1]], dim=-1)
    S0 = q.new_zeros(B, K, v.shape[-1]) if initial_state is None else initial_state
    gamma = decay_in[..., -1, :]  # exp(G_C)
    states, final, pv = _StatePass.apply(W.contiguous(), U.contiguous(), gamma, k * decay_out, S0)
    o = (q * decay_in) @ states + A_qk @ pv
    return o, states, final


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA, same contract as `kda_recurrent`; differentiable. Computes in fp32 (fp64 for fp64).
    chunk_size: a power of two."""
    o, _, final = _chunked(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, ())
    return o, (final if output_final_state else None)


def kda_chunked_with_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    offsets: tuple[int, ...],
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """`kda_chunked` over [B,T,H,*] that also returns the state after each of `offsets` tokens (fp32 [B,H,K,V],
    the same values a call stopped there would return), from one pass: the offsets must be multiples of
    chunk_size in (0, T], where the chunks end. Returns (o, states in the order of offsets, final state)."""
    T = q.shape[1]
    bad = [t for t in offsets if not 0 < t <= T or t % chunk_size]
    if bad:
        raise ValueError(f"offsets must be multiples of chunk_size={chunk_size} in (0, T={T}], got {bad}")
    return _chunked(q, k, v, g, beta, scale, initial_state, None, chunk_size, tuple(t // chunk_size for t in offsets))


def _chunked(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, keep):
    """`keep`: the chunk counts after which to return the state as well."""
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    seqs = sequence_bounds(cu_seqlens, B, T)
    N = len(seqs)
    max_len = max((end - start for _, start, end in seqs), default=0)
    padded_len = max(C, -(-max_len // C) * C)

    def chunks(x: torch.Tensor) -> torch.Tensor:
        """[B,T,H,D] -> [n, N*H, C, D] in the accumulation dtype: chunk-major, one row per (sequence, head)."""
        if cu_seqlens is None:
            rows = F.pad(x, (0, 0, 0, 0, 0, padded_len - T))
        else:
            rows = torch.stack([F.pad(x[b, start:end], (0, 0, 0, 0, 0, padded_len - end + start))
                                for b, start, end in seqs])
        return rows.to(acc).unflatten(1, (-1, C)).permute(1, 0, 3, 2, 4).reshape(-1, N * H, C, x.shape[-1])

    s0 = None if initial_state is None else initial_state.to(acc).reshape(N * H, K, V)
    o, states, final = _kda_chunked_padded(chunks(q.to(acc) * scale), chunks(k), chunks(v), chunks(g),
                                    chunks(beta.unsqueeze(-1)).squeeze(-1), s0)
    o = o.unflatten(1, (N, H)).permute(1, 0, 3, 2, 4).reshape(N, padded_len, H, V)
    if cu_seqlens is None:
        o = o[:, :T]
    else:
        o = torch.cat([o[i, : end - start] for i, (_, start, end) in enumerate(seqs)]).unsqueeze(0)
    kept = [final if c == len(states) else states[c] for c in keep]
    return o.to(v.dtype), [s.unflatten(0, (N, H)) for s in kept], final.unflatten(0, (N, H))
