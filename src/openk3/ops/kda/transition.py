"""KDA as an affine map of its incoming state: what context parallelism exchanges (SPEC-K3 §2 KCP, §10).

Over a span of tokens the KDA state update is affine in the incoming state S_0 (per head, S in R^{K x V}):

    S_end = M S_0 + S_ext

M [K, K] is the product of the transitions and S_ext [K, V] the state the span produces from S_0 = 0. Per token
(the recurrence in reference.py) the map is

    A_t = (I - beta_t k_t k_t^T) Diag(alpha_t),   b_t = beta_t k_t v_t^T,   S_t = A_t S_{t-1} + b_t,

and `kda_transition_reference` composes these one token at a time. `kda_transition` uses the chunked form of
chunked.py instead. Per chunk of C tokens, with G the within-chunk cumulative log decay, Gamma = exp(G),
gamma_C = exp(G_C) (the decay over the whole chunk) and T = (I + A)^-1 Diag(beta),
A = StrictTril(Diag(beta) (Gamma ⊙ K)(K / Gamma)^T):

    W = T (Gamma ⊙ K),   U = T V,   K_end = K ⊙ (gamma_C / Gamma)           (row i: k_i exp(G_C - G_i))
    S_C = Diag(gamma_C) S_0 + K_end^T (U - W S_0)                          (chunked.py's state update)
        = [Diag(gamma_C) - K_end^T W] S_0 + K_end^T U

so the chunk's map is M_c = Diag(gamma_C) - K_end^T W and b_c = K_end^T U. (SPEC §10 writes M_c with fla's
naming, "Diag(gamma_C) - (Gamma ⊙ K)^T W": fla's W carries the decay to the chunk end that K_end carries here.)
`kda_transition_chunked` computes the chunk maps for all chunks at once and composes them pairwise,
(M2, b2) ∘ (M1, b1) = (M2 M1, M2 b1 + b2), in log2(chunks) batched steps rather than a loop over chunks. Zero padding
to a multiple of C is the identity map (k = v = g = beta = 0), and the pairwise decays exp(G_i - G_j), i >= j, are
formed as one [C, C, K] tensor per chunk (no positive exponent), so unbounded gates are safe too. Its memory is that
of the pairwise decays, C times k's (chunked.py has since moved to block-anchored matmul factors, which this
could share).

Because each column of the state evolves on its own, the map is also the final state of one ordinary KDA pass over
an augmented state: with values [v | 0] ([T, V+K]) from S_0 = [0 | I], the final state is [S_ext | M]. `kda_transition`
takes that route on the Triton backend (no extra memory beyond a KDA pass): without a gradient to take (KCP's
forward exchange) the kernels' state recurrence alone, `kda_final_state_triton` (no outputs, no q-side terms, and
the zero value columns never stored); with one the full differentiable forward, whose backward is the kernels' own.
The other backends take the chunk-map form. Either way the chain is fp32 (fp64 for fp64 inputs): M loses accuracy
quickly in bf16 (fla #740).

A state pass is a chain over the chunks, one program per (sequence, head, V block): for one long sequence and few
heads (KCP's case: a rank's whole piece of one document) the GPU runs a handful of programs one chunk after
another, and the chain's latency, not its width (V or V + K columns), sets the time. On Triton the span is
therefore cut into pieces (`piece_tokens`) that run side by side in one pass (a batch of equal pieces, else varlen
pieces), each from [0 | I], and the pieces' maps (M_p, b_p) are composed with `compose_maps` (fp64, log2(pieces)
batched steps).

The backward of context parallelism needs the transposed quantity: dS_0 = d<O, dO>/dS_0, the gradient of a
span's outputs with respect to its incoming state (zero gradient on its final state). It does not depend on S_0
(O is affine in S_0), and `kda_initial_state_grad` computes it: on the Triton kernels as the reverse state pass
alone over the prepare kernel's chunk terms (dS <- Diag(gc) dS + Qd^T dO - W^T dpv, dpv = Aqk^T dO + kg dS, from
dS = 0 at the end: no intra-chunk backward, no input gradients), elsewhere by autograd from a zero initial state.
That pass is affine in the final-state gradient too, dS_start = M^T dS_end + Y, so run from [0 | I] with dO's
extra columns zero it returns [Y | M^T]; cut into pieces as above, dS_0 = Y_1 + M_1^T (Y_2 + M_2^T (Y_3 + ...)),
the pieces' maps composed last piece first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.kda import kda, resolve_backend
from openk3.ops.kda.checks import check_kda_inputs, check_kda_options
from openk3.ops.kda.chunked import CHUNK_SIZE
from openk3.ops.transfer import to_device

PARALLEL_CHAINS = 256  # (piece, head) chains a state pass needs to fill an H200 (132 SMs)
MIN_PIECE = 1024  # tokens: shorter pieces cost more in composition than they win in the chain
FEW_CHAINS = PARALLEL_CHAINS // 8  # fewer than this many (sequence, head) chains are cut into pieces


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def piece_tokens(lengths: list[int], H: int) -> int | None:
    """Tokens per piece for the Triton state passes over sequences of these lengths with H heads (module
    docstring): for fewer than FEW_CHAINS (sequence, head) chains, a power of two of pieces, enough for
    PARALLEL_CHAINS chains but at most longest / MIN_PIECE, in whole 64-token chunks (so a power-of-two length is
    cut evenly); None otherwise (with enough chains the pieces win nothing: timings in bench/RESULTS.md, Scale-out,
    2026-12-03)."""
    longest = max(lengths, default=0)
    chains = max(1, len(lengths) * H)
    if chains >= FEW_CHAINS:  # the pieces' extra K columns and composition cost more than they win
        return None
    wanted = -(-PARALLEL_CHAINS // chains)
    pieces = min(1 << (wanted - 1).bit_length(), 1 << max(0, (longest // MIN_PIECE).bit_length() - 1))
    return -(-longest // (64 * pieces)) * 64 if pieces > 1 else None


def piece_size(lengths: list[int], H: int, piece: int | None = None) -> int | None:
    """The piece size to cut these sequences into: `piece` (a positive number of tokens) or `piece_tokens`'s
    choice; None when no sequence would be cut (one chain each)."""
    if piece is not None and (isinstance(piece, bool) or not isinstance(piece, int) or piece < 1):
        raise ValueError(f"piece must be a positive number of tokens, got {piece!r}")
    size = piece_tokens(lengths, H) if piece is None else piece
    return None if size is None or size >= max(lengths, default=0) else size


def _as_pieces(xs: list[torch.Tensor], lengths: list[int], size: int, packed: bool):
    """xs [B,T,H,*] (B sequences, or with `packed` one row of sequences of these lengths) cut into pieces of
    `size` tokens -> (the kernels' inputs, the pieces' cu_seqlens or None, pieces per sequence). Equal rows that
    `size` divides become a dense batch of pieces (no varlen tables to build), anything else varlen pieces."""
    B, T = xs[0].shape[:2]
    if not packed and T % size == 0:
        return [x.reshape(B * (T // size), size, *x.shape[2:]) for x in xs], None, [T // size] * B
    cu, counts = _cut(lengths, size)
    return [x.reshape(1, B * T, *x.shape[2:]) for x in xs], torch.tensor(cu), counts  # cu on the host: no sync


def _cut(lengths: list[int], size: int) -> tuple[list[int], list[int]]:
    """Each sequence cut into pieces of `size` tokens (the last one shorter; an empty sequence is one empty piece):
    the pieces' cu_seqlens over the packed sequences and the number of pieces of each sequence."""
    cu, counts = [0], []
    for n in lengths:
        start = cu[-1]
        ends = list(range(start + size, start + n, size)) + [start + n]
        cu += ends
        counts.append(len(ends))
    return cu, counts


def compose_pieces(maps: torch.Tensor, counts: list[int], V: int, reverse: bool):
    """maps [pieces, H, K, V + K], each piece's [b | A] (S <- A S + b), pieces of sequence 0 first -> each
    sequence's composed map (A [N, H, K, K], b [N, H, K, V]) in maps' dtype, applied in piece order (last piece
    first with `reverse`); composed in fp64."""
    N, P = len(counts), max(counts)
    _, H, K, _ = maps.shape
    if len(set(counts)) == 1:
        grouped = maps.double().view(N, P, H, K, V + K)
    else:
        grouped = torch.zeros(N, P, H, K, V + K, dtype=torch.float64, device=maps.device)
        grouped[..., V:] = torch.eye(K, dtype=torch.float64, device=maps.device)  # padding: the identity map
        seq = [n for n, c in enumerate(counts) for _ in range(c)]
        pos = [p for c in counts for p in range(c)]
        grouped[to_device(seq, maps.device, torch.long), to_device(pos, maps.device, torch.long)] = maps.double()
    grouped = grouped.movedim(1, 2)  # [N, H, P, K, V + K]
    if reverse:
        grouped = grouped.flip(2)
    A, b = compose_maps(grouped[..., V:], grouped[..., :V])
    return A.to(maps.dtype), b.to(maps.dtype)


def identity_start(n: int, H: int, K: int, V: int, dtype, device) -> torch.Tensor:
    """[0 | I]: [n, H, K, V + K], zero state columns beside the identity."""
    eye = torch.eye(K, dtype=dtype, device=device).expand(n, H, K, K)
    return torch.cat([eye.new_zeros(n, H, K, V), eye], dim=-1)


def kda_transition_reference(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: k, g [B,T,H,K], v [B,T,H,V], beta [B,T,H] -> (S_ext [B,H,K,V], M [B,H,K,K]), fp32/fp64."""
    B, T, H, K = k.shape
    acc = _acc(k.dtype)
    k, v, g, beta = (x.to(acc) for x in (k, v, g, beta))
    eye = torch.eye(K, dtype=acc, device=k.device)
    M = eye.expand(B, H, K, K).clone()
    S = torch.zeros(B, H, K, v.shape[-1], dtype=acc, device=k.device)
    for t in range(T):
        kt, bt = k[:, t], beta[:, t, :, None, None]
        A = (eye - bt * kt.unsqueeze(-1) * kt.unsqueeze(-2)) * g[:, t].exp().unsqueeze(-2)  # (I - b k k^T) Diag(a)
        M = A @ M
        S = A @ S + bt * kt.unsqueeze(-1) * v[:, t].unsqueeze(-2)
    return S, M


def _chunk_maps(k, v, g, beta, chunk_size):
    """k, g [B,H,n,C,K], v [B,H,n,C,V], beta [B,H,n,C] -> (M_c [B,H,n,K,K], b_c [B,H,n,K,V])."""
    C = chunk_size
    G = g.cumsum(-2)
    incl = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    decay = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~incl[:, :, None], float("-inf")).exp()
    A = (torch.einsum("...id,...ijd,...jd->...ij", k, decay, k) * beta.unsqueeze(-1)).tril(-1)
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    T = torch.linalg.solve_triangular(eye + A, torch.diag_embed(beta), upper=False, unitriangular=True)
    W = T @ (k * G.exp())
    U = T @ v
    G_end = G[..., -1, :]  # [B,H,n,K]
    k_end = k * (G_end.unsqueeze(-2) - G).exp()
    M = torch.diag_embed(G_end.exp()) - k_end.transpose(-1, -2) @ W
    return M, k_end.transpose(-1, -2) @ U


def compose_maps(M: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Maps in order along dim -3 (M [...,n,K,K], b [...,n,K,V]; map 0 first) -> their composition (M, b)."""
    while M.shape[-3] > 1:
        if M.shape[-3] % 2:  # pad with the identity map
            K = M.shape[-1]
            eye = torch.eye(K, dtype=M.dtype, device=M.device).expand(*M.shape[:-3], 1, K, K)
            M = torch.cat([M, eye], dim=-3)
            b = torch.cat([b, torch.zeros_like(b[..., :1, :, :])], dim=-3)
        first_M, then_M = M[..., 0::2, :, :], M[..., 1::2, :, :]
        b = then_M @ b[..., 0::2, :, :] + b[..., 1::2, :, :]
        M = then_M @ first_M
    return M.squeeze(-3), b.squeeze(-3)


def kda_transition_chunked(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_transition` in the chunk-map form (module docstring), in plain PyTorch."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    acc = _acc(k.dtype)
    C = chunk_size
    n = max(1, -(-T // C))

    def chunks(x: torch.Tensor) -> torch.Tensor:
        """[B,T,H,...] -> [B,H,n,C,...] in acc, zero padded."""
        x = x.to(acc)
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, n * C - T))
        return x.reshape(B, n, C, H, *x.shape[3:]).movedim(3, 1)

    M, b = _chunk_maps(chunks(k), chunks(v), chunks(g), chunks(beta.unsqueeze(-1)).squeeze(-1), C)
    M, S = compose_maps(M, b)
    return S.reshape(B, H, K, V), M.reshape(B, H, K, K)


def kda_transition(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    backend: str = "auto",
    gate_min: float | None = None,
    piece: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine map of KDA over each row of k, g [B,T,H,K], v [B,T,H,V], beta [B,T,H] (activated, as `kda`
    takes them): (S_ext [B,H,K,V], M [B,H,K,K]) with S_end = M S_0 + S_ext. fp32 (fp64 for fp64 inputs off the
    Triton backend); differentiable (on Triton without a gradient to take, e.g. under no_grad, the cheaper
    state-only pass runs, cut into pieces of `piece` tokens, default `piece_tokens`). T = 0 gives the identity
    map. `backend` and `gate_min` as in `openk3.ops.kda.kda`."""
    name = resolve_backend(backend, k.device, k.shape[1])
    if name in ("chunked", "recurrent") or k.shape[1] == 0:
        return kda_transition_chunked(k, v, g if gate_min is None else g.clamp_min(gate_min), beta)
    B, T, H, K = k.shape
    V = v.shape[-1]
    acc = _acc(k.dtype)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (k, v, g, beta)):
        values = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)  # [v | 0]
        start = identity_start(B, H, K, V, acc, k.device)
        _, final = kda(k, k, values, g, beta, initial_state=start, output_final_state=True, backend=name,  # q: unused
                       gate_min=gate_min)
        return final[..., :V], final[..., V:]
    from openk3.ops.kda.triton import kda_final_state_triton

    size = piece_size([T] * B, H, piece)
    if size is None:  # one chain per row
        final = kda_final_state_triton(k, v, g, beta, initial_state=identity_start(B, H, K, V, acc, k.device),
                                       gate_min=gate_min)  # values [v | 0]
        return final[..., :V], final[..., V:]
    pieces, cu, counts = _as_pieces([k, v, g, beta], [T] * B, size, packed=False)
    start = identity_start(sum(counts), H, K, V, acc, k.device)
    final = kda_final_state_triton(*pieces, initial_state=start, cu_seqlens=cu, gate_min=gate_min)
    M, S = compose_pieces(final, counts, V, reverse=False)
    return S, M


def kda_initial_state_grad(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    gate_min: float | None = None,
    piece: int | None = None,
) -> torch.Tensor:
    """The gradient of sum(o * do) with respect to the initial state of each sequence, the final states taking
    no gradient (module docstring): q, k, g [B,T,H,K], v and do [B,T,H,V], beta [B,T,H] and the options as
    `openk3.ops.kda.kda` takes them -> [N,H,K,V] (N = B, or the number of sequences with cu_seqlens), fp32
    (fp64 for fp64 inputs off the Triton backend). Not differentiable. On Triton the sequences are cut into
    pieces of `piece` tokens (default `piece_tokens`)."""
    check_kda_inputs(q, k, v, g, beta, None, cu_seqlens)
    check_kda_options(gate_min, None, q.shape[1], cu_seqlens)
    if do.shape != v.shape:
        raise ValueError(f"do must have v's shape {tuple(v.shape)}, got {tuple(do.shape)}")
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    name = resolve_backend(backend, k.device, T)
    if name == "triton":
        from openk3.ops.kda.triton import initial_state_grad_triton

        lengths = [T] * B if cu_seqlens is None else cu_seqlens.diff().tolist()
        size = piece_size(lengths, H, piece)
        if size is None:
            return initial_state_grad_triton(q, k, v, g, beta, do, scale=scale, cu_seqlens=cu_seqlens,
                                             gate_min=gate_min)
        pieces, cu, counts = _as_pieces([q, k, v, g, beta, do], lengths, size, packed=cu_seqlens is not None)
        dht = identity_start(sum(counts), H, K, V, torch.float32, k.device)
        maps = initial_state_grad_triton(*pieces, scale=scale, cu_seqlens=cu, gate_min=gate_min,
                                         final_state_grad=dht)  # [Y | M^T] per piece
        return compose_pieces(maps, counts, V, reverse=True)[1]
    h0 = torch.zeros(N, H, K, V, dtype=_acc(k.dtype), device=k.device, requires_grad=True)
    with torch.enable_grad():
        o, _ = kda(*(x.detach() for x in (q, k, v, g, beta)), scale=scale, initial_state=h0,
                   cu_seqlens=cu_seqlens, backend=name, gate_min=gate_min)
        (dh0,) = torch.autograd.grad(o, h0, do.detach().to(o.dtype))
    return dh0


__all__ = ["kda_transition", "kda_initial_state_grad", "kda_transition_chunked", "kda_transition_reference",
           "compose_maps", "compose_pieces", "identity_start", "piece_size", "piece_tokens"]
