"""Speculative decoding with the EAGLE-3-style draft (SPEC §11): propose K tokens, verify them in one target forward
over K + 1 positions, keep the target's distribution exactly, roll the target's state back to the last accepted
token.

Rejection sampling (`accept_drafts`, Leviathan et al. 2023 / Chen et al. 2023): draft token d_i, drawn from the
draft's distribution q_i, is accepted with probability min(1, p_i(d_i) / q_i(d_i)), p_i the target's distribution
at that position; at the first rejection one token is drawn from norm(max(0, p_i - q_i)) and the round ends; after
K acceptances one more (the bonus) is drawn from p_{K+1}. The tokens produced are distributed exactly as drawing
each from the target in turn. p and q are the distributions `openk3.sampling.sample_token` draws from (logit bias,
penalties over the tokens generated so far, temperature, top-k, top-p); greedy requests (and rows with no finite
logit) are point masses at sample_token's pick, so a drafted token is kept iff it equals it: greedy text is the
target's.

Rollback of the target (`HybridCache.rewind`): the verification forward records every KDA layer's conv window and
recurrent state after each of its first K tokens (`checkpoint_offsets`, one `kda(..., state_offsets=...)` call per
layer); after a of K drafts are accepted the cache keeps a + 1 tokens: the KDA layers take the states recorded at
that offset, the MLA latents are cut by length. The alternative, one snapshot before the verification and a
second forward over the accepted tokens after a rejection, was slower on CPU (bench/spec.py, bench/RESULTS.md).

The draft keeps its own latents beside the target's (one per position, `EagleDraft.step`). A round at position n
(the target has consumed tokens < n; x_n was just sampled): the draft runs the positions whose target features
became known in the last forward (their real latents, ending with x_n: its output there proposes d_1), then
K - 1 steps on its own hidden states at positions n+1 .. (latents that later rounds overwrite).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from openk3.cache import MLALayerCache
from openk3.draft.model import EagleDraft, tapped_hidden_states
from openk3.ops.fused import use_triton
from openk3.sampling import SamplingParams, adjusted_logits, draw_by_inversion, request_rng, sampling_probs, uniforms

log = logging.getLogger(__name__)
_reject_kernel_failed = False  # set once the rejection kernel has failed in this process (`accept_drafts_on_logits`)


def target_distributions(logits: torch.Tensor, params: Sequence[SamplingParams],
                         previous: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Raw logits [B, V] (any device) -> per row the fp32 distribution `sample_tokens` draws that row's token from: a
    point mass at its pick when it picks greedily (greedy parameters, or no finite logit)."""
    logits = adjusted_logits(logits, params, previous)
    picks = logits.argmax(-1)
    finite = logits.amax(-1).isfinite()
    point = torch.tensor([p.greedy for p in params], device=logits.device) | ~finite
    probs = sampling_probs(torch.where(finite.unsqueeze(-1), logits, 0.0), params)
    return torch.where(point.unsqueeze(-1), F.one_hot(picks, logits.shape[-1]).float(), probs)


def draw(probs: torch.Tensor, params: Sequence[SamplingParams], rngs: Sequence[random.Random]) -> torch.Tensor:
    """probs [B, V] -> one token per row [B]: greedy rows take the argmax without touching their random source, the
    others draw by inversion with one uniform from it."""
    sources = [None if p.greedy else rng for p, rng in zip(params, rngs)]
    drawn = draw_by_inversion(probs, uniforms(sources, probs.device)[:, 0])
    return torch.where(torch.tensor([p.greedy for p in params], device=probs.device), probs.argmax(-1), drawn)


def accept_greedy(drafted: Sequence[int], picks: Sequence[int]) -> list[int]:
    """`accept_drafts` for greedy rows with nothing adjusting their logits: picks[i] is the argmax of the target's
    logits at round position i (K + 1 of them); drafts are kept while they equal it, then its pick follows."""
    out: list[int] = []
    for d, pick in zip(drafted, picks):
        out.append(pick)
        if pick != d:
            return out
    out.append(picks[len(drafted)])
    return out


def accept_drafts(drafted: Sequence[Sequence[int]], draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                  params: Sequence[SamplingParams], rngs: Sequence[random.Random],
                  previous: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Rejection sampling for a batch of rows, on the logits' device. drafted: K tokens per row; draft_probs
    [B, K, V]: the distributions they were drawn from (None when every row is greedy: their drafts are point
    masses); target_logits [B, K+1, V]: the target's raw logits after each of the round's K + 1 inputs; `previous`:
    each row's tokens generated before the round (for the penalties). Returns per row the accepted drafts and one
    token from the target: 1 to K + 1 tokens, distributed as sampling them from the target one by one (module
    docstring).

    Every row runs the same arithmetic: with p_i the target's distribution after the first i drafts, draft i is
    accepted iff u_i q_i(d_i) < p_i(d_i); at the first rejection a (or a = K) the last token is drawn by inversion
    from max(0, p_a - q_a) with q_K = 0 (the bonus token's p_K). A sampled row takes K + 1 uniforms from its source
    every round; a greedy row takes none (u = 0: a point mass p keeps a draft iff it is the pick, and its residual
    is the pick). Only the accepted counts and the last tokens come to the host, in one copy."""
    B, K1, V = target_logits.shape
    K, device = K1 - 1, target_logits.device
    ids = torch.tensor([list(d) for d in drafted], dtype=torch.long, device=device).view(B, K)
    before = [[*(previous[b] if previous is not None else ()), *drafted[b][:i]] for b in range(B) for i in range(K1)]
    p = target_distributions(target_logits.reshape(B * K1, V), [sp for sp in params for _ in range(K1)], before)
    p = p.view(B, K1, V)
    greedy = torch.tensor([sp.greedy for sp in params], device=device)
    q = F.one_hot(ids, V).float() if draft_probs is None else \
        torch.where(greedy.view(B, 1, 1), F.one_hot(ids, V).float(), draft_probs.float())
    u = uniforms([None if sp.greedy else rng for sp, rng in zip(params, rngs)], device, count=K1)
    accept = u[:, :K] * q.gather(-1, ids.unsqueeze(-1)).squeeze(-1) < p[:, :K].gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    accepted = accept.long().cumprod(-1).sum(-1)  # leading acceptances a
    q = F.pad(q, (0, 0, 0, 1))  # q_K = 0: at a = K the residual is the bonus distribution p_K
    rows = torch.arange(B, device=device)
    # positive mass at a < K, since q_a(d_a) > p_a(d_a) there, unless d_a had no mass under q_a either (not a
    # draft the draft could have drawn): then p_a itself
    residual = (p[rows, accepted] - q[rows, accepted]).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, accepted])
    last = draw_by_inversion(residual, u[:, K])
    counts, tokens = torch.stack([accepted, last]).tolist()
    return [[*drafted[b][:a], t] for b, (a, t) in enumerate(zip(counts, tokens))]


def accept_drafts_on_logits(drafted: Sequence[Sequence[int]], draft_logits: torch.Tensor,
                            target_logits: torch.Tensor, params: Sequence[SamplingParams],
                            rngs: Sequence[random.Random]) -> list[list[int]]:
    """`accept_drafts` for rows whose distributions the temperature alone shapes (`whole_distribution`: no cuts, bias
    or penalties), given the draft's raw logits [B, K, V] the drafts were drawn from (`sample_tokens`) rather than
    its distributions. On a GPU one Triton launch per round (`ops.triton_sampling.reject_rows_triton`; should it
    fail to compile or launch, this process goes on with the fallback, logged once); elsewhere `accept_drafts` on the
    draft's `target_distributions`. The same uniforms either way."""
    global _reject_kernel_failed
    B, K, V = draft_logits.shape
    if use_triton(target_logits) and not _reject_kernel_failed:
        from openk3.ops.triton_sampling import reject_rows_triton  # triton is an optional dependency

        temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float64)
        states = [rng.getstate() for rng in rngs]
        u = uniforms([None if p.greedy else rng for p, rng in zip(params, rngs)], count=K + 1)
        try:
            counts, tokens = reject_rows_triton(draft_logits, target_logits, torch.tensor(drafted).view(B, K),
                                                temperature, u).T.tolist()
            return [[*drafted[b][:a], t] for b, (a, t) in enumerate(zip(counts, tokens))]
        except Exception:  # Triton's compile and launch errors have no common base class
            log.exception("the rejection kernel failed; rejection sampling with PyTorch operations from now on")
            _reject_kernel_failed = True
            for rng, state in zip(rngs, states):  # the fallback draws the same uniforms
                rng.setstate(state)
    q = target_distributions(draft_logits.reshape(B * K, V), [p for p in params for _ in range(K)])
    return accept_drafts(drafted, q.view(B, K, V), target_logits, params, rngs)


@dataclass
class SpeculationStats:
    """vLLM's counting: acceptance length = 1 + accepted / rounds (verification forwards with drafts).
    `by_accepted[a]`: the rounds that accepted a drafts."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    by_accepted: dict[int, int] = field(default_factory=dict)

    def add(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.by_accepted[accepted] = self.by_accepted.get(accepted, 0) + 1

    @property
    def accept_len(self) -> float:
        return 1 + self.accepted / self.rounds if self.rounds else float("nan")

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")


@torch.no_grad()
def speculative_generate(model: nn.Module, draft: EagleDraft, prompt_ids: list[int], max_new_tokens: int,
                         params: SamplingParams, num_draft: int, stop_ids: set[int] | frozenset = frozenset(),
                         device: torch.device | str = "cpu", stats: SpeculationStats | None = None) -> list[int]:
    """New token ids after `prompt_ids` with `num_draft` drafted tokens per verification (stops early at a stop id,
    which is not returned). The same contract and sampling as `openk3.generation.generate_ids`."""
    if not prompt_ids:
        raise ValueError("the prompt must have at least one token")
    if num_draft < 1:
        raise ValueError(f"the number of draft tokens must be >= 1, got {num_draft}")
    was_training = model.training
    model.eval()
    rng = request_rng(params.seed)
    stats = stats if stats is not None else SpeculationStats()
    cache = model.new_cache(1)
    ids = torch.tensor([prompt_ids], device=device)
    with tapped_hidden_states(model, draft.taps) as tapped:
        logits = model(ids, cache=cache, logits_to_keep=1).logits[0, -1]
        features = draft.fuse(tapped)  # [1, n, D]
    token = int(draw(target_distributions(logits[None], [params]), [params], [rng])[0])
    attn = draft.layer.block.self_attn
    latents = MLALayerCache(features.new_zeros(1, 0, attn.kv_lora_rank + attn.slice_dim))
    real = torch.zeros(1, dtype=torch.long, device=device)  # draft positions with real latents
    # the draft's next inputs: (F_{t-1}, x_t) for the positions from `real` to the newest token
    prev = torch.cat([features.new_zeros(1, 1, features.shape[-1]), features], dim=1)
    inputs = torch.tensor([[*prompt_ids, token]], device=device)
    out: list[int] = []
    while token not in stop_ids and len(out) < max_new_tokens:
        out.append(token)
        if len(out) == max_new_tokens:
            break
        k = num_draft  # always K, as vLLM counts (the tokens past max_new_tokens are dropped)
        hidden = draft.step(prev, inputs, latents, real)[:, -1:]
        real = real + inputs.shape[1]
        drafted, draft_probs = [], []
        for i in range(k):
            q = target_distributions(draft.logits(hidden)[:, -1], [params], [[*out, *drafted]])
            drafted.append(int(draw(q, [params], [rng])[0]))
            draft_probs.append(q)
            if i + 1 < k:
                hidden = draft.step(hidden, torch.tensor([[drafted[-1]]], device=device), latents, real + i)
        cache.checkpoints = {}
        cache.checkpoint_offsets = tuple(range(1, k + 1))
        with tapped_hidden_states(model, draft.taps) as tapped:
            logits = model(torch.tensor([[token, *drafted]], device=device), cache=cache).logits[0]
            features = draft.fuse(tapped)  # [1, k+1, D]
        (kept,) = accept_drafts([drafted], torch.stack(draft_probs, 1), logits[None], [params], [rng], [out])
        cache.rewind([len(kept)], k + 1)
        stats.add(k, len(kept) - 1)
        for t in kept[:-1]:
            if t in stop_ids or len(out) >= max_new_tokens:
                break
            out.append(t)
        else:
            token = kept[-1]
            prev, inputs = features[:, :len(kept)], torch.tensor([kept], device=device)
            continue
        break
    model.train(was_training)
    return out
