"""Greedy and temperature sampling of a batch of logits rows in one Triton launch (one program per row): the common
case of `openk3.sampling.sample_tokens` (its reference), rows without top-k / top-p cuts, bias or penalties; and
speculative decoding's rejection sampling for such rows (`reject_rows_triton`, the reference
`openk3.draft.speculative.accept_drafts`), one launch per round instead of some forty small operations.

Per row, three passes over the vocabulary in blocks:
1. the largest logit m and the first index holding it (NaN read as -inf);
2. Z = sum_j exp((x_j - m) / T) (exp in fp32, sums in fp64);
3. the drawn token: the number of tokens whose cumulative mass is <= u Z (u the row's uniform), i.e. the first token
   whose cumulative mass exceeds u Z, as `draw_by_inversion` finds it, and never past the last token of positive
   mass (the two sums may differ in their last bit).
A row with T = 0 (greedy) or no finite largest logit (+inf wins outright; all -inf leaves nothing) takes the argmax.

Rows with top-k / top-p cuts (`sample_rows_cut_triton`) need the k-th largest scaled logit and the nucleus's last
one, which the reference finds by sorting the vocabulary (7.6 ms a step at 256 rows of 163,840 logits on an H100).
Here they come from radix selection over the logits' order-preserving 32-bit keys, 4 bits a pass (eight passes over
the row each): per pass, the count (top-k) or the mass (top-p) of the tokens under each next digit, among those
whose higher bits are already known, picks the digit where the running sum from the top reaches k or top_p x Z. The
nucleus's last key may be shared by several tokens; those are kept in index order while the mass before them stays
below top_p x Z, as the reference's stable sort keeps them. The draw then is the same inversion over the kept tokens.
The masses are the reference's up to fp32 rounding (exp, and no division by Z: the reference normalises in fp32), so
a uniform within ~1e-7 (relative) of a boundary between two tokens may pick the neighbour; u Z is kept below Z, as
the reference keeps it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.transfer import queued

BLOCK_V = 4096  # vocabulary entries per loop step


@triton.jit
def _load_row(base, start, cols, V):
    """One block of a logits row in fp32, NaN and the columns past V read as -inf."""
    x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
    return tl.where(x == x, x, float("-inf"))


@triton.jit
def _row_max(base, V, BLOCK: tl.constexpr):
    """(the largest logit, the first index holding it) of a row."""
    cols = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_at = tl.zeros([], tl.int64)
    for start in range(0, V, BLOCK):
        x = _load_row(base, start, cols, V)
        block_best = tl.max(x, axis=0)
        at = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start
        better = block_best > best
        best_at = tl.where(better, at, best_at)
        best = tl.where(better, block_best, best)
    return best, best_at


@triton.jit
def _masses(x, idx, best, t, point, at):
    """Unnormalised probabilities (fp64) of the tokens `idx` with logits x: exp((x - best) / t), or a point mass at
    `at` (greedy rows, rows without a finite largest logit)."""
    return tl.where(point, (idx == at).to(tl.float64), tl.exp((x - best) / t).to(tl.float64))


@triton.jit
def _row_total(base, V, best, t, point, at, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    total = tl.zeros([], tl.float64)
    for start in range(0, V, BLOCK):
        total += tl.sum(_masses(_load_row(base, start, cols, V), start + cols, best, t, point, at), axis=0)
    return total


@triton.jit
def _row_distribution(base, V, t, greedy, greedy_at, BLOCK: tl.constexpr):
    """(largest logit, point-mass flag, its token, total mass) of a row's distribution at temperature t: a point
    mass for greedy rows (at `greedy_at` where >= 0, else at the argmax) and rows without a finite largest logit."""
    best, at = _row_max(base, V, BLOCK)
    point = greedy | (tl.abs(best) == float("inf"))
    at = tl.where(greedy & (greedy_at >= 0), greedy_at, at)
    return best, point, at, _row_total(base, V, best, t, point, at, BLOCK)


@triton.jit
def _probability(base, token, best, t, point, at, total):
    x = tl.load(base + token).to(tl.float32)
    return _masses(tl.where(x == x, x, float("-inf")), token, best, t, point, at) / total


@triton.jit
def _residual(p_base, q_base, start, cols, V, t, with_q, p_best, p_point, p_at, p_total, q_best, q_point, q_at,
              q_total):
    """One block of max(0, p - q) (of p alone where not `with_q`), zero past V."""
    idx = start + cols
    p = _masses(_load_row(p_base, start, cols, V), idx, p_best, t, p_point, p_at) / p_total
    q = _masses(_load_row(q_base, start, cols, V), idx, q_best, t, q_point, q_at) / q_total
    return tl.where(idx < V, tl.maximum(p - tl.where(with_q, q, 0.0), 0.0), 0.0)


@triton.jit
def _inversion_step(e, start, cols, V, target, below, last, running):
    """One block of a draw by inversion (masses e, fp64, in index order): (tokens whose cumulative mass is <=
    target, the last token of positive mass, the running mass) carried past the block."""
    cdf = running + tl.cumsum(e, axis=0)
    below += tl.sum(((cdf <= target) & (start + cols < V)).to(tl.int64), axis=0)
    last = tl.maximum(last, tl.max(tl.where(e > 0, start + cols, 0), axis=0).to(tl.int64))
    return below, last, running + tl.sum(e, axis=0)


@triton.jit
def _sample_kernel(logits_ptr, params_ptr, out_ptr, V, stride, BLOCK: tl.constexpr):
    # (as run on the H200, bench/decode_profile_runs/20-device-sampling.log; `_reject_kernel` builds on the helpers)
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    temperature = tl.load(params_ptr + 2 * row)
    u = tl.load(params_ptr + 2 * row + 1)
    cols = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_at = tl.zeros([], tl.int64)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x == x, x, float("-inf"))  # NaN is never chosen
        block_best = tl.max(x, axis=0)
        at = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start
        better = block_best > best
        best_at = tl.where(better, at, best_at)
        best = tl.where(better, block_best, best)
    token = best_at
    if (temperature > 0) & (tl.abs(best) < float("inf")):
        t = temperature.to(tl.float32)
        total = tl.zeros([], tl.float64)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            e = tl.exp((tl.where(x == x, x, float("-inf")) - best) / t).to(tl.float64)
            total += tl.sum(e, axis=0)
        target = tl.minimum(u * total, total * (1 - 2.0**-52))
        below = tl.zeros([], tl.int64)
        last = tl.zeros([], tl.int64)  # the last token of positive mass: the draw never goes past it
        running = tl.zeros([], tl.float64)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            e = tl.exp((tl.where(x == x, x, float("-inf")) - best) / t).to(tl.float64)
            below, last, running = _inversion_step(e, start, cols, V, target, below, last, running)
        token = tl.minimum(below, last)
    tl.store(out_ptr + row, token)


@triton.jit
def _reject_kernel(draft_ptr, target_ptr, params_ptr, out_ptr, V, draft_row, draft_pos, target_row, target_pos,
                   K: tl.constexpr, BLOCK: tl.constexpr):
    """One sequence's rejection sampling over K drafts (`openk3.draft.speculative.accept_drafts`, the reference):
    params per row = [temperature (0: greedy), u_0 .. u_K, d_0 .. d_{K-1}] in fp64."""
    row = tl.program_id(0).to(tl.int64)
    params = params_ptr + row * (2 * K + 2)
    temperature = tl.load(params)
    greedy = temperature == 0
    t = tl.where(greedy, 1.0, temperature).to(tl.float32)
    accepted = tl.zeros([], tl.int64)
    going = tl.full([], 1, tl.int1)
    for i in tl.static_range(K):
        d = tl.load(params + K + 2 + i).to(tl.int64)
        p_base = target_ptr + row * target_row + i * target_pos
        p_best, p_point, p_at, p_total = _row_distribution(p_base, V, t, greedy, -1, BLOCK)
        q_base = draft_ptr + row * draft_row + i * draft_pos
        # a greedy row's draft is a point mass at the drafted token
        q_best, q_point, q_at, q_total = _row_distribution(q_base, V, t, greedy, d, BLOCK)
        p_d = _probability(p_base, d, p_best, t, p_point, p_at, p_total)
        q_d = _probability(q_base, d, q_best, t, q_point, q_at, q_total)
        going = going & (tl.load(params + 1 + i) * q_d < p_d)
        accepted += going.to(tl.int64)
    # the last token: from max(0, p_a - q_a), q_K = 0 (the bonus token's p_K)
    cols = tl.arange(0, BLOCK)
    with_q = accepted < K
    a = tl.minimum(accepted, K - 1)
    p_base = target_ptr + row * target_row + accepted * target_pos
    p_best, p_point, p_at, p_total = _row_distribution(p_base, V, t, greedy, -1, BLOCK)
    q_base = draft_ptr + row * draft_row + a * draft_pos
    q_best, q_point, q_at, q_total = _row_distribution(q_base, V, t, greedy, tl.load(params + K + 2 + a).to(tl.int64),
                                                       BLOCK)
    total = tl.zeros([], tl.float64)
    p_sum = tl.zeros([], tl.float64)
    for start in range(0, V, BLOCK):
        total += tl.sum(_residual(p_base, q_base, start, cols, V, t, with_q, p_best, p_point, p_at, p_total, q_best,
                                  q_point, q_at, q_total), axis=0)
        p_sum += tl.sum(_residual(p_base, q_base, start, cols, V, t, False, p_best, p_point, p_at, p_total, q_best,
                                  q_point, q_at, q_total), axis=0)
    with_q = with_q & (total > 0)  # no residual mass (a draft the draft could not have drawn): p_a itself
    total = tl.where(with_q, total, p_sum)
    target = tl.minimum(tl.load(params + 1 + K) * total, total * (1 - 2.0**-52))
    below = tl.zeros([], tl.int64)
    last = tl.zeros([], tl.int64)
    running = tl.zeros([], tl.float64)
    for start in range(0, V, BLOCK):
        r = _residual(p_base, q_base, start, cols, V, t, with_q, p_best, p_point, p_at, p_total, q_best, q_point,
                      q_at, q_total)
        below, last, running = _inversion_step(r, start, cols, V, target, below, last, running)
    tl.store(out_ptr + 2 * row, accepted)
    tl.store(out_ptr + 2 * row + 1, tl.minimum(below, last))


# vocabulary entries a step of the cut kernel's selection passes take: [16, SELECT_BLOCK] fp32 sums a program
# (sm_90, triton 3.6, 8 warps: 512 spilled 80 bytes a thread at 128 registers)
SELECT_BLOCK = 256


@triton.jit
def _sort_keys(z):
    """fp32 values -> uint32 keys in the same order (-0.0 just below +0.0, -inf below every finite value)."""
    bits = z.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)


@triton.jit
def _key_value(key):
    """The fp32 value of a `_sort_keys` key."""
    return tl.where((key >> 31) != 0, key & 0x7FFFFFFF, ~key).to(tl.float32, bitcast=True)


@triton.jit
def _scaled_row(base, start, cols, V, best, t):
    """One block of a row's (x - best) / t (fp32, as `sampling_probs` scales them; -inf past V and for NaN) and
    their keys."""
    z = (_load_row(base, start, cols, V) - best) / t
    return z, _sort_keys(z)


@triton.jit
def _digit_sums(base, V, best, t, prefix, known, shift, floor_key, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """For each 4-bit digit d at bit `shift`: the mass exp(z) (MASS) or the number of the row's tokens whose key is
    >= floor_key, has `prefix`'s bits where `known` is set, and digit d; [16] fp64, summed per lane in fp32 (as
    exact as the reference's fp32 cumulative sum; counts exact below 2^24 a lane)."""
    cols = tl.arange(0, BLOCK)
    digits = tl.arange(0, 16)
    sums = tl.zeros([16, BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        z, key = _scaled_row(base, start, cols, V, best, t)
        live = (start + cols < V) & ((key & known) == prefix) & (key >= floor_key)
        if MASS:
            weight = tl.exp(z)
        else:
            weight = tl.full([BLOCK], 1.0, tl.float32)
        at = (((key >> shift) & 15).to(tl.int32)[None, :] == digits[:, None]) & live[None, :]
        sums += tl.where(at, weight[None, :], 0.0)
    return tl.sum(sums.to(tl.float64), axis=1)


@triton.jit
def _select_key(base, V, best, t, floor_key, goal, MASS: tl.constexpr, SELECT: tl.constexpr):
    """Radix selection, 4 bits a pass from the top: walking the tokens with key >= floor_key from the largest key
    down, the key b at which their summed count or mass (MASS) first reaches `goal`, and that sum over the keys
    above b (all keys above b, and b's own, sum to >= goal; without b's, to < goal). Where rounding leaves the
    whole row's sum short of goal, b is below every key (all are taken)."""
    prefix = tl.zeros([], tl.uint32)
    known = tl.zeros([], tl.uint32)
    above = tl.zeros([], tl.float64)
    digits = tl.arange(0, 16)
    for i in tl.static_range(8):
        shift = 28 - 4 * i
        sums = _digit_sums(base, V, best, t, prefix, known, shift, floor_key, MASS, SELECT)
        from_top = tl.sum(tl.where(digits[None, :] >= digits[:, None], sums[None, :], 0.0), axis=1)  # digits >= d
        digit = tl.maximum(tl.max(tl.where(above + from_top >= goal, digits, -1), axis=0), 0)
        above += tl.sum(tl.where(digits > digit, sums, 0.0), axis=0)
        prefix = prefix | (digit.to(tl.uint32) << shift)
        known = known | (15 << shift)
    return prefix, above


@triton.jit
def _kept_block(key, valid, bound, ties_before, ties_kept):
    """Of one block in index order: the tokens kept (key above `bound`, or at it among its first `ties_kept` in
    index order, ties_before of them in earlier blocks) and the ties counted so far."""
    at = valid & (key == bound)
    rank = ties_before + tl.cumsum(at.to(tl.int64), axis=0) - at.to(tl.int64)
    return valid & ((key > bound) | (at & (rank < ties_kept))), ties_before + tl.sum(at.to(tl.int64), axis=0)


@triton.jit
def _sample_cut_kernel(logits_ptr, params_ptr, out_ptr, V, stride, BLOCK: tl.constexpr, SELECT: tl.constexpr):
    """One row's draw under temperature, top-k and top-p (`sampling_probs` then `draw_by_inversion`, the reference):
    params per row = [temperature (0: greedy), u, top_p (>= 1: none), top_k (0: none)] in fp64. The k-th largest
    scaled logit and the nucleus's last key come from radix selection (`_select_key`) instead of a sort; the
    nucleus's ties at its last key are taken in index order (the reference's stable sort)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    temperature = tl.load(params_ptr + 4 * row)
    u = tl.load(params_ptr + 4 * row + 1)
    top_p = tl.load(params_ptr + 4 * row + 2)
    top_k = tl.load(params_ptr + 4 * row + 3).to(tl.int64)
    best, token = _row_max(base, V, BLOCK)
    if (temperature > 0) & (tl.abs(best) < float("inf")):
        t = temperature.to(tl.float32)
        cols = tl.arange(0, BLOCK)
        floor_key = tl.zeros([], tl.uint32)
        if (top_k > 0) & (top_k < V):  # the reference keeps every logit >= the k-th largest
            floor_key, _ = _select_key(base, V, best, t, floor_key, top_k.to(tl.float64), False, SELECT)
        bound = floor_key
        ties_kept = tl.zeros([], tl.int64) + V
        if top_p < 1:
            total = tl.zeros([], tl.float64)
            for start in range(0, V, BLOCK):
                z, key = _scaled_row(base, start, cols, V, best, t)
                total += tl.sum(tl.where(key >= floor_key, tl.exp(z).to(tl.float64), 0.0), axis=0)
            goal = top_p * total
            bound, above = _select_key(base, V, best, t, floor_key, goal, True, SELECT)
            # the bound's ties, each of mass m, in index order: the r-th (from 0) is kept while above + r m < goal
            m = tl.exp(_key_value(bound)).to(tl.float64)
            ties_kept = tl.minimum(tl.ceil((goal - above) / m), V).to(tl.int64)
        total = tl.zeros([], tl.float64)
        ties = tl.zeros([], tl.int64)
        for start in range(0, V, BLOCK):
            z, key = _scaled_row(base, start, cols, V, best, t)
            kept, ties = _kept_block(key, start + cols < V, bound, ties, ties_kept)
            total += tl.sum(tl.where(kept, tl.exp(z).to(tl.float64), 0.0), axis=0)
        target = tl.minimum(u * total, total * (1 - 2.0**-52))
        below = tl.zeros([], tl.int64)
        last = tl.zeros([], tl.int64)  # the last kept token of positive mass: the draw never goes past it
        running = tl.zeros([], tl.float64)
        ties = tl.zeros([], tl.int64)
        for start in range(0, V, BLOCK):
            z, key = _scaled_row(base, start, cols, V, best, t)
            kept, ties = _kept_block(key, start + cols < V, bound, ties, ties_kept)
            e = tl.where(kept, tl.exp(z).to(tl.float64), 0.0)
            below, last, running = _inversion_step(e, start, cols, V, target, below, last, running)
        token = tl.minimum(below, last)
    tl.store(out_ptr + row, token)


def _block(V: int) -> int:
    return min(BLOCK_V, triton.next_power_of_2(V))


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def sample_rows_triton(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype), temperature [B] (0: greedy), u [B] in [0, 1) -> one token per row [B]
    (int64), on the logits' device. The per-row parameters travel in one host-to-device copy."""
    logits = _last_contiguous(logits)
    B, V = logits.shape
    params = queued(torch.stack([temperature.double().cpu(), u.double().cpu()], dim=1), logits.device)
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        _sample_kernel[(B,)](logits, params, out, V, logits.stride(0), BLOCK=_block(V))
    return out


def sample_rows_cut_triton(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, top_p: torch.Tensor,
                           top_k: torch.Tensor) -> torch.Tensor:
    """`sample_rows_triton` with each row's top-k and top-p cuts: top_p [B] (>= 1: none), top_k [B] (0 or >= V:
    none). The same draw as `openk3.sampling`'s reference up to fp32 rounding."""
    logits = _last_contiguous(logits)
    B, V = logits.shape
    params = torch.stack([temperature.double().cpu(), u.double().cpu(), top_p.double().cpu(), top_k.double().cpu()],
                         dim=1)
    params = queued(params, logits.device)
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        _sample_cut_kernel[(B,)](logits, params, out, V, logits.stride(0), BLOCK=_block(V),
                                 SELECT=min(SELECT_BLOCK, _block(V)), num_warps=8)
    return out


def reject_rows_triton(draft_logits: torch.Tensor, target_logits: torch.Tensor, drafted: torch.Tensor,
                       temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rejection sampling of a batch, one program per row: draft_logits [B, K, V] (the logits each draft was
    drawn from at temperature alone), target_logits [B, K+1, V], drafted [B, K] ids, temperature [B] (0: greedy),
    u [B, K+1] in [0, 1) (u_i decides draft i, u_K draws the last token) -> [B, 2] int64 on the device: the
    accepted drafts a and the last token, drawn from max(0, p_a - q_a) (p_K at a = K; p_a where that has no
    mass). The same arithmetic as `accept_drafts` with the draft's distributions from `target_distributions`, up
    to fp32 rounding."""
    draft_logits, target_logits = _last_contiguous(draft_logits), _last_contiguous(target_logits)
    B, K, V = draft_logits.shape
    params = torch.cat([temperature.double().cpu().view(B, 1), u.double().cpu(), drafted.double().cpu()], dim=1)
    params = queued(params, target_logits.device)
    out = torch.empty(B, 2, dtype=torch.int64, device=target_logits.device)
    if B:
        _reject_kernel[(B,)](draft_logits, target_logits, params, out, V, draft_logits.stride(0),
                             draft_logits.stride(1), target_logits.stride(0), target_logits.stride(1), K=K,
                             BLOCK=_block(V))
    return out
