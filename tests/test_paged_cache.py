"""The paged latent cache without a model: the page pool's references, block tables, the KDA state pool, and the
prefix cache in paged mode (hits share physical pages by reference; eviction, tiers and locks keep their
guarantees) under random operation sequences whose page contents name the prefix they belong to."""

import random
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from openk3.cache.paged import NULL_PAGE, BlockTables, PagePool
from openk3.cache.state_pool import StatePool
from openk3.config import get_preset
from openk3.serve.prefix_cache import DEVICE, PrefixCache, PrefixCacheConfig


def test_page_pool_references_and_copies():
    pool = PagePool(2, 4, page_size=3, width=2)
    assert pool.num_free == 3 and pool.page_bytes == 2 * 3 * 2 * 4
    a, b, c = pool.alloc(), pool.alloc(), pool.alloc()
    assert NULL_PAGE not in (a, b, c) and pool.alloc() is None
    pool.pages[:, a] = torch.arange(12.0).view(2, 3, 2)
    pool.retain(a)
    pool.release(a)
    assert pool.num_free == 0
    pool.release(a)
    assert pool.num_free == 1
    with pytest.raises(ValueError, match="free"):
        pool.release(a)
    pool.copy_prefix(b, c, 0)
    content = torch.randn(2, 3, 2)
    d = pool.write(content)
    assert d == a and torch.equal(pool.read(d), content)  # a freed page is reused
    pool.copy_prefix(d, b, 2)
    assert torch.equal(pool.pages[:, b, :2], content[:, :2]) and not pool.pages[:, b, 2].any()
    pool.release(NULL_PAGE)  # the null page is never freed
    assert pool.refs[NULL_PAGE] == 1


def test_block_tables_mirror_the_device_rows():
    tables = BlockTables(num_slots=3, max_pages=4)
    tables.set(1, [5, 2])
    tables.append(1, 7)
    tables.replace_last(1, 9)
    assert tables.pages[1] == [5, 2, 9] and tables.tables[1].tolist() == [5, 2, 9, NULL_PAGE]
    assert tables.clear(1) == [5, 2, 9] and not tables.tables.any()
    assert tables.padding_slot == 3
    with pytest.raises(ValueError):
        tables.set(0, [1] * 5)


def test_state_pool_slots_snapshots_and_loads():
    cfg = get_preset("k3-tiny")
    states = StatePool(cfg, num_slots=2)
    assert states.recurrent.shape == (len(cfg.kda_layers), 3, 4, 32, 32) and states.recurrent.dtype == torch.float32
    s = states.alloc()
    states.recurrent[:, s].normal_()
    states.conv[:, s].normal_()
    ckpt = states.snapshot(s)
    other = states.alloc()
    assert states.alloc() is None and not states.recurrent[:, other].any()
    states.load(other, ckpt)
    assert torch.equal(states.recurrent[:, other], ckpt["recurrent"]) and torch.equal(states.conv[:, other],
                                                                                       ckpt["conv"])
    states.recurrent[:, s].zero_()
    assert ckpt["recurrent"].any()  # a snapshot is a copy
    states.free(s)
    with pytest.raises(ValueError):
        states.free(s)
    assert not states.recurrent[:, states.alloc()].any()  # a slot comes back zeroed


# ---- the prefix cache in paged mode under random operations -------------------------------------------------

class Sequence:
    """A simulated running sequence: its lease and block table, writing oracle values into its pages."""

    def __init__(self, cache, pool, tokens, max_hit):
        self.cache, self.pool, self.tokens = cache, pool, tokens
        self.lease = cache.acquire(tokens, max_hit=max_hit)
        self.pages = list(self.lease.hit_pages)
        for pid in self.pages:
            pool.retain(pid)
        hit, P = self.lease.hit_tokens, cache.config.page_size
        if hit % P and not self.lease.owns_tail:  # copy-on-write of the hit's part of a page another writes
            own = alloc(cache, pool)
            pool.copy_prefix(self.pages[-1], own, hit % P)
            pool.release(self.pages[-1])
            self.pages[-1] = own
        self.fed = hit

    def write_block(self, oracle, checkpoint: bool, turn_boundary: bool = False) -> bool:
        h, P = self.cache.config.hash_block, self.cache.config.page_size
        if self.fed + h > len(self.tokens) or self.lease.detached:
            return False
        if len(self.pages) * P < self.fed + h:
            self.pages.append(alloc(self.cache, self.pool))
        for t in range(self.fed, self.fed + h):
            self.pool.pages[0, self.pages[t // P], t % P, 0] = oracle.tag(self.tokens[: t + 1])
        self.fed += h
        ckpt = torch.tensor([oracle.tag(self.tokens[: self.fed])], dtype=torch.float64) if checkpoint else None
        return self.cache.append(self.lease, self.tokens[self.fed - h:self.fed], None, ckpt,
                                 turn_boundary=turn_boundary, page=self.pages[-1]
                                 if (self.fed - 1) // P == len(self.pages) - 1 else self.pages[(self.fed - 1) // P])

    def finish(self):
        self.cache.release(self.lease)
        for pid in self.pages:
            self.pool.release(pid)
        self.pages = []


def alloc(cache, pool) -> int:
    pid = pool.alloc()
    while pid is None and cache.evict_page():
        pid = pool.alloc()
    assert pid is not None, "the test pool is sized so that running sequences always fit"
    return pid


class Oracle:
    def __init__(self):
        self.ids = {}

    def tag(self, prefix) -> float:
        return self.ids.setdefault(tuple(prefix), float(len(self.ids) + 1))


def check_hit_contents(seq: Sequence, oracle: Oracle) -> None:
    """Every position of the hit, read through the shared pages, holds the value of exactly that prefix."""
    P = seq.cache.config.page_size
    for t in range(seq.lease.hit_tokens):
        value = seq.pool.pages[0, seq.lease.hit_pages[t // P], t % P, 0].item()
        assert value == oracle.ids[tuple(seq.tokens[: t + 1])]
    if seq.lease.hit_tokens:
        assert seq.lease.hit_checkpoint.item() == oracle.ids[tuple(seq.tokens[: seq.lease.hit_tokens])]


def check_references(cache, pool, running) -> None:
    held = [0] * pool.num_pages
    held[NULL_PAGE] = 1
    for seq in running:
        for pid in seq.pages:
            held[pid] += 1
    for page in cache.pages:
        assert (page.phys is not None) == (page.tier == DEVICE)
        assert page.locks == sum(page in s.lease.pages for s in running)
        if page.phys is not None:
            held[page.phys] += 1
    assert held == pool.refs
    for tier in range(3):
        assert cache.used[tier] <= cache.capacity(tier)


def check_structure(cache, running) -> None:
    """The cache's own invariants (module docstring): no empty page, a page never in a higher tier than its parent,
    bytes accounted per tier, and every running lease's tail registered with the whole chain up to it locked by
    that lease on the device tier (a chain a lease appends after never loses an entry or a page)."""
    used = [0, 0, 0]
    for page in cache.pages:
        assert page.entries and all(e.page is page for e in page.entries)
        assert page.parent_page is None or (page.parent_page in cache.pages and page.tier >= page.parent_page.tier)
        used[page.tier] += cache.config.page_bytes + page.checkpoint_bytes()
    assert used == cache.used
    for seq in running:
        lease = seq.lease
        assert lease.pages <= cache.pages, "a lease locks a page the cache has freed"
        entry = lease.tail
        while entry is not None:
            level = cache.roots if entry.parent is None else entry.parent.children
            assert level.get(entry.key) is entry and entry in entry.page.entries
            assert entry.page in lease.pages and entry.page.tier == DEVICE
            entry = entry.parent


def test_append_onto_a_cached_block_survives_the_room_made_for_its_checkpoint():
    """A sequence re-appends a cached block that has no checkpoint of its own and lives only for the checkpoint in
    the page below it; storing the new checkpoint needs room, and the room-making evicts that page below. The
    block must stay registered (pinned as the sequence's tail before room is made), not be trimmed as useless out
    of a page the sequence has locked, which left the page freed while locked, the checkpoint's bytes counted for
    an unregistered entry and the next append failing on the emptied page."""
    pool = PagePool(1, 8, 2, 1, dtype=torch.float64)
    ckpt_bytes = 8  # one float64: what Sequence.write_block stores
    cfg = PrefixCacheConfig(hash_block=1, page_size=2, page_bytes=pool.page_bytes,
                            device_bytes=3 * pool.page_bytes + 2 * ckpt_bytes)
    cache, oracle, tokens = PrefixCache(cfg, store=pool), Oracle(), [1, 2, 3, 4, 5]
    first = Sequence(cache, pool, tokens, max_hit=0)
    # pages [1 2*] [3 4] [5*]: the device tier is full; block 2 ends a turn, so its checkpoint is kept (a mid-turn
    # one would be dropped to make the room) and the room comes from evicting a page
    for block, checkpoint in enumerate((False, True, False, False, True), 1):
        assert first.write_block(oracle, checkpoint, turn_boundary=block == 2)
    first.finish()
    assert cache.used[DEVICE] == cache.capacity(DEVICE)

    second = Sequence(cache, pool, tokens, max_hit=2)  # hits at block 2, then writes block 3 with a checkpoint
    assert second.lease.hit_tokens == 2
    assert second.write_block(oracle, checkpoint=True)
    assert cache.stats.evicted_pages == 1  # the page of block 5 made the room
    chain = cache.match(tokens)
    assert len(chain) == 3 and chain[-1] is second.lease.tail and chain[-1].checkpoint is not None
    check_references(cache, pool, [second])
    check_structure(cache, [second])
    assert second.write_block(oracle, checkpoint=False)
    check_structure(cache, [second])
    second.finish()
    cache.evict(cache.used[DEVICE])
    assert not cache.pages and pool.num_free == pool.num_pages - 1


OPS = st.lists(st.tuples(st.sampled_from(["start", "start", "write", "write", "write", "finish", "evict"]),
                         st.integers(0, 7), st.integers(0, 40), st.booleans()), min_size=20, max_size=70)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, seed=st.integers(0, 2**16), tiers=st.sampled_from(["device", "host", "disk"]))
@example(
    ops=[('start', 0, 0, False),
     ('write', 0, 38, False),
     ('start', 0, 6, False),
     ('write', 0, 21, True),
     ('write', 1, 1, False),
     ('write', 1, 32, False),
     ('start', 0, 0, False),
     ('start', 0, 0, False),
     ('write', 0, 0, False),
     ('write', 0, 0, True),
     ('finish', 0, 0, False),
     ('start', 1, 14, False),
     ('start', 0, 0, False),
     ('start', 0, 0, False),
     ('start', 0, 0, False),
     ('start', 0, 0, False),
     ('start', 0, 0, False),
     ('finish', 0, 0, False),
     ('write', 1, 1, False),
     ('start', 0, 18, False)],
    seed=0,
    tiers='device',
).via('discovered failure')
def test_paged_prefix_cache_random_operations(ops, seed, tiers):
    h, P = 2, 6
    rng = random.Random(seed)
    trunk = [rng.randrange(3) for _ in range(30)]
    seqs = [trunk[: rng.randrange(0, 30)] + [rng.randrange(3) for _ in range(16)] for _ in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        pool = PagePool(1, 40, P, 1, dtype=torch.float64)
        page = pool.page_bytes
        cfg = PrefixCacheConfig(hash_block=h, page_size=P, page_bytes=page, device_bytes=6 * page + 8 * 8,
                                host_bytes=0 if tiers == "device" else 3 * page + 32,
                                disk_dir=tmp if tiers == "disk" else None, disk_bytes=5 * page + 64)
        cache, oracle, running = PrefixCache(cfg, store=pool), Oracle(), []
        for op, which, amount, flag in ops:
            if op == "start" and len(running) < 3:
                running.append(Sequence(cache, pool, seqs[which], max_hit=amount))
                check_hit_contents(running[-1], oracle)
                assert running[-1].lease.hit_tokens <= amount
            elif op == "write" and running:
                seq = running[which % len(running)]
                for i in range(1 + amount % 6):
                    seq.write_block(oracle, checkpoint=flag or i % 3 == 2)
            elif op == "finish" and running:
                running.pop(which % len(running)).finish()
            elif op == "evict":
                cache.evict(min(amount * 8, cache.used[DEVICE]))
            check_references(cache, pool, running)
            check_structure(cache, running)
        for seq in running:
            seq.finish()
        check_references(cache, pool, [])
        cache.evict(cache.used[DEVICE])
        assert pool.num_free == pool.num_pages - 1, "with nothing running, every page can go back to the pool"
