"""KDA context parallel (KCP, SPEC §10): one packed sequence stream split contiguously over the ranks of a group.

Per KDA layer and rank r (the token layout is a `SequenceSplit`):
  conv halo   The short conv of rank r's first tokens reads the last W-1 inputs before them. One all-gather of
              every rank's last min(W-1, size) conv inputs; rank r takes the ones of its first document (valid
              length min(W-1, tokens of that document before r), gathered from as many earlier ranks as needed, so
              a rank holding fewer than W-1 tokens is fine). Backward: the gathered rows' gradients are summed
              over the ranks and each rank adds its share to its last inputs' gradients (`comm.gather_rows`).
  forward     If r's last local sequence goes on past r, r computes that sequence's affine map from a zero
              state, (S_ext, M) with S_end = M S_0 + S_ext (`ops.kda.transition`, fp32, no autograd). One
              all-gather of [S_ext | M]; a rank whose first sequence began earlier folds S <- M_j S + S_ext_j over
              the ranks j that hold the rest of it (`SequenceSplit.state_chain`): its true initial state S_0, a
              constant. Then the ordinary KDA runs on the local tokens (`openk3.ops.kda.kda`, any backend; its
              other sequences start at 0), returning the final state of r's last sequence too.
  backward    `_TerminalStateGrad` (around the KDA output) first computes dS_ext, the gradient of r's outputs with
              respect to the initial state of its first sequence with no gradient on its final state
              (`kda_initial_state_grad` over that sequence's tokens; 0 when it starts on r). One all-gather;
              T = dS_ext_j + M_j^T T over the later ranks j of r's last sequence (walked backwards, the M term
              for ranks that lie inside it) is that sequence's terminal state gradient, which the ordinary KDA
              backward then takes as its final state's gradient. The earlier ranks' share of later outputs
              arrives through T, so every rank's gradients are exact, not only the last one's.
  Triton      Both exchanges run inside the layer's own kernels (`ops.kda.triton.exchange.kda_triton_exchange`):
              S_ext, M from the prepare kernel's chunk terms between it and the state pass, dS_ext from the saved
              terms before the backward, each cut into pieces; so no extra prepare kernel runs, and a rank's own
              prepare kernel overlaps its wait for the earlier ranks' maps. `_Exchange` is the collectives of both
              routes.
"""

from __future__ import annotations

import torch

from openk3.ops.conv import causal_conv1d
from openk3.ops.kda import kda, resolve_backend
from openk3.ops.kda.transition import kda_initial_state_grad, kda_transition
from openk3.ops.transfer import to_device
from openk3.parallel.comm import all_gather_padded, gather_rows
from openk3.parallel.layout import SequenceSplit


def conv_halo(x: torch.Tensor, split: SequenceSplit, rank: int, width: int, group) -> torch.Tensor:
    """x [L, C], this rank's conv inputs -> [1, C, width-1], the conv state of its first tokens (oldest first;
    zeros where the inputs belong to another document or lie before the stream). Collective."""
    w1 = width - 1
    sizes = [min(w1, split.size(j)) for j in range(split.num_ranks)]
    tails = gather_rows(x[x.shape[0] - sizes[rank]:], sizes, rank, group)  # [sum(sizes), C]
    offsets = [sum(sizes[:j]) for j in range(split.num_ranks)]
    start = split.bounds[rank]
    rows, valid = [], []
    for p in range(start - w1, start):
        ok = split.continues_from(rank) and p >= split.head_start(rank)
        j = split.rank_of(p) if ok else 0
        rows.append(offsets[j] + p - (split.bounds[j + 1] - sizes[j]) if ok else 0)
        valid.append(ok)
    # always read the gathered rows (masked), so every rank's backward reaches the gather's collective
    mask = to_device(valid, x.device, x.dtype).unsqueeze(-1)
    halo = tails[to_device(rows, x.device, torch.long)] * mask
    return halo.t().unsqueeze(0)


def kcp_conv(x: torch.Tensor, weight: torch.Tensor, split: SequenceSplit, rank: int, group) -> torch.Tensor:
    """Depthwise causal conv + SiLU over this rank's x [1, L, C], each local sequence from its own history (the halo
    for the first one, zeros for the others)."""
    width = weight.shape[-1]
    halo = conv_halo(x[0], split, rank, width, group) if width > 1 else None
    cu = split.local_cu_seqlens(rank)
    outs = [causal_conv1d(x[:, a:b], weight, halo if i == 0 else None)[0] for i, (a, b) in enumerate(zip(cu, cu[1:]))]
    return torch.cat(outs, dim=1)


class _Exchange:
    """The two exchanges of one KDA call (module docstring), collective over `group`; the `StateExchange` of
    `openk3.ops.kda.triton.exchange`, and the same steps for the other backends."""

    def __init__(self, split: SequenceSplit, rank: int, group, shape: tuple[int, int, int], dtype, device):
        self.split, self.rank, self.group = split, rank, group
        self.shape, self.dtype, self.device = shape, dtype, device  # (H, K, V) of the state
        self.head_continues, self.tail_continues = split.continues_from(rank), split.continues_to(rank)
        self.M_all = None  # every rank's M [R, H, K, K], kept for the backward

    def forward(self, tail_map):
        """This rank's (S_ext, M) (None: its last sequence ends here) -> its first sequence's initial state."""
        H, K, V = self.shape
        if tail_map is None:
            tail_map = (torch.zeros(H, K, V, dtype=self.dtype, device=self.device),
                        torch.eye(K, dtype=self.dtype, device=self.device).expand(H, K, K))
        maps = torch.cat([t.to(self.dtype) for t in tail_map], dim=-1).unsqueeze(0)
        gathered = all_gather_padded(maps, [1] * self.split.num_ranks, self.group)
        S_all, self.M_all = gathered[..., :V], gathered[..., V:]
        chain = self.split.state_chain(self.rank)
        if not chain:
            return None
        S = torch.zeros(H, K, V, dtype=self.dtype, device=self.device)
        for j in chain:
            S = self.M_all[j] @ S + S_all[j]
        return S

    def backward(self, head_grad):
        """dS_ext of this rank's first sequence (None: it starts here) -> its last sequence's final-state
        gradient T (None: no later rank reads that state)."""
        if head_grad is None:
            head_grad = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        dS_all = all_gather_padded(head_grad.to(self.dtype).unsqueeze(0), [1] * self.split.num_ranks, self.group)
        later = self.split.later_chain(self.rank)
        if not later:
            return None
        T = torch.zeros_like(head_grad, dtype=self.dtype)
        for j in reversed(later):
            T = dS_all[j] + (self.M_all[j].mT @ T if self.split.spans(j) else 0)
        return T


class _TerminalStateGrad(torch.autograd.Function):
    """(o, final states of the local sequences) -> o. Backward: the exchange gives the final state of this rank's
    last sequence its gradient T. Every rank reaches it in training (o requires grad), so every rank issues its
    collective. (The Triton route does this inside `kda_triton_exchange`.)"""

    @staticmethod
    def forward(ctx, o, final, exchange, options, *head):
        ctx.exchange, ctx.options, ctx.n_seqs = exchange, options, final.shape[0]
        ctx.save_for_backward(*head)
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        head = ctx.saved_tensors
        exchange = ctx.exchange
        dS_ext = None
        if exchange.head_continues:
            dS_ext = kda_initial_state_grad(*head, do[:, :head[0].shape[1]], **ctx.options)[0]
        T = exchange.backward(dS_ext)
        if T is None:
            return (do, *[None] * (3 + len(head)))
        d_final = T.new_zeros(ctx.n_seqs, *T.shape)
        d_final[-1] = T
        return (do, d_final, *[None] * (2 + len(head)))


def kcp_kda(q, k, v, g, beta, split: SequenceSplit, rank: int, group, *, scale=None, backend: str = "auto",
            gate_min: float | None = None, piece: int | None = None):
    """KDA over this rank's tokens of a packed stream: q, k, g [1,L,H,K], v [1,L,H,V], beta [1,L,H] (activated, as
    `openk3.ops.kda.kda` takes them) -> o [1,L,H,V]. Collective over `group`, forward and backward. On Triton the
    exchanges run inside the layer's kernels (`kda_triton_exchange`; `piece`: tokens per piece of their passes)."""
    backend = resolve_backend(backend, k.device, k.shape[1])
    H, K, V = k.shape[2], k.shape[3], v.shape[-1]
    acc = torch.float64 if k.dtype == torch.float64 and backend != "triton" else torch.float32
    exchange = _Exchange(split, rank, group, (H, K, V), acc, k.device)
    cu = split.local_cu_seqlens(rank)
    if backend == "triton":
        from openk3.ops.kda.triton.exchange import kda_triton_exchange

        return kda_triton_exchange(q, k, v, g, beta, cu, exchange, scale=scale, gate_min=gate_min, piece=piece)
    with torch.no_grad():
        tail = None
        if exchange.tail_continues:
            a = split.tail_start(rank)
            S_ext, M = kda_transition(k[:, a:], v[:, a:], g[:, a:], beta[:, a:], backend=backend, gate_min=gate_min)
            tail = (S_ext[0], M[0])
        S0 = exchange.forward(tail)
    initial = torch.zeros(len(cu) - 1, H, K, V, dtype=acc, device=k.device)
    if S0 is not None:
        initial[0] = S0
    o, final = kda(q, k, v, g, beta, scale=scale, initial_state=initial,
                   cu_seqlens=torch.tensor(cu), output_final_state=True,  # on the host: no synchronisation
                   backend=backend, gate_min=gate_min)
    if not o.requires_grad:  # no backward (evaluation), so no backward exchange
        return o
    # the tokens of this rank's first local sequence, for its initial-state gradient (none when it starts here)
    head = [x[:, :cu[1]] for x in (q, k, v, g, beta)] if exchange.head_continues else []
    options = dict(scale=scale, backend=backend, gate_min=gate_min)
    return _TerminalStateGrad.apply(o, final, exchange, options, *head)


def kda_layer_forward(layer, x: torch.Tensor, split: SequenceSplit, rank: int, group) -> torch.Tensor:
    """`KimiDeltaAttention.forward` for this rank's tokens x [1, L, D] of a packed stream (no cache), built from the
    layer's own pieces; only the conv and the KDA call change."""
    B, L, _ = x.shape
    if B != 1:
        raise ValueError(f"context parallelism works on one packed stream (batch 1), got batch {B}")
    H, K = layer.num_heads, layer.head_dim
    qkv = layer.qkv(x)
    qkv = kcp_conv(qkv, layer.conv_weight(), split, rank, group)
    q, k, v = (t.reshape(B, L, H, K) for t in qkv.split(H * K, dim=-1))
    backend = resolve_backend(layer.kda_backend, x.device, L)
    q, k, g, beta = layer.activate(q, k, x, backend)
    o = kcp_kda(q, k, v, g, beta, split, rank, group, backend=backend, gate_min=layer.gate_min())
    return layer.output(x, o)
