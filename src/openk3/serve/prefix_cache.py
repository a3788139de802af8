"""The K3 hybrid prefix cache (SPEC §7), independent of any model.

Two granularities, decoupled:
- prefix identity: hash blocks of `hash_block` tokens (h), chained: key_i = H(key_{i-1}, tokens of block i).
  Every registered block is a `HashEntry` holding the MLA latent KV of its h tokens and, optionally, a KDA
  state checkpoint taken at its end boundary.
- memory: physical pages of `page_size` tokens (P, a multiple of h) covering a page-aligned token range. A
  page holds one contiguous run of entries of one chain; a chain that branches inside a page continues in a
  new page over the rest of that range. Memory is accounted per whole page (what a real block pool
  allocates) plus the bytes of each checkpoint.

Lookup is two-phase: follow the hash chain as far as it matches (end points inside a partly filled page
count), then take the deepest matched boundary that has a checkpoint (one payload holding every KDA layer's
state). Hits are multiples of h, never required to be multiples of P.

Locks: a `Lease` (one per running sequence) locks every page on its chain, the pages it hit and the page it
writes. Eviction takes the least recently used unlocked page that has no child page in its own tier, and
moves the page's KV together with its checkpoints: a checkpoint never outlives its KV. The reverse also
holds: an entry with no checkpoint at or below it is useless and is trimmed, even on a locked page (a lock keeps a
page from eviction, not its entries from trimming), unless a lease pins it as the tail it appends after: the
pin keeps the entry and, through it, the chain above it. Under memory pressure mid-turn checkpoints go first
(locked pages' too); turn-boundary checkpoints and the newest one of every chain (no checkpoint below it) are
kept. Tiers: device -> host (optional) -> disk (optional, needs host); a tier's page is never in a higher tier
than its ancestors, and hits are promoted back to the device tier before they are used.

Paged mode (`PrefixCache(config, store=page_pool)`, what the serving engine uses): a device-tier page *is* a
physical page of the engine's `PagePool` (`Page.phys`), holding the latents of every position of its page range,
and the cache holds one reference to it; hits share those pages by reference (`Lease.hit_pages`, one per page
range the hit covers). Appends name the physical page the sequence wrote the block into (`append(page=...)`): a
sequence continues a cached page only when that page is its own physical page, otherwise the chain branches into
a new cache page over the rest of the range (the sequence's own copy holds the range's earlier positions too).
A lease whose hit ends inside a page it may continue (the hit is that page's last entry and nobody writes it)
claims it at `acquire` (`Lease.owns_tail`): the sequence then writes into the shared page itself; otherwise the
engine copies the hit's part of that page into a fresh page of its own. Off the device a page's latents are one
CPU tensor (`Page.content`, read from and written back to the pool).

Images (SPEC §12): a prompt carries one placeholder id per image token, the same id for every image, so the
tokens alone cannot tell two pictures apart. The cache is keyed by `image_keyed_tokens(prompt, ...)` instead: every
placeholder of an image becomes the image's content key (a negative number from the hash of its pixels, never a
token id), other tokens stay. A block holding image tokens then hits exactly when the same pictures sit at the same
places after the same text, and the chained keys below need no change.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

DEVICE, HOST, DISK = 0, 1, 2  # tiers, fastest first
DROP_SCAN_PAGES = 64  # pages a search for a mid-turn checkpoint to drop visits at most (`_drop_one_checkpoint`)


def chain_key(parent_key: bytes, tokens: Sequence[int]) -> bytes:
    """key_i = H(key_{i-1}, tokens_i) (SPEC §7)."""
    words = array("q", tokens)  # signed 64-bit little-endian words (4x faster than int.to_bytes per token)
    if sys.byteorder != "little":
        words.byteswap()
    digest = hashlib.blake2b(parent_key, digest_size=16)
    digest.update(words.tobytes())
    return digest.digest()


def image_keyed_tokens(tokens: Sequence[int], image_token_id: int, images: Sequence[tuple[int, bytes]]) -> list[int]:
    """The prompt as the cache identifies it (module docstring). images: (token count, content digest) per image,
    in prompt order; each image's count of placeholders, left to right, takes the key -1 - (digest's first 8 bytes
    >> 1), which fits chain_key's signed 64-bit packing. ValueError if the placeholders and counts disagree."""
    keys = [-1 - (int.from_bytes(digest[:8], "little") >> 1) for _, digest in images]
    owner = [k for k, (count, _) in enumerate(images) for _ in range(count)]  # image of each placeholder, in order
    out, seen = [], 0
    for t in tokens:
        if t == image_token_id:
            if seen == len(owner):
                raise ValueError(f"the prompt holds more image placeholders (id {image_token_id}) than its images' "
                                 f"{len(owner)} tokens: the id stands only where an image goes")
            t, seen = keys[owner[seen]], seen + 1
        out.append(int(t))
    if seen != len(owner):
        raise ValueError(f"the prompt holds {seen} image placeholders for {len(owner)} image tokens")
    return out


def nbytes_of(obj: Any) -> int:
    """Bytes held by a payload: tensors, or lists / tuples / dicts of them."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(nbytes_of(o) for o in obj)
    if isinstance(obj, dict):
        return sum(nbytes_of(o) for o in obj.values())
    if obj is None:
        return 0
    raise TypeError(f"cannot size a payload of type {type(obj).__name__}")


def to_device(obj: Any, device: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


@dataclass
class PrefixCacheConfig:
    hash_block: int = 16  # h: tokens per hash block (512 in K3)
    page_size: int = 192  # P: tokens per physical page (6144 in K3), a multiple of h
    page_bytes: int = 1 << 16  # bytes of one physical page of MLA latent KV
    device_bytes: int = 64 << 20  # budget of the device tier
    host_bytes: int = 0  # budget of the host tier; 0 disables it
    disk_dir: str | None = None  # directory of the disk tier (needs a host tier); None disables it
    disk_bytes: int = 0
    device: str = "cpu"  # where device-tier payloads live; host and disk payloads are on the CPU

    def __post_init__(self) -> None:
        if self.hash_block < 1 or self.page_size < self.hash_block or self.page_size % self.hash_block:
            raise ValueError(f"page_size ({self.page_size}) must be a positive multiple of hash_block "
                             f"({self.hash_block})")
        if self.page_bytes < 1 or self.device_bytes < self.page_bytes:
            raise ValueError(f"the prefix cache's device tier (--cache-mb, device_bytes {self.device_bytes}) must "
                             f"hold at least one page of {self.page_bytes} bytes ({self.page_bytes / 2**20:.2f} MiB)")
        if self.disk_dir is not None and self.host_bytes <= 0:
            raise ValueError("the disk tier sits below the host tier: set host_bytes > 0 to use disk_dir")

    @property
    def blocks_per_page(self) -> int:
        return self.page_size // self.hash_block


@dataclass(eq=False)
class Checkpoint:
    payload: Any  # every KDA layer's state at the boundary; None while on disk
    nbytes: int
    turn_boundary: bool


@dataclass(eq=False)
class HashEntry:
    key: bytes
    tokens: tuple[int, ...]
    parent: HashEntry | None
    depth: int  # hash blocks from the start through this one; the boundary is depth * h tokens
    page: Page
    kv: Any  # MLA latent KV of this block's tokens; None while on disk
    checkpoint: Checkpoint | None = None
    children: dict[bytes, HashEntry] = field(default_factory=dict)
    checkpoints_below: int = 0  # checkpoints strictly inside this entry's subtree
    pins: int = 0  # leases whose tail this is


@dataclass(eq=False)
class Page:
    pid: int
    end_block: int  # one past the last block index this page may hold (page aligned)
    entries: list[HashEntry] = field(default_factory=list)
    child_pages: set[Page] = field(default_factory=set)
    parent_page: Page | None = None
    tier: int = DEVICE
    locks: int = 0
    last_used: int = 0
    writer: Lease | None = None  # the lease allowed to append here

    phys: int | None = None  # paged mode, device tier: the physical page in the pool
    content: Any = None  # paged mode, host tier: the page's latents (CPU); None on disk

    def checkpoint_bytes(self) -> int:
        return sum(e.checkpoint.nbytes for e in self.entries if e.checkpoint is not None)


@dataclass(eq=False)
class Lease:
    """One sequence's hold on the cache: the hit, the locked pages and the tail it appends after."""

    hit_tokens: int = 0
    hit_kv: list[Any] = field(default_factory=list)  # per hit block, in order
    hit_checkpoint: Any = None
    hit_pages: list[int] = field(default_factory=list)  # paged mode: physical page per page range of the hit
    owns_tail: bool = False  # paged mode: the hit ends inside hit_pages[-1] and this lease may write on into it
    tail: HashEntry | None = None
    pages: set[Page] = field(default_factory=set)
    detached: bool = False  # stopped caching (no room); later appends are ignored
    released: bool = False


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    inserted_blocks: int = 0
    evicted_pages: int = 0
    demoted_pages: int = 0
    promoted_pages: int = 0
    dropped_checkpoints: int = 0


class PrefixCache:
    def __init__(self, config: PrefixCacheConfig, store: Any = None) -> None:
        """`store`: a page pool (paged mode; `openk3.cache.paged.PagePool`'s alloc-free interface: retain, release,
        read, write, num_free), or None: entries hold their KV payloads themselves."""
        self.config = config
        self.store = store
        self.roots: dict[bytes, HashEntry] = {}
        self.pages: set[Page] = set()
        self._by_age: dict[Page, None] = {}  # the pages, least recently used first (`_touch`): eviction's order
        self.used = [0, 0, 0]  # bytes per tier
        self.stats = PrefixCacheStats()
        self._clock = itertools.count(1)
        self._pids = itertools.count()
        if config.disk_dir is not None:
            os.makedirs(config.disk_dir, exist_ok=True)

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def utilisation(self) -> float:
        return self.used[DEVICE] / self.config.device_bytes

    def capacity(self, tier: int) -> int:
        cfg = self.config
        return (cfg.device_bytes, cfg.host_bytes, cfg.disk_bytes if cfg.disk_dir is not None else 0)[tier]

    def match(self, tokens: Sequence[int]) -> list[HashEntry]:
        """MLA phase: the registered chain of full hash blocks matching `tokens` (any tier)."""
        h, chain, level = self.config.hash_block, [], self.roots
        parent_key = b""
        for start in range(0, len(tokens) - h + 1, h):
            block = tuple(int(t) for t in tokens[start:start + h])
            key = chain_key(parent_key, block)
            entry = level.get(key)
            if entry is None or entry.tokens != block:  # tokens are compared too: a collision never hits
                break
            chain.append(entry)
            level, parent_key = entry.children, key
        return chain

    # ---- the lease life cycle --------------------------------------------------------------------------
    def acquire(self, tokens: Sequence[int], max_hit: int | None = None) -> Lease:
        """Two-phase lookup (SPEC §7) for a new sequence; the returned lease locks what it hit.

        `max_hit` caps the hit (an engine passes len(prompt) - 1 so at least one token is prefilled)."""
        limit = len(tokens) if max_hit is None else min(max_hit, len(tokens))
        chain = self.match(tokens[:limit])
        lease = Lease()
        self.stats.queried_tokens += len(tokens)
        hit_depth = self._deepest_checkpoint(chain, len(chain))
        while hit_depth:
            promoted = self._lock_and_promote(lease, chain[:hit_depth])
            if promoted == hit_depth:
                break
            self._release_pages(lease)
            hit_depth = self._deepest_checkpoint(chain, promoted)
        if hit_depth:
            hit = chain[hit_depth - 1]
            now = next(self._clock)
            for page in lease.pages:
                self._touch(page, now)
            lease.hit_tokens = hit.depth * self.config.hash_block
            lease.hit_kv = [e.kv for e in chain[:hit_depth]]
            lease.hit_checkpoint = hit.checkpoint.payload
            if self.store is not None:
                self._share_hit_pages(lease, chain[:hit_depth])
            self._move_tail(lease, hit)
            self.stats.hit_tokens += lease.hit_tokens
        return lease

    def append(self, lease: Lease, tokens: Sequence[int], kv: Any, checkpoint: Any = None,
               turn_boundary: bool = False, page: int | None = None) -> bool:
        """Register the next hash block of the lease's sequence (its KV and, optionally, the KDA checkpoint at
        its end); in paged mode kv is None and `page` is the physical page the block's latents are in. Returns
        False once the lease has stopped caching because nothing could be evicted."""
        h = self.config.hash_block
        if lease.released or lease.detached:
            return False
        if (page is None) != (self.store is None):
            raise ValueError("append needs page= (a physical page) in paged mode and only there")
        if len(tokens) != h:
            raise ValueError(f"a hash block has exactly {h} tokens, got {len(tokens)}")
        block = tuple(int(t) for t in tokens)
        parent = lease.tail
        level = self.roots if parent is None else parent.children
        key = chain_key(b"" if parent is None else parent.key, block)
        entry = level.get(key)
        if entry is not None and entry.tokens != block:
            lease.detached = True  # a hash collision: never register a second meaning for a key
            return False
        ckpt_bytes = nbytes_of(checkpoint)
        if entry is None:
            phys = page
            page = self._writable_page(lease, parent, phys)
            if page is None and not self._make_room(DEVICE, self.config.page_bytes):
                lease.detached = True
                return False
            page = page or self._new_page(lease, parent, phys)
            depth = 1 if parent is None else parent.depth + 1
            entry = HashEntry(key=key, tokens=block, parent=parent, depth=depth, page=page, kv=kv)
            level[key] = entry
            page.entries.append(entry)
            self.stats.inserted_blocks += 1
        elif not self._lock_and_promote(lease, [entry]):
            lease.detached = True
            return False
        # Pin the entry before making room for its checkpoint: room-making evicts pages below it and trims every
        # entry left without a checkpoint at or below it that nothing pins, locked page or not.
        self._move_tail(lease, entry)
        self._touch(entry.page, next(self._clock))
        if checkpoint is not None and entry.checkpoint is None:
            if not self._make_room(DEVICE, ckpt_bytes):
                lease.detached = True
                return False
            self._set_checkpoint(entry, Checkpoint(checkpoint, ckpt_bytes, turn_boundary))
        elif entry.checkpoint is not None and turn_boundary:
            entry.checkpoint.turn_boundary = True
        return True

    def mark_turn_boundary(self, lease: Lease) -> None:
        """The lease's newest block ends a turn: keep its checkpoint under memory pressure."""
        if lease.tail is not None and lease.tail.checkpoint is not None:
            lease.tail.checkpoint.turn_boundary = True

    def release(self, lease: Lease) -> None:
        """The sequence finished or was cancelled: unlock everything it held."""
        if lease.released:
            return
        self._release_pages(lease)
        self._move_tail(lease, None)
        lease.released = True
        lease.hit_kv, lease.hit_checkpoint, lease.hit_pages = [], None, []

    # ---- explicit eviction (tests, memory reclamation) ---------------------------------------------------
    def evict(self, nbytes: int) -> bool:
        """Free `nbytes` of the device tier now (same policy as under pressure)."""
        return self._make_room(DEVICE, self.capacity(DEVICE) - self.used[DEVICE] + nbytes)

    def evict_page(self) -> bool:
        """Give up the device tier's least recently used page that nothing locks (moved to a lower tier, or
        discarded with what depends on it): what a full page pool needs. `evict` may free bytes by dropping
        checkpoints instead, which frees no page. False if every page is locked."""
        return self._evict_one_page(DEVICE)

    # ---- internals: pages and locks ----------------------------------------------------------------------
    def _deepest_checkpoint(self, chain: list[HashEntry], within: int) -> int:
        for depth in range(within, 0, -1):
            if chain[depth - 1].checkpoint is not None:
                return depth
        return 0

    def _move_tail(self, lease: Lease, entry: HashEntry | None) -> None:
        """Pin the entry a lease appends after (a pinned entry is never trimmed); trim the one it leaves."""
        old, lease.tail = lease.tail, entry
        if entry is not None:
            entry.pins += 1
        if old is not None:
            old.pins -= 1
            self._trim(old)

    def _lock(self, lease: Lease, page: Page) -> None:
        if page not in lease.pages:
            lease.pages.add(page)
            page.locks += 1

    def _release_pages(self, lease: Lease) -> None:
        for page in lease.pages:
            page.locks -= 1
            if page.writer is lease:
                page.writer = None
        lease.pages = set()

    def _lock_and_promote(self, lease: Lease, chain: list[HashEntry]) -> int:
        """Lock the pages of `chain`, promoting lower-tier ones to the device tier; the number of leading
        entries that ended up locked on the device tier."""
        for i, entry in enumerate(chain):
            page = entry.page
            if page not in self.pages:  # discarded while making room for an earlier page of the chain
                return i
            self._lock(lease, page)
            if page.tier != DEVICE and not self._promote(page):
                lease.pages.discard(page)
                page.locks -= 1
                return i
        return len(chain)

    def _share_hit_pages(self, lease: Lease, chain: list[HashEntry]) -> None:
        """Paged mode: the physical page of each page range the hit covers (that of the deepest hit entry in the
        range: it holds every earlier position of the range too), and the claim on a partly hit last page."""
        n = self.config.blocks_per_page
        depth = len(chain)
        lease.hit_pages = [chain[min(depth, (i + 1) * n) - 1].page.phys for i in range(-(-depth // n))]
        tail = chain[-1].page
        # and the cache's own reference is the physical page's only one: a branch that a sequence continued in its
        # own copy of the range made another cache page over the same physical page, and a running hit may read it;
        # writing on past this hit would overwrite their positions (found by tests/test_paged_cache.py's random ops)
        lease.owns_tail = depth % n != 0 and tail.entries[-1] is chain[-1] and tail.writer in (None, lease) and \
            self.store.refs[tail.phys] == 1
        if lease.owns_tail:
            tail.writer = lease

    def _writable_page(self, lease: Lease, parent: HashEntry | None, phys: int | None) -> Page | None:
        """The parent's page when the new block may continue it: same page range, parent is its last entry,
        no other lease is writing it, and (paged mode) it is the physical page the block was written into."""
        if parent is None:
            return None
        page = parent.page
        if page.entries[-1] is not parent or parent.depth >= page.end_block or page.writer not in (None, lease):
            return None
        if page.phys != phys:
            return None
        page.writer = lease
        self._lock(lease, page)
        return page

    def _new_page(self, lease: Lease, parent: HashEntry | None, phys: int | None) -> Page:
        n = self.config.blocks_per_page
        first = 0 if parent is None else parent.depth
        page = Page(pid=next(self._pids), end_block=(first // n + 1) * n, writer=lease, phys=phys)
        if phys is not None:
            self.store.retain(phys)
        if parent is not None:
            page.parent_page = parent.page
            parent.page.child_pages.add(page)
        self.pages.add(page)
        self._by_age[page] = None
        self.used[DEVICE] += self.config.page_bytes
        self._lock(lease, page)
        return page

    def _set_checkpoint(self, entry: HashEntry, ckpt: Checkpoint | None) -> None:
        delta = (ckpt is not None) - (entry.checkpoint is not None)
        if entry.checkpoint is not None:
            self.used[entry.page.tier] -= entry.checkpoint.nbytes
        if ckpt is not None:
            self.used[entry.page.tier] += ckpt.nbytes
        entry.checkpoint = ckpt
        node = entry.parent
        while node is not None:
            node.checkpoints_below += delta
            node = node.parent

    # ---- internals: making room ---------------------------------------------------------------------------
    def _make_room(self, tier: int, nbytes: int) -> bool:
        """Free space in `tier` until `nbytes` fit: drop mid-turn checkpoints, then move or evict LRU pages."""
        cap = self.capacity(tier)
        if nbytes > cap:
            return False
        while self.used[tier] + nbytes > cap:
            if self._drop_one_checkpoint(tier) or self._evict_one_page(tier):
                continue
            return False
        return True

    def _touch(self, page: Page, now: int) -> None:
        page.last_used = now
        self._by_age.pop(page, None)
        self._by_age[page] = None

    def _drop_one_checkpoint(self, tier: int) -> bool:
        """Drop the mid-turn checkpoint that has checkpoints below it on the least recently used page of `tier`
        (the shallowest of that page's), locked or not: a lock keeps a page's latents, and the deeper checkpoint
        keeps its chain usable (so sequences prefilling long prompts together keep caching instead of filling the
        tier with their mid-turn checkpoints and detaching). Pages are visited by age: the scan stops at the first
        age that has one, and after the DROP_SCAN_PAGES oldest (then `_make_room` evicts the oldest page instead):
        once the oldest pages of a full tier hold only turn checkpoints, every registered block walked past all of
        them (thousands of pages of a 12 GB tier: 25-50 ms of host time a prefill step on an H100, 2026-12-05)."""
        victim = None
        for seen, p in enumerate(self._by_age):
            if victim is not None and p.last_used > victim.page.last_used or seen == DROP_SCAN_PAGES:
                break
            if p.tier != tier:
                continue
            for e in p.entries:
                if e.checkpoint is not None and not e.checkpoint.turn_boundary and e.checkpoints_below and (
                        victim is None or (p.last_used, e.depth) < (victim.page.last_used, victim.depth)):
                    victim = e
        if victim is None:
            return False
        self._set_checkpoint(victim, None)
        self.stats.dropped_checkpoints += 1
        return True

    def _evict_one_page(self, tier: int) -> bool:
        victim = next((p for p in self._by_age if p.tier == tier and p.locks == 0
                       and not any(c.tier <= tier for c in p.child_pages)), None)  # the least recently used
        if victim is None:
            return False
        lower = tier + 1
        size = self.config.page_bytes + victim.checkpoint_bytes()
        if lower <= DISK and self.capacity(lower) > 0 and self._make_room(lower, size):
            if victim not in self.pages:  # trimmed as useless while room was made below it
                return True
            self._move(victim, lower)
            self.stats.demoted_pages += 1
        else:
            self._discard_subtree(victim)
        return True

    def _move(self, page: Page, tier: int) -> None:
        size = self.config.page_bytes + page.checkpoint_bytes()
        if page.tier == DISK:
            path = self._disk_path(page)
            saved = torch.load(path, weights_only=True)
            os.remove(path)
            for entry, kv, ckpt in zip(page.entries, saved["kv"], saved["checkpoints"]):
                entry.kv = kv
                if entry.checkpoint is not None:
                    entry.checkpoint.payload = ckpt
            page.content = saved["content"]
        if self.store is not None and page.tier == DEVICE:  # paged: the latents leave the pool
            page.content = self.store.read(page.phys)
            self.store.release(page.phys)
            page.phys = None
        elif self.store is not None and tier == DEVICE:
            page.phys, page.content = self.store.write(page.content), None
        target = self.config.device if tier == DEVICE else "cpu"
        for entry in page.entries:
            entry.kv = to_device(entry.kv, target)
            if entry.checkpoint is not None:
                entry.checkpoint.payload = to_device(entry.checkpoint.payload, target)
        if tier == DISK:
            torch.save({"kv": [e.kv for e in page.entries], "content": page.content,
                        "checkpoints": [None if e.checkpoint is None else e.checkpoint.payload
                                        for e in page.entries]}, self._disk_path(page))
            page.content = None
            for entry in page.entries:
                entry.kv = None
                if entry.checkpoint is not None:
                    entry.checkpoint.payload = None
        self.used[page.tier] -= size
        self.used[tier] += size
        page.tier = tier

    def _promote(self, page: Page) -> bool:
        """Bring a locked lower-tier page back to the device tier (its ancestors already are)."""
        size = self.config.page_bytes + page.checkpoint_bytes()
        if not self._make_room(DEVICE, size) or (self.store is not None and not self.store.num_free):
            return False
        if page not in self.pages:  # its entries were trimmed as useless while room was made (their checkpoints
            return False  # were below, in a later page of the chain that the room-making evicted)
        self._move(page, DEVICE)
        self.stats.promoted_pages += 1
        return True

    def _disk_path(self, page: Page) -> str:
        return os.path.join(self.config.disk_dir, f"page-{page.pid}.pt")

    def _discard_subtree(self, page: Page) -> None:
        """Forget a page, every page below it (unreachable without it), then trim entries left useless."""
        for child in list(page.child_pages):
            self._discard_subtree(child)
        while page.entries:
            self._remove_entry(page.entries[-1])
        self.stats.evicted_pages += 1

    def _remove_entry(self, entry: HashEntry) -> None:
        page = entry.page
        self._set_checkpoint(entry, None)
        level = self.roots if entry.parent is None else entry.parent.children
        del level[entry.key]
        page.entries.remove(entry)
        if not page.entries:
            self._free_page(page)
        if entry.parent is not None:
            self._trim(entry.parent)

    def _trim(self, entry: HashEntry) -> None:
        """Remove an entry no hit can use: no checkpoint at or below it, no children, no lease appending."""
        if entry.checkpoint is None and not entry.checkpoints_below and not entry.children and not entry.pins:
            self._remove_entry(entry)

    def _free_page(self, page: Page) -> None:
        if page.tier == DISK:
            os.remove(self._disk_path(page))
        if page.phys is not None:
            self.store.release(page.phys)
        self.used[page.tier] -= self.config.page_bytes
        if page.parent_page is not None:
            page.parent_page.child_pages.discard(page)
        self.pages.discard(page)
        self._by_age.pop(page, None)
