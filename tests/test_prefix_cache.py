"""The K3 hybrid prefix cache (SPEC §7) without a model: lookup rules, locks, retention, tiers, invariants."""

import random
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openk3.serve import prefix_cache as pc
from openk3.serve.prefix_cache import DEVICE, DISK, DROP_SCAN_PAGES, HOST, PrefixCache, PrefixCacheConfig


class Oracle:
    """Payloads that name the exact prefix they belong to, so a hit can be checked against the truth."""

    def __init__(self):
        self.ids: dict[tuple[int, ...], float] = {}

    def tag(self, prefix) -> float:
        return self.ids.setdefault(tuple(prefix), float(len(self.ids) + 1))

    def kv(self, prefix) -> torch.Tensor:
        return torch.tensor([self.tag(prefix)], dtype=torch.float64)

    def checkpoint(self, prefix) -> torch.Tensor:
        return torch.tensor([self.tag(prefix), -1.0], dtype=torch.float64)


def write(cache: PrefixCache, oracle: Oracle, tokens, start_block=0, checkpoint_every=1, lease=None, turn_end=True):
    """Append every full hash block of `tokens` after `start_block` through one lease; release it unless given."""
    h = cache.config.hash_block
    own = lease is None
    lease = lease or cache.acquire(tokens[: start_block * h], max_hit=start_block * h)
    for b in range(start_block, len(tokens) // h):
        prefix = tokens[: (b + 1) * h]
        ckpt = oracle.checkpoint(prefix) if (b + 1) % checkpoint_every == 0 else None
        cache.append(lease, tokens[b * h:(b + 1) * h], oracle.kv(prefix), ckpt)
    if turn_end:
        cache.mark_turn_boundary(lease)
    if own:
        cache.release(lease)
    return lease


def check_hit(cache: PrefixCache, oracle: Oracle, tokens, lease) -> None:
    h = cache.config.hash_block
    assert lease.hit_tokens % h == 0 and lease.hit_tokens <= len(tokens)
    assert len(lease.hit_kv) == lease.hit_tokens // h
    for b, kv in enumerate(lease.hit_kv):
        assert kv.item() == oracle.ids[tuple(tokens[: (b + 1) * h])]
    if lease.hit_tokens:
        assert lease.hit_checkpoint[0].item() == oracle.ids[tuple(tokens[: lease.hit_tokens])]


def tokens_of(rng: random.Random, n: int, vocab: int = 50) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def test_spec_example_hit_inside_a_partly_matching_physical_block():
    """SPEC §7: 2800 tokens match, the hit is 2560 = 5 x 512 inside a 6144-token block; prefill resumes there."""
    h, P = 512, 6144
    cache = PrefixCache(PrefixCacheConfig(hash_block=h, page_size=P, page_bytes=1, device_bytes=1 << 20))
    oracle, rng = Oracle(), random.Random(0)
    cached = tokens_of(rng, P)
    write(cache, oracle, cached)
    matching = 2800
    query = cached[:matching] + [t + 1000 for t in cached[matching:]]
    lease = cache.acquire(query)
    assert lease.hit_tokens == (matching // h) * h
    assert lease.hit_tokens % P != 0
    assert len(cache.pages) == 1
    check_hit(cache, oracle, query, lease)


def test_hit_at_an_end_point_of_a_partly_filled_page_and_longest_checkpointed_boundary():
    h, P = 4, 24
    cache = PrefixCache(PrefixCacheConfig(hash_block=h, page_size=P, page_bytes=1, device_bytes=1 << 20))
    oracle, rng = Oracle(), random.Random(1)
    cached = tokens_of(rng, 3 * h + 2)  # fills 3 of the page's 6 hash blocks
    write(cache, oracle, cached)
    page = next(iter(cache.pages))
    assert len(page.entries) == 3 < P // h
    lease = cache.acquire(cached + tokens_of(rng, 10))
    assert lease.hit_tokens == 3 * h
    cache.release(lease)

    sparse = tokens_of(rng, 6 * h)
    write(cache, oracle, sparse, checkpoint_every=4)  # checkpoints only after blocks 4 (and none after 5, 6)
    lease = cache.acquire(sparse + [0])
    assert lease.hit_tokens == 4 * h  # the MLA chain matches 6 blocks, the KDA phase cuts it to 4
    check_hit(cache, oracle, sparse + [0], lease)


def test_max_hit_keeps_a_token_to_prefill_and_no_hit_across_prefixes():
    h = 4
    cache = PrefixCache(PrefixCacheConfig(hash_block=h, page_size=3 * h, page_bytes=1, device_bytes=1 << 20))
    oracle, rng = Oracle(), random.Random(2)
    a = tokens_of(rng, 4 * h)
    write(cache, oracle, a)
    assert cache.acquire(a, max_hit=len(a) - 1).hit_tokens == 3 * h
    b = [a[0] + 1] + a[1:]  # differs only in the first token: shares no prefix, so nothing may hit
    assert cache.acquire(b).hit_tokens == 0


def test_hash_collision_never_hits(monkeypatch):
    monkeypatch.setattr(pc, "chain_key", lambda parent, tokens: b"same-key")
    h = 4
    cache = PrefixCache(PrefixCacheConfig(hash_block=h, page_size=3 * h, page_bytes=1, device_bytes=1 << 20))
    oracle = Oracle()
    a, b = [1] * (2 * h), [2] * (2 * h)
    write(cache, oracle, a)
    assert cache.acquire(b).hit_tokens == 0
    lease = cache.acquire(b)
    assert not cache.append(lease, b[:h], oracle.kv(b[:h]), oracle.checkpoint(b[:h]))


def test_locked_pages_survive_eviction_until_released():
    h, P = 4, 8
    cfg = PrefixCacheConfig(hash_block=h, page_size=P, page_bytes=100, device_bytes=10_000)
    cache, oracle, rng = PrefixCache(cfg), Oracle(), random.Random(3)
    held, free = tokens_of(rng, 4 * h), tokens_of(rng, 4 * h)
    write(cache, oracle, held)
    write(cache, oracle, free)
    lease = cache.acquire(held + [0])
    assert lease.hit_tokens == 4 * h
    cache.evict(cache.used[DEVICE])
    assert lease.pages and lease.pages <= cache.pages
    assert cache.acquire(free).hit_tokens == 0
    cache.release(lease)
    cache.evict(cache.used[DEVICE])
    assert not cache.pages and cache.used == [0, 0, 0]


def test_writer_locks_its_page_and_a_full_cache_stops_caching_instead_of_evicting_it():
    h, P = 4, 8
    ckpt = 16  # a checkpoint payload of 2 float64
    cfg = PrefixCacheConfig(hash_block=h, page_size=P, page_bytes=100, device_bytes=2 * 100 + 4 * ckpt)
    cache, oracle, rng = PrefixCache(cfg), Oracle(), random.Random(4)
    tokens = tokens_of(rng, 6 * h)
    lease = write(cache, oracle, tokens, lease=cache.acquire([]), turn_end=False)
    assert lease.detached  # the third page does not fit and the two written are locked
    assert cache.used[DEVICE] <= cfg.device_bytes
    cache.release(lease)
    assert cache.acquire(tokens).hit_tokens == 2 * P


def test_retention_drops_mid_turn_checkpoints_first_and_keeps_turn_and_newest():
    h, P, ckpt = 4, 16, 16  # a checkpoint payload of 2 float64 = 16 bytes
    cfg = PrefixCacheConfig(hash_block=h, page_size=P, page_bytes=100, device_bytes=100 + 4 * ckpt)
    cache, oracle, rng = PrefixCache(cfg), Oracle(), random.Random(5)
    turn1 = tokens_of(rng, 2 * h)
    write(cache, oracle, turn1)  # blocks 1, 2: block 2 ends turn 1
    turn2 = turn1 + tokens_of(rng, 2 * h)
    lease = cache.acquire(turn2, max_hit=2 * h)
    write(cache, oracle, turn2, start_block=2, lease=lease)  # blocks 3, 4: block 3 is mid-turn
    cache.release(lease)
    entries = {e.depth: e for e in next(iter(cache.pages)).entries}
    assert cache.used[DEVICE] == 100 + 4 * ckpt
    cache.evict(2 * ckpt)
    assert entries[1].checkpoint is None and entries[3].checkpoint is None  # mid-turn ones
    assert entries[2].checkpoint.turn_boundary and entries[4].checkpoint is not None  # turn end, newest
    assert cache.stats.dropped_checkpoints == 2 and cache.stats.evicted_pages == 0
    assert cache.acquire(turn1 + [0]).hit_tokens == 2 * h


def test_a_full_tier_whose_oldest_pages_hold_only_turn_checkpoints_evicts_instead_of_scanning_them_all():
    """Past DROP_SCAN_PAGES of the oldest pages without a mid-turn checkpoint, room comes from evicting the oldest
    page: the search for a checkpoint to drop does not walk every page of a full tier for every block."""
    h, P, ckpt = 4, 16, 16
    old = DROP_SCAN_PAGES + 6
    cfg = PrefixCacheConfig(hash_block=h, page_size=P, page_bytes=100,
                            device_bytes=old * (100 + ckpt) + 2 * 100 + 8 * ckpt)
    cache, oracle, rng = PrefixCache(cfg), Oracle(), random.Random(9)
    for _ in range(old):  # one page each, its only checkpoint the turn's end
        write(cache, oracle, tokens_of(rng, P, vocab=1000), checkpoint_every=P // h)
    newest = tokens_of(rng, 2 * P, vocab=1000)
    write(cache, oracle, newest)  # two pages, a checkpoint at every block (mid-turn but the last)
    assert cache.used[DEVICE] == cfg.device_bytes
    cache.evict(ckpt)
    assert cache.stats.evicted_pages == 1 and cache.stats.dropped_checkpoints == 0
    assert cache.acquire(newest[: P + h] + [0]).hit_tokens == P + h  # the newest chain's mid-turn checkpoints stay


def test_a_writer_drops_its_own_mid_turn_checkpoints_to_keep_caching():
    """Sequences prefilling together lock their pages; their mid-turn checkpoints still give way to newer ones, so
    a tier with room for their pages keeps the whole chains (the deepest checkpoint of each) instead of detaching."""
    h, P, ckpt = 4, 16, 16
    cfg = PrefixCacheConfig(hash_block=h, page_size=P, page_bytes=100, device_bytes=2 * 100 + 3 * ckpt)
    cache, oracle, rng = PrefixCache(cfg), Oracle(), random.Random(6)
    prompts = [tokens_of(rng, P), tokens_of(rng, P)]
    leases = [cache.acquire([]) for _ in prompts]
    for b in range(P // h):  # interleaved, as a batched prefill registers them: 8 checkpoints, room for 3
        for tokens, lease in zip(prompts, leases):
            prefix = tokens[: (b + 1) * h]
            cache.append(lease, tokens[b * h:(b + 1) * h], oracle.kv(prefix), oracle.checkpoint(prefix))
    assert not any(lease.detached for lease in leases)
    assert cache.stats.dropped_checkpoints == 8 - 3 and cache.used[DEVICE] <= cfg.device_bytes
    for lease in leases:
        cache.mark_turn_boundary(lease)
        cache.release(lease)
    for tokens in prompts:
        hit = cache.acquire(tokens + [0])
        assert hit.hit_tokens == P
        check_hit(cache, oracle, tokens, hit)
        cache.release(hit)


@pytest.mark.parametrize("with_disk", [False, True])
def test_evicted_pages_move_to_host_and_disk_and_come_back_intact(with_disk):
    h, P = 4, 8
    with tempfile.TemporaryDirectory() as tmp:
        cfg = PrefixCacheConfig(hash_block=h, page_size=P, page_bytes=100, device_bytes=300,
                                host_bytes=600 if not with_disk else 150,
                                disk_dir=tmp if with_disk else None, disk_bytes=10_000)
        cache, oracle, rng = PrefixCache(cfg), Oracle(), random.Random(6)
        seqs = [tokens_of(rng, 2 * P) for _ in range(3)]
        for s in seqs:
            write(cache, oracle, s)
        tiers = {p.tier for p in cache.pages}
        assert HOST in tiers and (DISK in tiers) == with_disk
        for s in seqs:
            lease = cache.acquire(s + [0])
            assert lease.hit_tokens == 2 * P
            check_hit(cache, oracle, s, lease)
            assert all(p.tier == DEVICE for p in lease.pages)
            cache.release(lease)
        assert cache.stats.promoted_pages > 0


# ---- property test over random operation sequences ---------------------------------------------------------

def check_invariants(cache: PrefixCache, leases) -> None:
    cfg = cache.config
    used = [0, 0, 0]
    live = [lease for lease in leases if not lease.released]
    for page in cache.pages:
        used[page.tier] += cfg.page_bytes + page.checkpoint_bytes()
        assert page.entries, "no empty page is kept"
        assert page.locks == sum(page in lease.pages for lease in live)
        if page.locks:
            assert page.tier == DEVICE, "locked (hit or written) pages stay on the device"
        if page.parent_page is not None:
            assert page.parent_page in cache.pages and page.parent_page.tier <= page.tier
        for prev, entry in zip(page.entries, page.entries[1:]):
            assert entry.parent is prev
        for entry in page.entries:
            assert entry.page is page and entry.depth <= page.end_block
            assert entry.depth > page.end_block - cfg.blocks_per_page
            level = cache.roots if entry.parent is None else entry.parent.children
            assert level[entry.key] is entry
            if entry.parent is not None:
                assert entry.parent.page in cache.pages  # a prefix never outlives... nor is outlived by its parent
            below = sum(c.checkpoint is not None for c in _descendants(entry))
            assert entry.checkpoints_below == below
            pinned = entry.pins or any(c.pins for c in _descendants(entry))  # a live lease is writing below
            assert entry.checkpoint is not None or below or pinned, "no KV without a checkpoint to use it"
            if page.tier == DISK:
                assert entry.kv is None
            else:
                assert entry.kv is not None and (entry.checkpoint is None or entry.checkpoint.payload is not None)
    assert used == cache.used
    for tier in (DEVICE, HOST, DISK):
        assert cache.used[tier] <= cache.capacity(tier)


def _descendants(entry):
    for child in entry.children.values():
        yield child
        yield from _descendants(child)


OPS = st.lists(
    st.tuples(st.sampled_from(["acquire", "acquire", "append", "append", "append", "release", "evict", "mark"]),
              st.integers(0, 7), st.integers(0, 40), st.booleans()),
    min_size=20, max_size=80,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, seed=st.integers(0, 2**16), tiers=st.sampled_from(["device", "host", "disk"]))
def test_random_operation_sequences_keep_the_invariants(ops, seed, tiers):
    h, P = 2, 6
    rng = random.Random(seed)
    trunk = tokens_of(rng, 30, vocab=3)  # few distinct tokens: prefixes are shared and branch a lot
    seqs = [trunk[: rng.randrange(0, 30)] + tokens_of(rng, 20, vocab=3) for _ in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = PrefixCacheConfig(hash_block=h, page_size=P, page_bytes=64, device_bytes=64 * 4 + 16 * 6,
                                host_bytes=0 if tiers == "device" else 64 * 3,
                                disk_dir=tmp if tiers == "disk" else None, disk_bytes=64 * 4 + 16 * 8)
        cache, oracle = PrefixCache(cfg), Oracle()
        leases, writing = [], {}  # lease -> (sequence, next block)
        for op, which, amount, flag in ops:
            if op == "acquire":
                seq = seqs[which]
                lease = cache.acquire(seq, max_hit=amount)
                check_hit(cache, oracle, seq, lease)
                assert lease.hit_tokens <= amount
                leases.append(lease)
                writing[lease] = (seq, lease.hit_tokens // h)
            elif op == "append" and writing:
                lease = list(writing)[which % len(writing)]
                seq, first = writing[lease]
                for block in range(first, min(first + 1 + amount % 8, len(seq) // h)):  # flag: every block
                    prefix = seq[: (block + 1) * h]
                    checkpoint = oracle.checkpoint(prefix) if flag or block % 3 == 2 else None
                    ok = cache.append(lease, seq[block * h:(block + 1) * h], oracle.kv(prefix), checkpoint)
                    assert ok != lease.detached
                    writing[lease] = (seq, block + 1)
            elif op == "release" and writing:
                lease = list(writing)[which % len(writing)]
                cache.release(lease)
                del writing[lease]
            elif op == "mark" and writing:
                cache.mark_turn_boundary(list(writing)[which % len(writing)])
            elif op == "evict":
                cache.evict(min(amount * 8, cache.used[DEVICE]))
            check_invariants(cache, leases)
        for lease in list(writing):
            cache.release(lease)
        check_invariants(cache, leases)
        cache.evict(cache.used[DEVICE])
        assert all(p.tier != DEVICE for p in cache.pages), "with nothing locked everything can leave the device"


def test_chain_key_is_blake2b_of_signed_little_endian_words():
    """The key format stays what disk tiers written earlier hold: H(parent) updated with each token as a signed
    64-bit little-endian word (image keys are negative)."""
    import hashlib

    from openk3.serve.prefix_cache import chain_key

    for parent, tokens in ((b"", [0, 1, 32767]), (b"\x01" * 16, [-(2**40), 2**62, -1]), (b"\x02" * 16, [])):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
        assert chain_key(parent, tokens) == digest.digest()
