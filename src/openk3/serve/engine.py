"""The serving engine: continuous batching over the hybrid model with the K3 prefix cache (SPEC §7).

State lives in preallocated pools on the model's device: MLA latents in physical pages of P tokens (`PagePool`,
one block table per running sequence, pages ref-counted and shared by reference with the prefix cache) and the
KDA conv windows and fp32 recurrent states in one slot per running sequence (`StatePool`). The pool is sized from
the device's memory on a GPU (openk3.serve.capacity); it must hold one sequence of `max_model_len` tokens. The
`ModelRunner` does the tensor work: decode with static shapes (CUDA graphs at bucketed batch sizes on a GPU) and
prefill chunks.

One `step()`: apply cancellations; admit waiting requests while their prompts find pages (free, or held only by
the prefix cache) and slots (a prefix hit shares the hit's pages by reference, copies the part of a partly hit
page it may not write into, and loads the hit's KDA checkpoint into the slot); run one batched decode for every
decoding sequence; then prefill chunks within the step's token budget, as few forwards as it can: chunks of any
lengths right-padded together (each forward recording the union of its rows' KDA checkpoint offsets), short ones
in the runner's CUDA-graph step, those with images or a draft to feed with others of their length. A chunk holds at
most `prefill_chunk_blocks` hash blocks; the KDA states are checkpointed every `checkpoint_every` blocks and at the
turn boundary (the prompt's last full hash block, where a conversation's next turn resumes). Every full hash block
a sequence completes (in prefill or decode) is registered with the physical page holding its latents. Chunking
and checkpoint offsets are the same whether or not the cache is on, so greedy output does not depend on it. When a
sequence needs a page and none is left, the latest admitted sequence is preempted: it goes back to the head of
the queue keeping its output, and on re-admission prefills prompt and output again (the prefix cache usually holds
most of it). A failure in one sequence's work ends that sequence (reason "error"), not the others. `EngineLoop`
runs steps on a background thread; `add_request` and `cancel` are thread-safe. Each reply's text is decoded token
by token (openk3.tokenizer.TextStream) and searched for stop strings only where the new token can complete one.

Images (SPEC §12): a request may carry prepared images (openk3.images) whose placeholder runs are in its prompt.
Each prefill chunk passes the model the image tokens of the placeholders it holds (`ModelRunner.prefill`'s
`image_embeds`; an image is encoded the first time a chunk reaches it, so one inside the prefix hit never is),
and the prefix cache keys the prompt by image content (`PromptImages.cache_prompt`). Decode never sees an image.

Speculative decoding (`speculative` K > 0 with an `EagleDraft`, SPEC §11): the decoding sequences take one round each
per step instead of one token, every pass a static-shape step of the runner (CUDA graphs on a GPU). The round's
first draft pass writes the draft latents of the sequence's pending positions (the accepted tokens of its last
round, each read with the target feature before it: at most K + 1, ending at the token the target has not consumed
yet) and drafts the first token there; K - 1 one-position passes draft the rest from the draft's own hidden states.
The target verifies all rows' K + 1 tokens in one batched step that records the KDA states after each of the first
K, and each row keeps its accepted drafts plus one token (`openk3.draft.speculative.accept_drafts`: the target's
distribution exactly, greedy text unchanged); rows accept different numbers, and each rolls its slot's KDA state
back to its own offset (the MLA latents past it are left to be overwritten). The draft's latents live in the page
pool's last layer and end up written for a position only from target features (a drafted position's latent is
rewritten by the next round's first pass), so a page that reaches the prefix cache holds the same draft latents
whatever drafted them, and hash blocks are registered only up to the accepted tokens, each KDA checkpoint carrying
the draft feature of its boundary ("feature") for a sequence resuming there.
A sequence within K + 1 tokens of the context limit decodes one token per step. With `auto_speculation` the engine
chooses per step between rounds of K drafts and one plain decode step for every sequence (`SpecPolicy`, from the
measured acceptance and the batch size: openk3.serve.speculation). A plain step with a draft keeps the decoded
token's target feature as one more pending position, so the draft's latents end up the same whichever steps
decoded the sequence: when a sequence's pending positions fill a first draft pass (K + 1), a draft pass writes them
before its next plain step (`_write_pending`), keeping the last, which the next pass rewrites alike.
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from openk3.cache.paged import BlockTables, PagePool
from openk3.cache.state_pool import StatePool
from openk3.draft import EagleDraft, accept_drafts, accept_drafts_on_logits, accept_greedy, draw, target_distributions
from openk3.ops.transfer import HostCopy, host_list, to_device
from openk3.sampling import SamplingParams, request_rng, sample_tokens, token_logprobs
from openk3.serve.capacity import Capacity, GiB, check_utilization, default_batched_tokens, fixed_capacity, gpu_capacity
from openk3.serve.piecewise import run_to_end
from openk3.serve.prefix_cache import PrefixCache, PrefixCacheConfig
from openk3.serve.prompts import check_prompt
from openk3.serve.runner import ModelRunner
from openk3.serve.scheduler import Request, RequestEvent, Scheduler, SchedulerConfig
from openk3.serve.speculation import SpecPolicy
from openk3.serve.stop_strings import first_stop, sendable
from openk3.tokenizer import TextStream

log = logging.getLogger(__name__)

SLOW_STEP_S = 0.25  # an engine step longer than this is logged (INFO) with what it held


class CollectorClock:
    """Seconds Python's garbage collector has run in this process, and its collections (`gc.callbacks`): a
    collection holds the interpreter, so a slow step's log line says how much of it was collecting."""

    def __init__(self):
        self.seconds, self.collections, self._started = 0.0, 0, 0.0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections += 1

    def read(self) -> tuple[float, int]:
        return self.seconds, self.collections


@functools.cache
def collector_clock() -> CollectorClock:
    """The process's one clock (engines come and go; the callback stays)."""
    return CollectorClock()


class StepPhases:
    """Where one engine step's host time went: `mark(name)` adds the time since the previous mark to `name` (a
    perf_counter call a phase boundary, a few a step), so a slow step's log line can say which phase held it (the
    wait for the device's previous step is its own phase, "device wait")."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.last, self.spent = time.perf_counter(), {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.spent[name] = self.spent.get(name, 0.0) + now - self.last
        self.last = now

    def line(self, at_least: float = 1e-3) -> str:
        """The phases of at least `at_least` seconds, longest first."""
        spent = sorted(((s, n) for n, s in self.spent.items() if s >= at_least), reverse=True)
        return ", ".join(f"{name} {seconds * 1e3:.0f} ms" for seconds, name in spent) or "none over 1 ms"


# A prefill forward costs ~25-30 ms of host time on an H200 whatever its length (k3-debug: ~1,500 eager ops), so a
# long prompt goes in few, long forwards: 12k tokens took 141-151 ms in three of 4096 (bench/RESULTS.md, 2026-12-01).
GPU_PREFILL_CHUNK_TOKENS = 16384  # tokens per prefill forward on a GPU, rounded to hash blocks
GPU_PAD_TOKENS = 4096  # padding a right-padded prefill forward may take on a GPU (Engine.ragged_free)
# GPU default of EngineConfig.prefill_split_tokens: a forward of up to 8,192 tokens (the step budget) in at most eight
# steps of ~5 ms (k3-debug's 1 x 8192 forward: 38 ms on an H100 with the prefill graphs, bench/RESULTS.md 2026-12-05).
# A client's gap spans ~2 tokens of a random-weight model: with 2048 its mixed-stream ITL p99 was 55.8 ms (1.56% of
# gaps over 50 ms), with 1024 45.5 ms (0.65%) at the same TTFT p50 (0.085 s; H100, logs 89 and 90, 2026-12-06)
GPU_PREFILL_SPLIT_TOKENS = 1024
# GPU default of EngineConfig.short_prefill_tokens: ordinary prompts (hundreds of tokens) prefill as graph replays,
# not eager forwards of ~36 ms of launches (at 1 client TTFT p50 71 -> 25 ms on an H200, bench/RESULTS.md 2026-12-04)
SHORT_PREFILL_TOKENS = 256
CHECKPOINT_SPACING_TOKENS = 512  # K3's prefill checkpoint spacing on a GPU (SPEC §7: every 512 tokens)


def default_block_sizes(max_seq_len: int) -> tuple[int, int]:
    """(h, P) keeping K3's ratio P = 12 h: (512, 6144) at K3's 1M context, (16, 192) for toy contexts."""
    h = 512 if max_seq_len >= 1 << 20 else 64 if max_seq_len >= 1 << 16 else 16
    return h, 12 * h


@dataclass
class EngineConfig:
    prefix_cache: bool = True
    hash_block: int | None = None  # None: default_block_sizes
    page_size: int | None = None  # P: tokens per physical page (None: 12 h)
    cache_bytes: int | None = None  # device tier of the prefix cache (None: openk3.serve.capacity's default)
    host_cache_bytes: int = 0
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    max_model_len: int | None = None  # tokens of one sequence at most (None: the model's max_seq_len)
    gpu_memory_utilization: float = 0.9  # of the device's memory, for weights, activations and the caches (CUDA)
    checkpoint_every: int | None = None  # hash blocks between prefill KDA checkpoints (None: 1 on CPU, 512 tokens
    #                                      on a GPU, where each checkpoint splits the Triton KDA call)
    prefill_chunk_blocks: int | None = None  # hash blocks per prefill forward at most (None: 12 on CPU, one
    #                                          physical page at K3's ratio; GPU_PREFILL_CHUNK_TOKENS on a GPU)
    kv_pages: int | None = None  # physical pages in the pool (None: from memory on a GPU, openk3.serve.capacity)
    kernels: str = "auto"  # decode kernels: "triton" (the GPU path), "torch" (the reference), auto: by device
    cuda_graphs: bool = True  # capture decode as CUDA graphs at start-up (CUDA only)
    # with cuda_graphs: capture the prefill forward's per-token work too, per token bucket, the token mixers running
    # eagerly between the graphs (openk3.serve.piecewise)
    prefill_graphs: bool = True
    compile_decode: bool = True  # torch.compile (Inductor) the decode step (CUDA only)
    # torch.compile (Inductor, dynamic shapes) the FFN, norm and AttnRes units that prefill runs (CUDA only;
    # `model.compile.compile_blocks` without the token mixers). Off: prefills of new shapes recompile
    compile_prefill: bool = False
    speculative: int = 0  # draft tokens per verification (needs the engine's draft model); 0: off
    # choose per step between rounds of `speculative` drafts and plain decoding (openk3.serve.speculation); off: every
    # step speculates (but near the context limit)
    auto_speculation: bool = False
    # prompt chunks of at most this many tokens prefill in one static step of the runner, captured as CUDA graphs
    # (`ModelRunner.prefill_short`); None: SHORT_PREFILL_TOKENS on a GPU with CUDA graphs and no draft, else 0 (off)
    short_prefill_tokens: int | None = None
    # queue each decode step before reading the last one's tokens (`Engine._decode`); None: on a GPU
    overlap: bool | None = None
    # eager prefill forwards a step may run while sequences decode (each stalls them all: ~22-40 ms of k3-debug on a
    # GPU); the short graph step is not counted. 0: no limit; None: 1 on a GPU, no limit on a CPU
    prefill_forwards_per_step: int | None = None
    # while sequences decode, a prefill forward the prefill graphs replay (text, no draft) of N tokens (B x T) runs
    # over ceil(N / this) steps, its pieces (a few token mixers each) spread evenly with a decode step between them:
    # its stall of the decoding sequences is split as well. None: GPU_PREFILL_SPLIT_TOKENS on a GPU; 0: off (a
    # forward in one step)
    prefill_split_tokens: int | None = None
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        for name in ("checkpoint_every", "prefill_chunk_blocks", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"engine field {name!r} must be >= 1, got {getattr(self, name)}")
        if self.kv_pages is not None and self.kv_pages < 2:
            raise ValueError(f"engine field 'kv_pages' must be >= 2 (one is the null page), got {self.kv_pages}")
        check_utilization(self.gpu_memory_utilization)
        if self.kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"engine field 'kernels' must be auto, triton or torch, got {self.kernels!r}")
        if self.speculative < 0:
            raise ValueError(f"engine field 'speculative' must be >= 0, got {self.speculative}")
        if self.auto_speculation and not self.speculative:
            raise ValueError("engine field 'auto_speculation' needs 'speculative' > 0 (the drafts of a round)")
        for name in ("short_prefill_tokens", "prefill_split_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"engine field {name!r} must be >= 0, got {getattr(self, name)}")


@dataclass
class EngineMetrics:
    requests_received: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0  # wall time inside `Engine.step`, summed
    slowest_step_seconds: float = 0.0
    prefill_forwards: int = 0  # batched prefill forwards (one per group of equal chunks)
    spec_drafts: int = 0  # speculative verifications (one per sequence and round)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # with a draft: decode steps by the drafts per round chosen for them (0: plain steps), and the speculation policy's
    # moving average of accepted drafts per verification (None: no policy, or nothing verified yet)
    spec_steps: dict[int, int] = field(default_factory=dict)
    spec_accepted_average: float | None = None
    preemptions: int = 0  # running sequences sent back to the queue for want of pages (resumed by recompute)


@dataclass
class InFlight:
    """A decode step queued on the device whose sampled tokens the host has not read yet (`Engine._decode`)."""
    requests: list[Request]
    tokens: torch.Tensor  # [n] on the device: the next step's ids of these rows
    copy: HostCopy  # the same, on its way to the host
    rows: dict[Request, int] = field(init=False)

    def __post_init__(self) -> None:
        self.rows = {r: row for row, r in enumerate(self.requests)}


@dataclass(eq=False)
class SplitPrefill:
    """A prefill forward run over several steps (`EngineConfig.prefill_split_tokens`): the runner's paused forward
    (`ModelRunner.forward_steps`) and how many of its pieces a step runs."""
    chunks: list[tuple[Request, int]]  # (request, end of its chunk)
    steps: Generator
    per_step: int
    requests: set[Request] = field(init=False)

    def __post_init__(self) -> None:
        self.requests = {r for r, _ in self.chunks}


class PoolExhausted(RuntimeError):
    pass


def ragged_groups(chunks: list[tuple], free: int = 0) -> list[list[tuple]]:
    """Chunks (request, end, ...) of different lengths as forwards of right-padded rows: longest first, each forward
    growing while its padding stays within its real tokens and within `free` tokens, or its padded size within
    `free` tokens (a forward that small is bound by its launches, not its arithmetic)."""
    ordered = sorted(chunks, key=lambda c: c[1] - c[0].fed, reverse=True)
    groups: list[list[tuple]] = []
    for chunk in ordered:
        n = chunk[1] - chunk[0].fed
        if groups:
            group = groups[-1]
            longest = group[0][1] - group[0][0].fed
            real = sum(c[1] - c[0].fed for c in group) + n
            if longest * (len(group) + 1) <= max(min(2 * real, real + free), free):
                group.append(chunk)
                continue
        groups.append([chunk])
    return groups


@dataclass(eq=False)
class DraftRound:
    """One speculative round's drafts: each row's drafted tokens and what they were drawn from at each step [B, V]:
    nothing when every row is plain greedy (those rounds compare argmaxes), the draft's logits when the
    temperature alone shapes every row's distribution (`whole_distribution`: one sampling launch per draft and one
    rejection launch per round on a GPU), otherwise the draft's distributions."""

    requests: list[Request]
    drafted: list[list[int]]
    steps: list[torch.Tensor] = field(default_factory=list)

    @property
    def plain_greedy(self) -> bool:
        return all(r.params.greedy and r.params.plain for r in self.requests)

    @property
    def on_logits(self) -> bool:
        return all(r.params.whole_distribution for r in self.requests)


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None,
                 draft: EagleDraft | None = None):
        self.model = model.eval()
        self.model_config = mc = model.config
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        if config.speculative and draft is None:
            raise ValueError("engine field 'speculative' needs a draft model: a checkpoint of `openk3 draft`")
        self.draft = draft if config.speculative else None
        # speculative: each one's pending draft positions: the target features [n, D] of its last n consumed tokens,
        # whose draft latents (at the n positions up to r.fed) the next round's first draft pass writes
        self.features: dict[Request, torch.Tensor] = {}
        self.texts: dict[Request, TextStream] = {}  # each live request's reply text, decoded token by token
        embed = model.model.embed_tokens.weight
        device, dtype = embed.device, embed.dtype
        gpu = device.type == "cuda"
        self.max_model_len = config.max_model_len or mc.max_seq_len
        default_h, _ = default_block_sizes(self.max_model_len)
        h = self.hash_block = config.hash_block or default_h
        P = self.page_size = config.page_size or 12 * h
        if P % h:
            raise ValueError(f"engine field 'page_size' ({P}) must be a multiple of the hash block ({h})")
        self.checkpoint_every = config.checkpoint_every or (max(1, CHECKPOINT_SPACING_TOKENS // h) if gpu else 1)
        self.chunk_blocks = config.prefill_chunk_blocks or (max(12, GPU_PREFILL_CHUNK_TOKENS // h) if gpu else 12)
        sched = config.scheduler
        if sched.prefill_tokens_per_step is None:
            sched = replace(sched, prefill_tokens_per_step=default_batched_tokens(gpu))
        self.idle_prefill = max(sched.prefill_tokens_per_step, self.chunk_blocks * h if gpu else 0)
        # padding a right-padded prefill forward may add (`ragged_groups`): on a GPU, what costs less than a forward's
        # launches (bench/RESULTS.md, 2026-12-05: with the prefill graphs 1 x 512 tokens 23 ms, 1 x 4096 32 ms, each
        # 1k tokens more ~2.5 ms for k3-debug on an H100)
        self.ragged_free = GPU_PAD_TOKENS if gpu else sched.prefill_tokens_per_step
        longest_forward = self.idle_prefill + self.ragged_free  # (ragged_groups' bound on a padded forward)

        n_mla = len(mc.mla_layers) + (self.draft is not None)  # the draft's latents: one more layer of pages
        width = mc.mla.kv_lora_rank + mc.mla.qk_rope_head_dim
        page_bytes = max(1, n_mla * P * width * embed.element_size())
        short = self._short_prefill_tokens(config, gpu)
        # a static step's padding tokens write latents past a row's end: room for them in every table row
        slack = max(short, config.speculative + 1)
        self.tables = BlockTables(sched.max_running, -(-(self.max_model_len + slack) // P), device=device)
        self.states = StatePool(mc, sched.max_running, dtype=dtype, device=device)
        kernels = config.kernels if config.kernels != "auto" else ("triton" if gpu else "torch")
        warm = PagePool(n_mla, 2, P, width, dtype=dtype, device=device)  # the warm-up writes only the null page
        self.runner = ModelRunner(model, warm, self.tables, self.states, max_batch=sched.max_running,
                                  kernels=kernels, cuda_graphs=config.cuda_graphs, draft=self.draft,
                                  speculative=config.speculative if self.draft is not None else 0,
                                  short_prefill=short,
                                  short_prefill_rows=max(1, sched.prefill_tokens_per_step // short) if short else 0,
                                  piecewise_tokens=longest_forward if gpu and config.prefill_graphs else 0,
                                  compile_backend="inductor" if config.compile_decode and gpu else None,
                                  prefill_compile_backend="inductor" if config.compile_prefill and gpu else None)
        if gpu:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        # the start-up's phases and their seconds (compiling included), those that ran: `openk3 serve` prints them
        self.startup_seconds: dict[str, float] = {}
        if gpu or self.runner.prefill_compiled:  # first: a unit that fails to compile goes back to eager
            longest = min(self.chunk_blocks * h, self.max_model_len // h * h)  # the longest prefill forward
            self.startup_seconds["prefill warm-up"] = self.runner.warm_up_prefill(
                long=(longest, self._checkpoint_offsets(0, longest)))
        # the prefill graphs' pool, measured apart from the warm-up's peak (the capture's own allocations would
        # count it twice) and without the blocks the capture's warm-ups left cached
        before, peak = self._reserved_after_empty_cache(device)
        self.startup_seconds["prefill graphs"] = self.runner.capture_prefill()
        prefill_graph_bytes = self._reserved_after_empty_cache(device)[0] - before
        peak += prefill_graph_bytes
        if gpu:  # the sampling kernel's first use compiles it (~0.2 s): not inside a request's first step
            sample_tokens(torch.zeros(1, mc.vocab_size, device=device), [SamplingParams(temperature=1.0)],
                          [request_rng(0)])
            log.info("device memory: %.2f GiB allocated at most before the cache (prefill graphs %.2f GiB)",
                     peak / GiB, prefill_graph_bytes / GiB)
        self.capacity = self._capacity(page_bytes, device, peak)
        del warm
        self.pages = PagePool(n_mla, self.capacity.pages, P, width, dtype=dtype, device=device)
        self.runner.attach_pages(self.pages)
        reserved = torch.cuda.memory_reserved(device) if gpu else 0
        self.startup_seconds["decode graphs"] = self.runner.capture()
        nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)
        self.memory = {  # bytes on the device by part (/metrics: openk3_memory_bytes)
            "weights": nbytes({id(t): t for t in (*model.parameters(), *model.buffers())}.values()),
            "latent_pages": nbytes([self.pages.pages]),
            "kda_states": nbytes([self.states.conv, self.states.recurrent]),
            "cuda_graphs": torch.cuda.memory_reserved(device) - reserved + prefill_graph_bytes if gpu else 0,
        }
        # dynamic speculation: a round's cost against a plain step's, timed per batch bucket on a GPU
        start = time.perf_counter()
        self.policy = (SpecPolicy(config.speculative, self.runner.round_costs() if gpu else None)
                       if config.auto_speculation and self.draft is not None else None)
        self.startup_seconds["speculation round costs"] = time.perf_counter() - start
        self.startup_seconds = {name: t for name, t in self.startup_seconds.items() if t >= 0.05}

        self.prefix_cache = PrefixCache(PrefixCacheConfig(
            hash_block=h, page_size=P, page_bytes=page_bytes,
            device_bytes=self.capacity.cache_bytes, host_bytes=config.host_cache_bytes,
            disk_dir=config.disk_cache_dir, disk_bytes=config.disk_cache_bytes, device=str(device),
        ), store=self.pages) if config.prefix_cache else None
        if gpu and self.prefix_cache is not None:
            # the device tier's KDA checkpoints (k3-debug: 4.7 MiB each, one every 512 prompt tokens) are carved out
            # of one segment the caching allocator keeps from now on: allocated as prefills went, each had been a
            # cudaMalloc of its own (~500 for a 256k-token prompt)
            torch.empty(self.capacity.cache_bytes, dtype=torch.uint8, device=device)
        self.scheduler = Scheduler(sched)
        self.metrics = EngineMetrics()
        self.phases = StepPhases()
        self.stop_ids = set(tokenizer.stop_ids)
        self.vocab_limit = min(tokenizer.vocab_size, mc.vocab_size)
        self.overlap = (config.overlap if config.overlap is not None else gpu) and self.draft is None
        forwards = config.prefill_forwards_per_step
        self.prefill_forwards_per_step = forwards if forwards is not None else int(gpu)
        split = config.prefill_split_tokens
        self.prefill_split_tokens = split if split is not None else GPU_PREFILL_SPLIT_TOKENS if gpu else 0
        self._inflight: InFlight | None = None
        self._split: SplitPrefill | None = None  # a prefill forward paused between steps
        self._lock = threading.Lock()
        self._cancels: set[str] = set()
        self._ids = itertools.count()
        self.wake = threading.Event()
        self._outbox: list[tuple[Callable[[RequestEvent], None], RequestEvent]] = []  # the step's events
        # called with a step's events [(on_event, event)] instead of each on_event (openk3.serve.api sets it)
        self.event_sink: Callable[[list], None] | None = None

    @staticmethod
    def _reserved_after_empty_cache(device: torch.device) -> tuple[int, int]:
        """(bytes the allocator holds once its unused cached blocks are released, peak bytes allocated so far) on
        a GPU; (0, 0) elsewhere."""
        if device.type != "cuda":
            return 0, 0
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(device), torch.cuda.max_memory_allocated(device)

    def _capacity(self, page_bytes: int, device: torch.device, peak_bytes: int = 0) -> Capacity:
        """The pool's size (openk3.serve.capacity): from the device's free memory on a GPU, measured after the
        weights, the state pool, the longest prefill forward's warm-up and the prefill graphs (`peak_bytes`: the
        warm-up's peak allocation plus the graphs' pool); else fixed."""
        config = self.config
        fields = dict(page_bytes=page_bytes, page_size=self.page_size, max_model_len=self.max_model_len,
                      cache_bytes=config.cache_bytes, prefix_cache=config.prefix_cache)
        if device.type != "cuda" or config.kv_pages is not None:
            return fixed_capacity(kv_pages=config.kv_pages, max_num_seqs=config.scheduler.max_running, **fields)
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return gpu_capacity(total=total, free=free, reserved=torch.cuda.memory_reserved(device),
                            peak_allocated=peak_bytes,
                            utilization=config.gpu_memory_utilization, **fields)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of one KDA checkpoint (every KDA layer's conv window and recurrent state)."""
        return sum(t[:, 0].numel() * t.element_size() for t in (self.states.conv, self.states.recurrent))

    # ---- the client side (thread-safe) --------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams, rid: str | None = None,
                    on_event=None, after: Request | None = None, images: list | None = None,
                    every_token: bool = True) -> Request:
        """Queue a request; raises ValueError for an unusable prompt and QueueFull when throttled. `after`: an
        earlier request with the same prompt (another choice of one API request, OpenAI's `n`); with the prefix
        cache on, this one is admitted once that one has prefilled, so it hits the prompt's cached blocks instead of
        prefilling them again. `images`: prepared images (openk3.images.PreparedImage) whose placeholder runs the
        prompt holds, in order. `every_token`: an event per token (a stream); False: only the first token's (its
        time to first token) and the last, which carries everything not yet sent (a reply sent whole)."""
        located = check_prompt(prompt, self.max_model_len, self.model_config, images)
        number = next(self._ids)
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + number
        request = Request(rid=rid or f"req-{number}", prompt=list(prompt), params=params, on_event=on_event,
                          rng=request_rng(seed), images=located if images else None,
                          after=after if self.prefix_cache is not None else None, every_token=every_token)
        with self._lock:
            self.scheduler.submit(request)
            self.texts[request] = TextStream(self.tokenizer)
            self.metrics.requests_received += 1
        self.wake.set()
        return request

    def cancel(self, rid: str) -> None:
        """Stop a request at the next step boundary and free its pages, slot and locks."""
        with self._lock:
            self._cancels.add(rid)
        self.wake.set()

    def snapshot(self) -> dict:
        """Copies of what /metrics reports (openk3.serve.metrics): the counters, the queue, the prefix cache's
        statistics and utilisation, the memory by part; small and picklable (an engine process sends one a step)."""
        m, cache = self.metrics, self.prefix_cache
        return {"metrics": replace(m, requests_finished=dict(m.requests_finished), spec_steps=dict(m.spec_steps)),
                "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "cache_stats": replace(cache.stats) if cache is not None else None,
                "cache_utilisation": cache.utilisation if cache is not None else 0.0, "memory": dict(self.memory)}

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._cancels or self._inflight
                    or self._split)

    # ---- one step -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        started, prefills = time.perf_counter(), self.metrics.prefill_forwards
        collecting = collector_clock().read()
        self.phases.reset()
        try:
            self._step()
        finally:
            self._deliver_events()
            self.phases.mark("events")
            self._time_step(time.perf_counter() - started, self.metrics.prefill_forwards - prefills, collecting)

    def _time_step(self, seconds: float, prefills: int, collecting: tuple[float, int]) -> None:
        m = self.metrics
        m.step_seconds += seconds
        m.slowest_step_seconds = max(m.slowest_step_seconds, seconds)
        if seconds > SLOW_STEP_S:  # one step stalls every running sequence: say what it held
            gc_seconds, collections = (now - before for now, before in zip(collector_clock().read(), collecting))
            log.info("slow engine step: %.0f ms with %d prefill forwards, %d running, %d waiting; phases: %s; garbage "
                     "collector %.1f ms in %d collections", seconds * 1e3, prefills, len(self.scheduler.running),
                     len(self.scheduler.waiting), self.phases.line(), gc_seconds * 1e3, collections)

    def _short_prefill_tokens(self, config: EngineConfig, gpu: bool) -> int:
        if config.short_prefill_tokens is not None:
            if config.short_prefill_tokens and self.draft is not None:
                raise ValueError("engine field 'short_prefill_tokens' must be 0 with speculative decoding (its "
                                 "prefill also writes the draft's latents)")
            return config.short_prefill_tokens
        return SHORT_PREFILL_TOKENS if gpu and config.cuda_graphs and self.draft is None else 0

    def _step(self) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            splitting = self._split.requests if self._split is not None else set()
            for r in [r for r in (*self.scheduler.waiting, *self.scheduler.running) if r.rid in cancels]:
                if r in splitting:  # its forward writes its slot and pages until it ends: cancelled after it
                    self._cancels.add(r.rid)
                else:
                    self._finish(r, "cancelled")
            # (the locked fraction walks the prefix cache's pages: only when a request waits to be admitted)
            admitted = self.scheduler.admit(self._locked_fraction(), self._fits()) if self.scheduler.waiting else []
        for r in admitted:
            with self._isolated([r]):
                self._start(r)
        self.phases.mark("admit")
        ready = [r for r in self.scheduler.running if not r.prefilling and not self._ends_in_flight(r)]
        K, limit = self._drafts_per_round(len(ready)), self.max_model_len
        speculating, decoding = [], []
        for r in ready:
            if K and r.fed + K + 1 <= limit and self._has_pages(r, r.fed + K + 1):
                speculating.append(r)
            elif self._has_pages(r, r.fed + 1):
                decoding.append(r)
        # (a later sequence's pages may have preempted an earlier one)
        speculating, decoding = ([r for r in rows if r.slot is not None] for rows in (speculating, decoding))
        if speculating:
            with self._isolated(speculating):
                self._speculate(speculating)
            self.phases.mark("speculate")
        if decoding:
            with self._isolated(decoding):
                self._decode(decoding)
        else:
            self._drain()
        # the step's prefill budget protects decoding sequences' inter-token latency; with none decoding, a long
        # prompt goes in chunks as long as the engine's longest forward (on a GPU)
        # and, with sequences decoding, at most `prefill_forwards_per_step` eager forwards (the longest chunks first)
        stalls = speculating or decoding
        budget = self.scheduler.config.prefill_tokens_per_step if stalls else self.idle_prefill
        limit, eager = (self.prefill_forwards_per_step if stalls else 0), 0
        if self._split is not None:  # the step's eager forward: the paused one's next pieces (all, with none decoding)
            eager = 1
            self._advance_split(whole=not stalls)
        busy = self._split.requests if self._split is not None else ()
        for round_ in self.scheduler.prefill_rounds(self._chunk_end, budget, align=self.hash_block, skip=busy):
            held = False  # a chunk held back for the next step: the later rounds (which may continue it) wait too
            for group, offsets, short in self._prefill_groups([(r, end) for r, end in round_
                                                               if self._has_pages(r, end)]):
                group = [(r, end) for r, end in group if r.slot is not None]  # (preempted since)
                if not group:
                    continue
                if limit and not short and eager >= limit:
                    held = True
                    continue
                eager += not short
                with self._isolated([r for r, _ in group]):
                    self._prefill(group, offsets, short, split=bool(stalls))
                if self._split is not None:  # its requests' later chunks (in the later rounds) wait for it
                    held = True
                    break
            if held:
                break
        self.phases.mark("prefill")
        self.metrics.steps += 1

    def _drafts_per_round(self, batch: int) -> int:
        """The step's K for `batch` decoding sequences: the configured one, the policy's choice, or 0 (no draft)."""
        if self.draft is None or not batch:
            return 0
        k = self.policy.choose(batch) if self.policy is not None else self.config.speculative
        self.metrics.spec_steps[k] = self.metrics.spec_steps.get(k, 0) + 1
        return k

    def _prefill_groups(self, chunks: list[tuple[Request, int]]):
        """A round's prefill chunks (request, end) as forwards: (chunks, checkpoint offsets, short). Chunks of at most
        `short_prefill` tokens without a KDA checkpoint inside go together through the runner's short step (unless
        the round has longer chunks whose forward they can join as padded rows); chunks
        with image tokens or a draft to feed go with chunks of the same length and offsets; the rest, of any
        lengths, are right-padded together (`ragged_groups`), each forward taking the union of its rows' checkpoint
        offsets: the KDA pass yields every row's state at each of them, and a row reads those within its chunk
        (the state after that many of its own tokens; aligned chunks share their offsets)."""
        alike: dict[tuple[int, tuple[int, ...]], list[tuple[Request, int]]] = {}
        short, ragged = [], []
        for r, end in chunks:
            offsets = self._checkpoint_offsets(r.fed, end, r.prefill_len)
            inside = tuple(o for o in offsets if o < end - r.fed)  # the chunk's end state is the slot's own
            if r.images is not None or self.draft is not None:
                alike.setdefault((end - r.fed, offsets), []).append((r, end))
            elif end - r.fed <= self.runner.short_prefill and not inside:
                short.append((r, end))
            else:
                ragged.append((r, end, inside))
        # the short chunks ride in a longer chunk's forward as padded rows where they fit (`ragged_groups`); those
        # left in groups of short chunks alone take the short step
        shorts = {r for r, _ in short}
        groups = ragged_groups(ragged + [(r, end, ()) for r, end in short], free=self.ragged_free)
        only_short = [all(r in shorts for r, *_ in group) for group in groups]
        if any(only_short):
            yield [(r, end) for group, alone in zip(groups, only_short) if alone for r, end, _ in group], (), True
        for group, alone in zip(groups, only_short):
            if not alone:
                yield ([(r, end) for r, end, _ in group],
                       tuple(sorted({o for *_, inside in group for o in inside})), False)
        for (_, offsets), group in alike.items():
            yield group, offsets, False

    @contextmanager
    def _isolated(self, requests: list[Request]):
        """Run one piece of a step's work on `requests`: admitting one, giving one pages, one sequence's sampling
        and bookkeeping after a forward, or a batched forward. If it raises, those requests alone end with
        finish_reason "error" (their pages, slot and locks are freed) and the step goes on for every other request.
        A forward's failure cannot be pinned on one row, so it ends its whole batch."""
        try:
            yield
        except Exception:
            log.exception("engine work on %s failed; ending it alone", ", ".join(r.rid for r in requests))
            for r in requests:
                if r.finish_reason is None:
                    self._finish(r, "error")

    def _locked_fraction(self) -> float:
        cache = self.prefix_cache
        if cache is None:
            return 0.0
        locked = sum(cache.config.page_bytes for p in cache.pages if p.locks)
        return locked / cache.config.device_bytes

    def _turn_boundary(self, n: int) -> int:
        """Where a prompt of n tokens to prefill gets its turn checkpoint: the last hash-block boundary before its
        last token. The same prompt again may hit the cache up to n - 1 tokens (one is prefilled to sample from),
        so for n on a boundary this is n - h, and that request prefills one block; n itself is also recorded (a
        chunk's end on a boundary), where the conversation's next turn resumes."""
        return (n - 1) // self.hash_block * self.hash_block

    def _chunk_end(self, r: Request, pos: int) -> int:
        h, n = self.hash_block, r.prefill_len
        end, turn = min((pos // h + self.chunk_blocks) * h, n), self._turn_boundary(n)
        if pos < turn < end and end - pos <= self.runner.short_prefill:
            return turn  # two short-step replays, not an eager forward for the turn boundary's checkpoint inside
        return end

    def _checkpoint_offsets(self, start: int, end: int, prefill_len: int = 0) -> tuple[int, ...]:
        """Offsets into a prefill chunk [start, end) where KDA checkpoints are wanted: every `checkpoint_every`
        hash blocks, the turn boundary of the `prefill_len` tokens to prefill (`_turn_boundary`) and the chunk's end
        when it is a hash-block boundary."""
        h, span = self.hash_block, self.hash_block * self.checkpoint_every
        ends = set(range((start // span + 1) * span, end + 1, span))
        turn = self._turn_boundary(prefill_len)
        if start < turn <= end:
            ends.add(turn)
        if end % h == 0:
            ends.add(end)
        return tuple(sorted(e - start for e in ends))

    # ---- pages, slots, admission and preemption ------------------------------------------------------------
    def _alloc_page(self) -> int | None:
        """A free physical page, evicting unlocked prefix-cache pages when the pool is full; None if none is left."""
        pid = self.pages.alloc()
        while pid is None and self.prefix_cache is not None and self.prefix_cache.evict_page():
            pid = self.pages.alloc()
        return pid

    def _has_pages(self, r: Request, tokens: int) -> bool:
        """Give a live sequence pages for its first `tokens` positions, preempting the latest admitted sequences
        while none is left (`_preempt`); False if it is over, or was preempted itself."""
        while r.finish_reason is None and r.slot is not None and \
                len(self.tables.pages[r.slot]) * self.page_size < tokens:
            with self._isolated([r]):
                pid = self._alloc_page()
                if pid is None and self._inflight is not None:
                    self._drain()  # finished rows free pages, and a victim's output must be whole
                    if r.finish_reason is not None:
                        return False
                    pid = self._alloc_page()
                while pid is None:
                    if self._split is not None:  # the latest admitted may be its requests: it ends first
                        self._advance_split(whole=True)
                    victim = next(v for v in reversed(self.scheduler.running) if v.slot is not None)
                    if victim is r and sum(v.slot is not None for v in self.scheduler.running) == 1:
                        raise PoolExhausted(f"all {self.pages.num_pages} latent pages are in use by one sequence")
                    self._preempt(victim)
                    if victim is r:
                        return False
                    pid = self._alloc_page()
                self.tables.append(r.slot, pid)
        return r.finish_reason is None and r.slot is not None

    def _preempt(self, r: Request) -> None:
        """Send a running sequence back to the head of the queue for want of pages: its pages, slot and cache lease
        go, its output stays; re-admitted, it prefills its prompt and output again (recompute) and decodes on."""
        if r.lease is not None:
            self.prefix_cache.release(r.lease)
            r.lease = None
        self._release_resources(r)
        r.fed = 0
        self.scheduler.preempt(r)
        self.metrics.preemptions += 1
        log.info("preempted %s at %d tokens: the latent pages ran out (%d running)", r.rid, r.length,
                 len(self.scheduler.running))

    def _fits(self) -> Callable[[Request], bool]:
        """Admission's memory check for one step: a request fits while its prefill's pages (those of the earlier
        admissions of the step counted) leave a watermark of the pool free or evictable. With the prefix cache a
        request may need one page more: a hit ending inside a page it cannot write on takes a copy of that page at
        admission (`_start`), while the hit's pages, evictable before, stay locked."""
        available = self.pages.num_free + self._evictable_pages() - self.pages.num_pages // 100
        if not self.states.num_free:
            return lambda r: False
        copy = int(self.prefix_cache is not None)

        def fits(r: Request) -> bool:
            nonlocal available
            need = -(-(r.prefill_len + 1) // self.page_size) + copy
            available -= need
            return available >= 0

        return fits

    def _evictable_pages(self) -> int:
        """Physical pages only the prefix cache holds and no running sequence has locked."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        return sum(1 for p in cache.pages if not p.locks and p.phys is not None and self.pages.refs[p.phys] == 1)

    def _start(self, r: Request) -> None:
        """Admission: a slot, and on a prefix hit the hit's pages (shared) and its KDA checkpoint (loaded)."""
        if not r.preemptions:
            self.metrics.prompt_tokens += len(r.prompt)
        r.slot = self.states.alloc()
        if r.slot is None:
            raise PoolExhausted("no free KDA state slot")
        if self.prefix_cache is not None:
            self._take_hit(r, r.prefill_len - 1)

    def _take_hit(self, r: Request, max_hit: int) -> None:
        """Admission's prefix hit of at most `max_hit` tokens: its pages shared into the request's table, a copy of
        the last one where the hit ends inside a page it cannot write on, and its KDA checkpoint loaded. Where no
        page is left for that copy, the hit up to that page's start instead (none to copy): a shorter hit, not a
        failed request."""
        tokens = self._cache_tokens(r)
        while True:
            r.lease = self.prefix_cache.acquire(tokens, max_hit=max_hit)
            hit = r.lease.hit_tokens
            if not hit:
                return
            pages = list(r.lease.hit_pages)
            for pid in pages:
                self.pages.retain(pid)
            self.tables.set(r.slot, pages)  # (a failure from here on releases them with the slot)
            partial = hit % self.page_size
            if not partial or r.lease.owns_tail:
                break
            own = self._alloc_page()  # copy-on-write: the hit's part of a page others write
            if own is not None:
                self.pages.copy_prefix(pages[-1], own, partial)
                self.pages.release(pages[-1])
                self.tables.replace_last(r.slot, own)
                break
            for pid in self.tables.clear(r.slot):
                self.pages.release(pid)
            self.prefix_cache.release(r.lease)
            max_hit = hit - partial
        self.states.load(r.slot, r.lease.hit_checkpoint)
        if self.draft is not None and r.lease.hit_checkpoint.get("feature") is not None:
            self.features[r] = r.lease.hit_checkpoint["feature"].unsqueeze(0)
        r.fed = hit
        if not r.preemptions:  # (what usage reports: the prompt's hit at its first admission)
            r.cached_tokens = hit

    def _release_resources(self, r: Request) -> None:
        self.features.pop(r, None)
        if r.slot is not None:
            for pid in self.tables.clear(r.slot):
                self.pages.release(pid)
            self.states.free(r.slot)
            r.slot = None

    @staticmethod
    def _cache_tokens(r: Request, since: int = 0) -> list[int]:
        """The sequence from position `since` on as the prefix cache keys it: images by content
        (PromptImages.cache_prompt, one key per token)."""
        prompt = r.prompt if r.images is None else r.images.cache_prompt
        return prompt[since:] + r.output[max(0, since - len(prompt)):]

    # ---- forwards -----------------------------------------------------------------------------------------
    def _decode(self, requests: list[Request]) -> None:
        """One token for every decoding sequence (their pages are in place); with a draft, each one's feature of
        the token joins its pending positions (module docstring).

        With `overlap`, a step of rows whose sampling needs nothing from the host's side of the reply (`plain`
        parameters) is queued whole, sampling included, and the host reads the previous step's tokens while the
        device runs it: a row that was in that step takes its id from the device (`InFlight`). So the host's
        bookkeeping of one step (detokenizing, stop strings, events, the next step's inputs) runs beside the
        device's work of the next. A row the previous step ended (a stop token) has then run one step too many:
        its output is dropped and its slot and pages are freed after it in stream order. Hash blocks are
        registered once the tokens before them are known, before the next step is queued (the slot's state is
        the block's)."""
        inflight = self._inflight
        sources = [inflight.rows.get(r, -1) for r in requests] if inflight is not None else []
        carried = (inflight.tokens, sources) if any(i >= 0 for i in sources) else None
        ids = [r.output[-1] if not sources or sources[row] < 0 else 0 for row, r in enumerate(requests)]
        slots, lengths = [r.slot for r in requests], [r.fed for r in requests]
        features = None
        if self.draft is None:
            logits = self.runner.decode(ids, slots, lengths, carried)
        else:
            self._write_pending(requests)
            logits, features = self.runner.decode_with_features(ids, slots, lengths)
        plain = self.overlap and all(r.params.plain for r in requests)
        tokens = self._batch_tokens(requests, logits[:, : self.vocab_limit]) if plain else None
        self.phases.mark("decode launch")
        self._drain()
        if tokens is not None:
            for r in requests:
                r.fed += 1
            self._inflight = InFlight(requests, tokens, HostCopy(tokens))
            for r in requests:
                if r.finish_reason is None and r.slot is not None:
                    with self._isolated([r]):
                        self._register_blocks(r, r.fed - 1)
            self.phases.mark("prefix cache")
            return
        sample = self._sampler(requests, logits)
        for row, r in enumerate(requests):
            if r.finish_reason is not None:  # (ended by the previous step's token)
                continue
            with self._isolated([r]):
                token = sample(row)
                r.fed += 1
                if features is not None:
                    self.features[r] = torch.cat([self._pending(r), features[row : row + 1]])
                self._register_blocks(r, r.fed - 1)
                self._accept(r, token)
        self.phases.mark("sample and accept")

    def _ends_in_flight(self, r: Request) -> bool:
        """Whether the token of r's queued step ends it for length (`_accept`): then it takes no step more."""
        if self._inflight is None or r not in self._inflight.rows:
            return False
        return len(r.output) + 1 >= r.params.max_tokens or r.length + 1 >= self.max_model_len

    def _drain(self) -> None:
        """Read the queued step's tokens (`_decode`) and take them into the replies."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        tokens = inflight.copy.tolist()
        self.phases.mark("device wait")
        for r, token in zip(inflight.requests, tokens):
            if r.finish_reason is None:
                with self._isolated([r]):
                    self._accept(r, token)
        self.phases.mark("accept")

    def _write_pending(self, requests: list[Request]) -> None:
        """Before a plain step: the draft's latents of the sequences whose pending positions fill a first draft
        pass (K + 1), in one such pass; each keeps its last pending position (its latent rewritten alike by the
        next pass, which reads the draft's hidden state there)."""
        K = self.config.speculative
        full = [r for r in requests if len(self._pending(r)) == K + 1]
        if full:
            self.runner.draft_pass(torch.stack([self.features[r] for r in full]),
                                   [r.output[-(K + 1):] for r in full], [r.slot for r in full],
                                   [r.fed - K for r in full], [K] * len(full))
            for r in full:
                self.features[r] = self.features[r][-1:]

    def _pending(self, r: Request) -> torch.Tensor:
        """The target features [n, D] of the last n tokens the target consumed, whose draft latents are pending
        (one row of zeros when none is known: before the first token, or after a prefix hit on a checkpoint without
        one)."""
        if r in self.features:
            return self.features[r]
        return self.model.model.embed_tokens.weight.new_zeros(1, self.model_config.hidden_size)

    def _speculate(self, requests: list[Request]) -> None:
        """One speculative round for every sequence in `requests` (module docstring; their pages are in place)."""
        K, runner = self.config.speculative, self.runner
        slots, starts = [r.slot for r in requests], [r.fed for r in requests]
        # the first draft pass: each row's pending positions (up to K + 1, ending at r.fed; rows padded to K + 1:
        # the padding's latents, past r.fed, are rewritten before anything reads them), its output at r.fed
        pending = [self._pending(r) for r in requests]
        prev = pad_sequence(pending, batch_first=True)
        prev = F.pad(prev, (0, 0, 0, K + 1 - prev.shape[1]))  # [B, K+1, D]
        ids = [r.output[-len(p):] + [0] * (K + 1 - len(p)) for r, p in zip(requests, pending)]
        hidden, logits = runner.draft_pass(prev, ids, slots, [n + 1 - len(p) for n, p in zip(starts, pending)],
                                           [len(p) - 1 for p in pending])
        drafts = DraftRound(requests, [[] for _ in requests])
        # where no draw needs the drafts so far on the host (greedy rows, or the temperature alone shaping every
        # row), the K draft passes and the verification are queued back to back, each pass reading the last one's
        # tokens on the device; the host reads the K drafts at once
        chained = drafts.plain_greedy or drafts.on_logits
        drawn = []
        for i in range(K):
            drawn.append(self._draw_drafts(drafts, logits[:, : self.vocab_limit], to_host=not chained))
            if i + 1 < K:
                hidden, logits = runner.draft_pass(hidden.unsqueeze(1), drawn[-1].unsqueeze(1), slots,
                                                   [n + 1 + i for n in starts], [0] * len(requests))
        drafted = torch.stack(drawn, 1)  # [B, K]
        copy = HostCopy(drafted) if chained else None  # (queued before the verification: it waits for the drafts)
        last = to_device([[r.output[-1]] for r in requests], drafted.device)
        logits, features = runner.verify(torch.cat([last, drafted], 1), slots, starts)
        if copy is not None:
            drafts.drafted = copy.tolist()
        logits = logits[..., : self.vocab_limit]
        kept = self._verify(drafts, logits)
        runner.roll_back(slots, [len(tokens) for tokens in kept])
        if self.policy is not None:
            self.policy.observe([len(tokens) - 1 for tokens in kept])
            self.metrics.spec_accepted_average = self.policy.accepted
        checkpoints = {o: {"conv": runner.conv_out[:, :, o - 1], "recurrent": runner.recurrent_out[:, :, o - 1]}
                       for o in range(1, K + 1)}
        for row, (r, tokens) in enumerate(zip(requests, kept)):
            with self._isolated([r]):
                start, r.fed = r.fed, r.fed + len(tokens)
                self.features[r] = features[row, : len(tokens)].clone()
                self._register_blocks(r, start, checkpoints, row, features, pending=tokens[:-1])
                self.metrics.spec_drafts += 1
                self.metrics.spec_draft_tokens += K
                self.metrics.spec_accepted_tokens += len(tokens) - 1
                host = logits[row].float().cpu() if r.params.logprobs is not None else None
                for j, token in enumerate(tokens):
                    if host is not None:
                        r.logprobs.append(token_logprobs(host[j], token, r.params.logprobs))
                    self._accept(r, token)
                    if r.finish_reason is not None:
                        break

    def _draw_drafts(self, drafts: DraftRound, logits: torch.Tensor, to_host: bool) -> torch.Tensor:
        """Each row's next drafted token [B] (on the device) from the draft's logits [B, V], and the distributions
        they came from; with `to_host` also appended to `drafts.drafted` now (one copy of the tokens to the host)."""
        params, requests = [r.params for r in drafts.requests], drafts.requests
        if drafts.plain_greedy:
            tokens = logits.argmax(-1)
        elif drafts.on_logits:
            tokens = sample_tokens(logits, params, [r.rng for r in requests])
            drafts.steps.append(logits.clone())  # the draft pass's output buffer is rewritten by the next pass
        else:
            q = target_distributions(logits, params, [[*r.output, *d] for r, d in zip(requests, drafts.drafted)])
            tokens = draw(q, params, [r.rng for r in requests])
            drafts.steps.append(q)
        if to_host:
            for d, token in zip(drafts.drafted, host_list(tokens)):
                d.append(token)
        return tokens

    def _verify(self, drafts: DraftRound, logits: torch.Tensor) -> list[list[int]]:
        """Each row's accepted drafts plus one target token, from the verification's logits [B, K+1, V]."""
        if drafts.plain_greedy:
            return [accept_greedy(d, picks) for d, picks in zip(drafts.drafted, host_list(logits.argmax(-1)))]
        requests = drafts.requests
        params, rngs = [r.params for r in requests], [r.rng for r in requests]
        if drafts.on_logits:
            return accept_drafts_on_logits(drafts.drafted, torch.stack(drafts.steps, 1), logits, params, rngs)
        return accept_drafts(drafts.drafted, torch.stack(drafts.steps, 1), logits, params, rngs,
                             [r.output for r in requests])

    def _prefill(self, chunks: list[tuple[Request, int]], offsets: tuple[int, ...] = (), short: bool = False,
                 split: bool = False) -> None:
        """The next chunk of each request's prompt, (request, end of its chunk), in one forward: chunks of one length
        with the KDA checkpoint `offsets`, chunks of any lengths without (right-padded), or with `short` all short
        (the runner's short-prefill step). See `_prefill_groups`. With `split` (sequences are decoding) a forward
        that can pause runs over several steps (`prefill_split_tokens`, `_advance_split`)."""
        self.metrics.prefill_forwards += 1
        requests, ends = [r for r, _ in chunks], [end for _, end in chunks]
        images = [e for r, end in chunks if r.images for e in r.images.chunk_embeds(r.fed, end, self.model)]
        image_embeds = torch.cat(images) if images else None
        tokens = [(r.tokens if r.output else r.prompt)[r.fed:end] for r, end in zip(requests, ends)]
        slots, starts = [r.slot for r in requests], [r.fed for r in requests]
        features = None
        if short:
            logits, checkpoints = self.runner.prefill_short(tokens, slots, starts), {}
        elif self.draft is None:
            steps = self.runner.forward_steps(tokens, slots, starts, offsets, image_embeds=image_embeds)
            size = len(tokens) * max(map(len, tokens))
            pauses = self.runner.forward_pauses(size, image_embeds is not None)
            # (one paused forward at a time: with another under way, this one runs whole)
            splits = split and pauses and self.prefill_split_tokens and self._split is None
            over = -(-size // self.prefill_split_tokens) if splits else 1
            if over > 1:  # the first pieces now, the rest in the next steps
                self._split = SplitPrefill(list(chunks), steps, per_step=-(-(pauses + 1) // min(over, pauses + 1)))
                self._advance_split()
                return
            logits, checkpoints, _ = run_to_end(steps)
            logits = logits[:, -1]
        else:  # and the draft's latents of the chunk: position t reads (F_{t-1}, token t)
            logits, checkpoints, features = self.runner.forward(tokens, slots, starts, offsets,
                                                                image_embeds=image_embeds)
            logits = logits[:, -1]
            prev = torch.stack([self._pending(r)[-1] for r in requests]).unsqueeze(1)
            self.runner.draft_step(torch.cat([prev, features[:, :-1]], dim=1), to_device(tokens, prev.device),
                                   slots, starts)
        self._prefilled(chunks, logits, checkpoints, features)

    def _advance_split(self, whole: bool = False) -> None:
        """Run the paused prefill forward's next pieces (all of them with `whole`); when it ends, take its result
        as `_prefill` does. Should it raise, its requests end alone ("error")."""
        split = self._split
        with self._isolated(list(split.requests)):
            try:
                for _ in itertools.count() if whole else range(split.per_step):
                    next(split.steps)
                return
            except StopIteration as done:
                self._split = None
                logits, checkpoints, _ = done.value
            except Exception:
                self._split = None  # (the next forward may run; its requests end)
                raise
            self._prefilled(split.chunks, logits[:, -1], checkpoints)

    def _prefilled(self, chunks: list[tuple[Request, int]], logits: torch.Tensor, checkpoints: dict,
                   features: torch.Tensor | None = None) -> None:
        """After a prefill forward of `chunks`: each request's fed position moves to its chunk's end, its completed
        hash blocks go to the prefix cache, and the rows that end their prompt sample their first token (logits
        [B, vocab])."""
        requests, ends = [r for r, _ in chunks], [end for _, end in chunks]
        # only the rows that end their prompt sample (and draw from their random source); a preempted sequence
        # prefilling its output again has its next token already
        ending = [row for row, (r, end) in enumerate(chunks) if end == r.prefill_len and not r.output]
        sample = self._sampler([requests[row] for row in ending], logits[ending])
        sampled_row = {row: i for i, row in enumerate(ending)}  # batch row -> its row among the sampled ones
        for row, (r, end) in enumerate(zip(requests, ends)):
            with self._isolated([r]):
                start, r.fed = r.fed, end
                if features is not None:
                    self.features[r] = features[row, -1:]
                self._register_blocks(r, start, checkpoints, row, features)
                if row in sampled_row:
                    r.first_token_at = time.perf_counter()
                    self._accept(r, sample(sampled_row[row]))

    def _register_blocks(self, r: Request, start: int, checkpoints: dict | None = None, row: int = 0,
                         features: torch.Tensor | None = None, pending: Sequence[int] = ()) -> None:
        """Hand the hash blocks completed between `start` and `r.fed` to the prefix cache: the page holding their
        latents, and the KDA states at each block end the forward recorded (or, at `r.fed`, the slot's state), with
        the draft feature of the block's last token when speculating (from the forward's `features` [B, T, D]).
        `pending`: tokens the forward consumed that are not in r.output yet (a speculative round's accepted drafts).
        Only the blocks' tokens are copied, not the sequence before them (most decode tokens complete no block). A
        forward's end (a prefill chunk, a speculative round) takes the slot's state; a plain decode step only where a
        prefill would checkpoint (every `checkpoint_every` blocks): a block without a checkpoint still shares its
        page, and a later hit resumes from the checkpoint before it. Snapshotting at every block end copied each
        decoding sequence's KDA states every h tokens: with a `max_model_len` under 64k (h = 16) and
        kimi-linear-48b's 41 MiB a sequence, 256 sequences decoding in step copied 10 GiB every 16 steps into the
        prefix cache, 32 times what the prefill's 512-token spacing keeps."""
        h = self.hash_block
        base = start // h * h
        ends = range(base + h, r.fed + 1, h)
        if self.prefix_cache is None or r.lease.detached or not ends:
            return
        tokens = self._cache_tokens(r, since=base) + list(pending)  # positions base..r.fed as the cache keys them
        for end in ends:
            if end == r.fed and (checkpoints is not None or end % (h * self.checkpoint_every) == 0):
                ckpt = self.states.snapshot(r.slot)
                if r in self.features:
                    ckpt["feature"] = self.features[r][-1].clone()
            elif checkpoints and end - start in checkpoints:
                ckpt = {name: t[:, row].clone() for name, t in checkpoints[end - start].items()}
                if features is not None:
                    ckpt["feature"] = features[row, end - start - 1].clone()
            else:
                ckpt = None
            # kept under memory pressure: where the same prompt again resumes, and where the next turn does
            turn_end = end in (self._turn_boundary(len(r.prompt)), len(r.prompt) // h * h)
            page = self.tables.pages[r.slot][(end - h) // self.page_size]
            block = tokens[end - h - base:end - base]
            self.prefix_cache.append(r.lease, block, None, ckpt, turn_boundary=turn_end, page=page)

    # ---- tokens, stops, events ----------------------------------------------------------------------------
    def _sampler(self, requests: list[Request], logits: torch.Tensor):
        """row -> the row's next token (its logprobs, when asked for, are queued for the next event). The batch
        samples where its logits are (`sample_tokens`: one argmax for an all-greedy batch; otherwise one uniform
        per sampled row from its own random source goes to the device) and one small copy brings the tokens to the
        host; only the rows that report logprobs copy their logits too. Should the batch's sampling raise, each
        row samples alone when asked (inside its own `_isolated`), so that only a failing row ends."""
        logits = logits[:, : self.vocab_limit]
        params = [r.params for r in requests]
        tokens = self._batch_tokens(requests, logits)
        tokens = host_list(tokens) if tokens is not None else None
        report = [row for row, p in enumerate(params) if p.logprobs is not None]
        host = dict(zip(report, logits[report].float().cpu())) if report else {}

        def sample(row: int) -> int:
            r = requests[row]
            token = tokens[row] if tokens is not None else \
                int(sample_tokens(logits[row : row + 1], [r.params], [r.rng], [r.output])[0])
            if row in host:
                r.logprobs.append(token_logprobs(host[row], token, r.params.logprobs))
            return token

        return sample

    def _batch_tokens(self, requests: list[Request], logits: torch.Tensor) -> torch.Tensor | None:
        """The rows' next tokens [n], left where the logits are: one argmax for an all-greedy plain batch, else
        `sample_tokens`; None if the batched sampling raised (logged; each row then samples alone)."""
        params = [r.params for r in requests]
        if all(p.greedy and p.plain for p in params):
            return logits.argmax(-1)
        try:
            return sample_tokens(logits, params, [r.rng for r in requests], [r.output for r in requests])
        except Exception:
            log.exception("batched sampling failed; sampling each row alone")
            return None

    def _accept(self, r: Request, token: int) -> None:
        r.output.append(token)
        self.metrics.generation_tokens += 1
        reason = None
        if token in self.stop_ids and not r.params.ignore_eos:
            reason = "stop"
        elif len(r.output) >= r.params.max_tokens or r.length >= self.max_model_len:
            reason = "length"
        if token not in self.stop_ids:  # a stop token adds no text, also when ignore_eos lets it through
            stream = self.texts[r]
            searched = stream.stable  # the text up to here holds no stop string: an earlier token's search saw it
            stream.push(token)
            r.text = stream.text
            cut = first_stop(r.text, r.params.stop, after=searched)
            if cut >= 0:
                r.text, reason = r.text[:cut], "stop"
        if reason is not None:
            self._finish(r, reason)
        elif r.every_token or len(r.output) == 1:  # held back: a partial UTF-8 character, a possible stop string
            self._emit(r, sendable(r.text, r.params.stop, r.sent))

    def _emit(self, r: Request, upto: int, finished: bool = False) -> None:
        delta, r.sent = r.text[r.sent:upto], upto
        logprobs, r.logprobs = r.logprobs, []
        if r.on_event is not None:
            self._outbox.append((r.on_event, RequestEvent(r.rid, delta, finished, r.finish_reason, len(r.prompt),
                                                          len(r.output), r.cached_tokens, logprobs)))

    def _deliver_events(self) -> None:
        """Hand over the events of a step (or of `fail_all`): all at once to `event_sink` when one is set (the
        server's: one hand-over to its event loop per step instead of one per token), else to each request's
        on_event in order."""
        if not self._outbox:
            return
        events, self._outbox = self._outbox, []
        if self.event_sink is not None:
            self.event_sink(events)
        else:
            for on_event, event in events:
                on_event(event)

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        self.texts.pop(r, None)
        if r.lease is not None:
            if reason not in ("cancelled", "error"):
                self.prefix_cache.mark_turn_boundary(r.lease)
            self.prefix_cache.release(r.lease)
        self._release_resources(r)
        r.images = None
        self.scheduler.remove(r)
        self.metrics.requests_finished[reason] = self.metrics.requests_finished.get(reason, 0) + 1
        self._emit(r, len(r.text), finished=True)

    def fail_all(self, reason: str = "error") -> None:
        """After an unexpected exception in a step: end every request so that clients get an answer."""
        self._inflight = self._split = None
        with self._lock:
            for r in [*self.scheduler.waiting, *self.scheduler.running]:
                self._finish(r, reason)
        self._deliver_events()


class EngineLoop:
    """Runs `engine.step()` on a daemon thread whenever there is work."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="openk3-engine", daemon=True)

    def start(self) -> EngineLoop:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.engine.wake.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            if not engine.has_work():
                engine.wake.wait(0.05)
                engine.wake.clear()
                continue
            try:
                engine.step()
            except Exception:
                log.exception("engine step failed; ending the running requests")
                engine.fail_all()
