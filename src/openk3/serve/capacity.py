"""How many latent pages the serving engine holds: sized from device memory on a GPU, as vLLM sizes its KV cache.

On a GPU, after the weights, the KDA state pool and a warm-up of the longest prefill forward (its peak activation
memory), what `--gpu-memory-utilization` leaves of the device is the engine's cache budget, less a reserve for the
CUDA graphs captured after it. The prefix cache's device tier takes `CACHE_SHARE` of it (its pages live in the
pool, its KDA checkpoints beside it) unless `--cache-mb` says otherwise; the page pool takes the rest. On a CPU the
pool holds a fixed token count (`CPU_POOL_TOKENS`, plus the cache) unless `--kv-pages` says otherwise. Either way
the pool must hold one sequence of `--max-model-len` tokens, or the engine refuses to start.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
CACHE_SHARE = 0.2  # of the GPU budget: the prefix cache's device tier (pages and KDA checkpoints)
GRAPH_RESERVE_BYTES = 1 << 30  # left free for the CUDA graphs captured after the pool is allocated
CPU_POOL_TOKENS = 1 << 17  # tokens of the pool on a CPU (without --kv-pages)
CPU_CACHE_BYTES = 256 << 20  # the prefix cache's device tier on a CPU (without --cache-mb)
# prompt tokens prefilled per engine step on a GPU (--max-num-batched-tokens): every decoding sequence waits for the
# step's prefill, a forward that costs about its launches up to ~16k tokens for k3-debug on an H200 (41 ms at 512
# tokens, 51 ms at 8192: bench/RESULTS.md, 2026-12-05), so 8192 doubles 4096's prefill rate at the same stall (the
# mixed stream's TTFT p50 1.26 s against 6.89 s)
GPU_BATCHED_TOKENS = 8192
CPU_BATCHED_TOKENS = 256


def default_batched_tokens(gpu: bool) -> int:
    """--max-num-batched-tokens when not given."""
    return GPU_BATCHED_TOKENS if gpu else CPU_BATCHED_TOKENS


@dataclass(frozen=True)
class Capacity:
    pages: int  # physical pages in the pool, the null page included
    page_size: int  # tokens per page
    cache_bytes: int  # the prefix cache's device tier
    budget_bytes: int = 0  # GPU: the memory the pool and the cache's tier share (0: sized by tokens)

    @property
    def tokens(self) -> int:
        """Latent positions the pool holds (running sequences and the prefix cache's pages together)."""
        return (self.pages - 1) * self.page_size


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def check_utilization(utilization: float) -> None:
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")


def gpu_capacity(*, total: int, free: int, reserved: int, peak_allocated: int, utilization: float,
                 page_bytes: int, page_size: int, max_model_len: int, cache_bytes: int | None,
                 prefix_cache: bool) -> Capacity:
    """The pool on a GPU of `total` bytes, `free` of them free now, `reserved` held by this process's allocator,
    whose allocations peaked at `peak_allocated` (weights, states, the longest prefill's activations)."""
    check_utilization(utilization)
    others = total - free - reserved  # the CUDA context and other processes
    budget = int(total * utilization) - others - peak_allocated - GRAPH_RESERVE_BYTES
    cache = 0 if not prefix_cache else cache_bytes if cache_bytes is not None else int(max(0, budget) * CACHE_SHARE)
    pages = (budget - cache) // page_bytes
    need = pages_for(max_model_len + 1, page_size)
    if pages - 1 < need:
        raise ValueError(
            f"--gpu-memory-utilization {utilization:g} leaves {max(0, budget - cache) / GiB:.2f} GiB for the "
            f"latent cache (of {total / GiB:.1f} GiB: {peak_allocated / GiB:.2f} GiB weights and activations, "
            f"{others / GiB:.2f} GiB outside this process, {cache / GiB:.2f} GiB prefix cache); one sequence of "
            f"--max-model-len {max_model_len} needs {need * page_bytes / GiB:.2f} GiB: raise the first or lower "
            f"the second")
    return Capacity(pages=1 + pages, page_size=page_size, cache_bytes=cache, budget_bytes=budget)


def fixed_capacity(*, kv_pages: int | None, page_bytes: int, page_size: int, max_model_len: int, max_num_seqs: int,
                   cache_bytes: int | None, prefix_cache: bool) -> Capacity:
    """The pool without memory sizing (a CPU, or --kv-pages): `kv_pages`, else CPU_POOL_TOKENS, a partial page per
    sequence and the cache's pages."""
    cache = 0 if not prefix_cache else cache_bytes if cache_bytes is not None else CPU_CACHE_BYTES
    pages = kv_pages or 1 + max_num_seqs + pages_for(CPU_POOL_TOKENS, page_size) + cache // page_bytes
    need = pages_for(max_model_len + 1, page_size)
    if pages - 1 < need:
        raise ValueError(f"--kv-pages {pages} holds {(pages - 1) * page_size} tokens; one sequence of "
                         f"--max-model-len {max_model_len} needs {need} pages of {page_size} tokens besides the "
                         f"null page")
    return Capacity(pages=pages, page_size=page_size, cache_bytes=cache)
