"""The paged MLA latent cache of the serving engine: preallocated physical pages, ref counts, block tables.

`PagePool` holds every MLA layer's latents in one preallocated tensor `pages` [n_mla, num_pages, P, R+r] (layer j's
pages, `pages[j]`, are contiguous: what the paged decode kernel reads). A page is shared by reference: running
sequences (through their block tables) and the prefix cache each hold one reference per page they use, and a page
returns to the free list when its last reference goes. Page 0 is the null page: never handed out, it backs the
padding rows of a CUDA-graph batch and the unused tail of every block table.

`BlockTables` is the per-slot view the kernels read: `tables` [num_slots + 1, max_pages] int32 on the device (row
s: the physical pages of the sequence in slot s, in order; the last row, the padding slot, is all null pages),
mirrored by Python lists so the engine never reads the device to know a sequence's pages.
"""

from __future__ import annotations

import torch

from openk3.ops.transfer import to_device

NULL_PAGE = 0


class PagePool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, width: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if num_pages < 2:
            raise ValueError(f"the page pool needs >= 2 pages (one is the null page), got num_pages={num_pages}")
        self.page_size, self.width = page_size, width
        self.pages = torch.zeros(num_layers, num_pages, page_size, width, dtype=dtype, device=device)
        self.refs = [0] * num_pages
        self.refs[NULL_PAGE] = 1  # pinned forever
        self._free = list(range(num_pages - 1, 0, -1))  # a stack: low page ids first

    @property
    def num_pages(self) -> int:
        return len(self.refs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every MLA layer."""
        return self.pages[:, 0].numel() * self.pages.element_size()

    def alloc(self) -> int | None:
        """A free page with one reference, or None when every page is in use."""
        if not self._free:
            return None
        pid = self._free.pop()
        self.refs[pid] = 1
        return pid

    def retain(self, pid: int) -> None:
        if self.refs[pid] < 1:
            raise ValueError(f"page {pid} is free: it cannot gain a reference")
        self.refs[pid] += 1

    def release(self, pid: int) -> None:
        if pid == NULL_PAGE:
            return
        if self.refs[pid] < 1:
            raise ValueError(f"page {pid} is already free")
        self.refs[pid] -= 1
        if self.refs[pid] == 0:
            self._free.append(pid)

    # ---- moving page contents (prefix-cache tiers, copy-on-write of a partly shared page) ------------------------
    def read(self, pid: int) -> torch.Tensor:
        """A CPU copy of page `pid` over every layer: [n_mla, P, R+r]."""
        return self.pages[:, pid].to("cpu", copy=True)

    def write(self, content: torch.Tensor) -> int | None:
        """A new page (one reference) holding `content` [n_mla, P, R+r]; None when the pool is full."""
        pid = self.alloc()
        if pid is not None:
            self.pages[:, pid].copy_(content)
        return pid

    def copy_prefix(self, src: int, dst: int, tokens: int) -> None:
        """Copy the first `tokens` positions of page src into page dst (every layer)."""
        self.pages[:, dst, :tokens].copy_(self.pages[:, src, :tokens])


class BlockTables:
    def __init__(self, num_slots: int, max_pages: int, device: torch.device | str = "cpu"):
        self.tables = torch.full((num_slots + 1, max_pages), NULL_PAGE, dtype=torch.int32, device=device)
        self.pages: list[list[int]] = [[] for _ in range(num_slots + 1)]
        self.max_pages = max_pages

    @property
    def padding_slot(self) -> int:
        return len(self.pages) - 1

    def set(self, slot: int, pages: list[int]) -> None:
        if len(pages) > self.max_pages:
            raise ValueError(f"a sequence may hold {self.max_pages} pages, got {len(pages)}")
        self.pages[slot] = list(pages)
        self.tables[slot].copy_(to_device(list(pages) + [NULL_PAGE] * (self.max_pages - len(pages)),
                                          self.tables.device, torch.int32))

    def append(self, slot: int, pid: int) -> None:
        i = len(self.pages[slot])
        if i >= self.max_pages:
            raise ValueError(f"a sequence may hold {self.max_pages} pages")
        self.pages[slot].append(pid)
        self.tables[slot, i] = pid

    def replace_last(self, slot: int, pid: int) -> None:
        self.pages[slot][-1] = pid
        self.tables[slot, len(self.pages[slot]) - 1] = pid

    def clear(self, slot: int) -> list[int]:
        """Empty the slot's table; returns the pages it held (the caller drops their references)."""
        pages, self.pages[slot] = self.pages[slot], []
        self.tables[slot].fill_(NULL_PAGE)
        return pages
