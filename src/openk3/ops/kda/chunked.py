"""Chunked (WY / UT) form of Kimi Delta Attention in plain PyTorch (SPEC-K3 §2).

Per chunk of C tokens, with G the within-chunk cumulative log decay (per channel) and S_0 the incoming state:

    A   = StrictTril( Diag(beta) (Gamma ⊙ K)(K / Gamma)^T )      M = (I + A)^-1 Diag(beta)
    W   = M (Gamma ⊙ K),  U = M V                                  (pseudo-value: U - W S_0)
    O   = (Gamma ⊙ Q) S_0 + Tril( (Gamma ⊙ Q)(K / Gamma)^T ) (U - W S_0)
    S_C = Diag(gamma_C) S_0 + (K ⊙ gamma_C / Gamma)^T (U - W S_0)

Gamma_i / Gamma_j is formed as exp(G_i - G_j) with i >= j, so no exponent is ever positive and any gate
(K3's bounded one or Kimi Linear's unbounded softplus gate) is safe in fp32. Everything that does not depend
on the state is computed for all chunks at once; only the short state recurrence loops over chunks.
Sequences are zero-padded to a multiple of C: a token with k = v = q = g = beta = 0 leaves the state alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.kda.reference import sequence_bounds

CHUNK_SIZE = 16  # default chunk: on 2 CPU cores fwd+bwd ran 1.8x faster than at 32 (bench/RESULTS.md, Training)


def _kda_chunked_padded(q, k, v, g, beta, initial_state, chunk_size, keep=()):
    """q, k, g [N,H,T,K]; v [N,H,T,V]; beta [N,H,T]; T a multiple of chunk_size. Returns o, the final state and
    the states after the chunks listed in `keep`."""
    N, H, T, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    n = T // C
    q, k, g = (x.reshape(N, H, n, C, K) for x in (q, k, g))
    v = v.reshape(N, H, n, C, V)
    beta = beta.reshape(N, H, n, C)

    G = g.cumsum(-2)
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # pairwise decay exp(G_i - G_j) for i >= j, zero above the diagonal: [N,H,n,C,C,K]
    log_decay = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~incl[:, :, None], float("-inf"))
    decay = log_decay.exp()
    A = torch.einsum("...id,...ijd,...jd->...ij", k, decay, k) * beta.unsqueeze(-1)
    A = A.tril(-1)  # strictly lower triangular
    A_qk = torch.einsum("...id,...ijd,...jd->...ij", q, decay, k)  # lower triangular incl. diagonal

    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    M = torch.linalg.solve_triangular(eye + A, torch.diag_embed(beta), upper=False, unitriangular=True)
    W = M @ (k * G.exp())
    U = M @ v
    q_decayed = q * G.exp()
    chunk_decay = G[..., -1, :]  # [N,H,n,K]
    k_to_end = k * (chunk_decay.unsqueeze(-2) - G).exp()

    S = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(q.dtype)
    outputs, kept = [], {}
    for c in range(n):
        pseudo_v = U[:, :, c] - W[:, :, c] @ S
        outputs.append(q_decayed[:, :, c] @ S + A_qk[:, :, c] @ pseudo_v)
        S = chunk_decay[:, :, c].exp().unsqueeze(-1) * S + k_to_end[:, :, c].transpose(-1, -2) @ pseudo_v
        if c in keep:
            kept[c] = S
    o = torch.stack(outputs, dim=2).reshape(N, H, T, V)
    return o, S, [kept[c] for c in keep]


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
    """Chunked KDA, same contract as `kda_recurrent`; differentiable. Computes in fp32 (fp64 for fp64)."""
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
    keep = tuple(t // chunk_size - 1 for t in offsets)  # the chunk each offset ends
    return _chunked(q, k, v, g, beta, scale, initial_state, None, chunk_size, keep)


def _chunked(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, keep):
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    seqs = sequence_bounds(cu_seqlens, B, T)
    max_len = max((end - start for _, start, end in seqs), default=0)
    padded_len = max(chunk_size, -(-max_len // chunk_size) * chunk_size)

    def gather(x: torch.Tensor) -> torch.Tensor:
        """[B,T,H,...] -> [N,H,padded_len,...] in the accumulation dtype, one row per sequence."""
        rows = [x[b, start:end] for b, start, end in seqs]
        rows = [F.pad(r, (0, 0) * (r.dim() - 1) + (0, padded_len - r.shape[0])) for r in rows]
        return torch.stack(rows).to(acc).movedim(2, 1)

    qs, ks, vs, gs = gather(q.to(acc) * scale), gather(k), gather(v), gather(g)
    betas = gather(beta.unsqueeze(-1)).squeeze(-1)
    o_padded, final, kept = _kda_chunked_padded(qs, ks, vs, gs, betas, initial_state, chunk_size, keep)
    o_padded = o_padded.movedim(1, 2)  # [N,padded_len,H,V]
    if cu_seqlens is None:
        o = o_padded[:, :T]
    else:
        o = torch.cat([o_padded[i, : end - start] for i, (_, start, end) in enumerate(seqs)]).unsqueeze(0)
    return o.to(v.dtype), kept, final
