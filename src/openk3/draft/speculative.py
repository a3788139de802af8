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

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from openk3.cache import MLALayerCache
from openk3.draft.model import EagleDraft, tapped_hidden_states
from openk3.sampling import SamplingParams, adjust_logits, sampling_probs


def target_distribution(logits: torch.Tensor, params: SamplingParams, previous: Sequence[int] = ()) -> torch.Tensor:
    """logits [V] -> the fp32 distribution `sample_token(logits, params, g, previous)` draws from: a point mass at
    its pick when it picks greedily (greedy parameters, or no finite logit)."""
    logits = adjust_logits(logits.float().nan_to_num(nan=float("-inf")), params, previous)
    if params.greedy or not torch.isfinite(logits.max()):
        return torch.nn.functional.one_hot(torch.argmax(logits), logits.numel()).float()
    return sampling_probs(logits, params)


def draw(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from `probs` [V]; greedy parameters take the argmax without touching the generator."""
    if params.greedy:
        return int(torch.argmax(probs))
    return int(torch.multinomial(probs, 1, generator=generator))


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


def accept_drafts(drafted: Sequence[int], draft_probs: Sequence[torch.Tensor], target_logits: torch.Tensor,
                  params: SamplingParams, generator: torch.Generator, previous: Sequence[int] = ()) -> list[int]:
    """drafted: K tokens, draft_probs: the K distributions [V] they were drawn from (ignored when greedy),
    target_logits [K+1, V] (CPU): the target's logits after each of the round's K + 1 inputs. Returns the accepted
    drafts and one token from the target: 1 to K + 1 tokens, distributed as sampling them from the target one by
    one (module docstring). `previous`: the tokens generated before the round (for the penalties)."""
    out: list[int] = []
    for d, q in zip(drafted, draft_probs):
        p = target_distribution(target_logits[len(out)], params, [*previous, *out])
        if params.greedy or p.max() == 1:  # a point mass: keep the draft iff it is the target's pick
            pick = int(torch.argmax(p))
            out.append(pick)
            if pick != d:
                return out
            continue
        if float(torch.rand((), generator=generator)) * float(q[d]) < float(p[d]):
            out.append(d)
            continue
        residual = (p - q).clamp_min(0)  # q(d) > p(d) here, so it has positive mass
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    p = target_distribution(target_logits[len(out)], params, [*previous, *out])
    out.append(draw(p, params, generator))
    return out


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
    which is not returned). The same contract and sampling as `openk3.generate.generate_ids`."""
    if not prompt_ids:
        raise ValueError("the prompt must have at least one token")
    if num_draft < 1:
        raise ValueError(f"the number of draft tokens must be >= 1, got {num_draft}")
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
    stats = stats if stats is not None else SpeculationStats()
    cache = model.new_cache(1)
    ids = torch.tensor([prompt_ids], device=device)
    with tapped_hidden_states(model, draft.taps) as tapped:
        logits = model(ids, cache=cache, logits_to_keep=1).logits[0, -1]
        features = draft.fuse(tapped)  # [1, n, D]
    token = draw(target_distribution(logits.cpu(), params), params, generator)
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
            q = target_distribution(draft.logits(hidden)[0, -1].cpu(), params, [*out, *drafted])
            drafted.append(draw(q, params, generator))
            draft_probs.append(q)
            if i + 1 < k:
                hidden = draft.step(hidden, torch.tensor([[drafted[-1]]], device=device), latents, real + i)
        cache.checkpoints = {}
        cache.checkpoint_offsets = tuple(range(1, k + 1))
        with tapped_hidden_states(model, draft.taps) as tapped:
            logits = model(torch.tensor([[token, *drafted]], device=device), cache=cache).logits[0]
            features = draft.fuse(tapped)  # [1, k+1, D]
        kept = accept_drafts(drafted, draft_probs, logits.float().cpu(), params, generator, out)
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
