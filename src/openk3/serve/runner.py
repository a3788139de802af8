"""The model runner: batched decode with static shapes over the engine's pools, CUDA graphs, and prefill chunks.

Decode (`ModelRunner.decode`): the step's token ids, slots and lengths are copied into one static input buffer and
`openk3.model.decode.decode_logits` runs on it. On CUDA the step is captured once at start-up as a CUDA graph per
bucketed batch size (1, 2, 4, 8, 16, 32, 64, ... up to `max_batch`); a step of n sequences replays the smallest
bucket >= n with the extra rows on the padding slot (its block table is all null pages, its KDA state is scratch).
Without CUDA (or with graphs off) the same function runs eagerly at the exact batch size. With `compile_backend`
(the engine's default on a GPU: Inductor) the step is torch.compile'd before it is captured: a decode step is
thousands of small operations at these batch sizes (norms, Block AttnRes, routing, the experts' bookkeeping), and
launching them, even from a CUDA graph, costs more than their arithmetic; Inductor fuses them. The Triton decode
kernels are torch custom ops, opaque to the compiler. A compiled step runs at the bucket's size, graphs or not.

Prefill (`ModelRunner.prefill`): the model's own forward on a `HybridCache` gathered from the pools (the KDA states
of the slots; each sequence's latents so far, read through its block table; with the image tokens of the chunks'
image placeholders, if any), then the new latents and states are written back. KDA checkpoints requested inside
the chunk (`checkpoint_offsets`) come back per offset. With CUDA graphs and `piecewise_tokens`, a text forward of up
to that many tokens (B x T) replays its per-token work between the token mixers from graphs captured per token
bucket (`capture_prefill`, openk3.serve.piecewise); the mixers run eagerly between the replays.

Short prefills (`short_prefill` S > 0): prompt chunks of at most S tokens, of any lengths, go through one more
static-shape step instead of the model's forward: `decode_forward` over S tokens per row, each row padded at its end
(`DecodeBatch.num_tokens`: the padding leaves the KDA states alone; its latents land past the row's end, rewritten
before anything reads them), captured like the draft passes (uncompiled, in graphs). A short prefill forward costs
the model's whole eager launch sequence (host-bound however short: docs/serving.md) and stalls
every running sequence; its graph replay does not.

Speculative decoding (SPEC §11, with an `EagleDraft` and K drafts per round): three more static-shape steps, captured
like decode (compiled, the verification; the draft steps are small and run uncompiled in their graphs):
`verify` runs the target over K + 1 tokens per sequence (`decode_forward`, T = K + 1) and returns every position's
logits and draft features, with the KDA states after each of the first K tokens in `conv_out` / `recurrent_out`
(`roll_back` puts a sequence's states back to its last accepted token); `draft_pass` runs the draft over T = 1 or K + 1
positions per sequence (`EagleDraft.decode`), its latents in the page pool's last layer beside the target's MLA
latents (so the prefix cache shares them with the pages), and returns the hidden state and logits at each row's
`last` position. `draft_step` (gathered latents, any length) writes the draft's latents of prefill chunks. With a
draft the plain decode step returns the draft's features too (`decode_with_features`: the engine keeps the draft's
inputs of a plainly decoded token, so that a later round's draft reads the same latents as after rounds), and it is
compiled as without a draft: the engine's dynamic speculation (openk3.serve.speculation) runs it at large batches.
`round_costs` times a round's steps against the plain one at every bucket, for that policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator

import torch
from torch._dynamo.utils import counters

from openk3.cache import HybridCache, KDALayerCache, MLALayerCache
from openk3.cache.paged import BlockTables, PagePool
from openk3.cache.state_pool import StatePool
from openk3.draft import EagleDraft, tapped_hidden_states
from openk3.model.common import fuse_inference_projections
from openk3.model.compile import compile_blocks, uncompile_blocks
from openk3.model.decode import DecodeBatch, decode_forward, decode_logits
from openk3.ops.paged_mla import paged_positions
from openk3.ops.transfer import to_device
from openk3.serve.piecewise import PiecewisePrefill, run_to_end

log = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, and max_batch itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def verify_forward(model, draft: EagleDraft, ids: torch.Tensor, batch: DecodeBatch):
    """The target over T tokens per sequence: (logits [B,T,vocab], the draft's features [B,T,D])."""
    logits, tapped = decode_forward(model, ids, batch, draft.taps)
    return logits, draft.fuse(dict(zip(draft.taps, tapped)))


def features_forward(model, draft: EagleDraft, ids: torch.Tensor, batch: DecodeBatch):
    """One token per sequence, ids [B]: (logits [B, vocab], the draft's features [B, D]); the pools advance by it.
    (Not `verify_forward` at T = 1: a function of its own keeps torch.compile's graphs of the two apart.)"""
    logits, tapped = decode_forward(model, ids.unsqueeze(1), batch, draft.taps)
    return logits[:, 0], draft.fuse(dict(zip(draft.taps, tapped)))[:, 0]


def draft_forward(draft: EagleDraft, prev: torch.Tensor, ids: torch.Tensor, last: torch.Tensor, batch: DecodeBatch):
    """The draft over T positions per sequence: (hidden [B,D], logits [B,vocab]) at each row's position `last`."""
    hidden = draft.decode(prev, ids, batch)
    hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    return hidden, draft.logits(hidden)


def short_prefill_forward(model, ids: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
    """Rows of up to T real tokens (batch.num_tokens) -> the logits after each row's last real token [B, vocab]."""
    logits, _ = decode_forward(model, ids, batch, last=(batch.num_tokens - 1).clamp(min=0))
    return logits[:, 0]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pages: PagePool, tables: BlockTables, states: StatePool, *,
                 max_batch: int, kernels: str = "torch", cuda_graphs: bool = False, compile_backend: str | None = None,
                 prefill_compile_backend: str | None = None, draft: EagleDraft | None = None, speculative: int = 0,
                 short_prefill: int = 0, short_prefill_rows: int = 0, piecewise_tokens: int = 0):
        if speculative and draft is None:
            raise ValueError("speculative decoding needs a draft model")
        if short_prefill < 0:
            raise ValueError(f"short_prefill must be >= 0 (0: off), got {short_prefill}")
        self.model = model
        self.draft = draft  # its latents: the pool's last layer, after the target's MLA layers
        self.pages, self.tables, self.states = pages, tables, states
        self.kernels = kernels
        self.device = pages.pages.device
        self.max_batch = max_batch
        self.inputs = torch.zeros(3, max_batch, dtype=torch.long, device=self.device)  # ids, slots, lengths
        self.buckets = graph_buckets(max_batch)
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, object]] = {}  # (step, batch): graph, output
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.capture_seconds = 0.0
        self.graph_error: str | None = None
        if kernels == "triton":
            fuse_inference_projections(model)  # the Linears that read one input: one product each group
        self.prefill_compiled = prefill_compile_backend is not None
        if self.prefill_compiled:  # the FFN, norm and AttnRes units, in place, for any token count
            compile_blocks(model, token_mixers=False, backend=prefill_compile_backend, dynamic=True)
        # compiled: a compiled step always runs at a bucket's size; Dynamo's automatic dynamic shapes give two
        # graphs (batch 1, and batch as a symbol from the second size on: one Inductor compile each)
        self.compiled = compile_backend is not None
        self.compile_backend = compile_backend
        self.speculative = K = speculative
        self._compile()
        cfg = model.config
        self.kda_layers, self.mla_layers = sorted(cfg.kda_layers), sorted(cfg.mla_layers)
        self.short_prefill = short_prefill
        # the short step's largest batch: its static activations grow with rows x short_prefill tokens (a 48B model's
        # at 256 x 256 tokens outgrew an H100 at start-up), so more short chunks than this take several replays
        self.short_rows = min(max_batch, short_prefill_rows or max_batch)
        # prefill forwards of up to this many tokens (B x T) replay their per-token work from CUDA graphs
        self.piecewise = PiecewisePrefill(model, piecewise_tokens) if piecewise_tokens and self.cuda_graphs else None
        if short_prefill:  # the short prefills' static inputs: tokens and real lengths per row
            self.short_ids = torch.zeros(self.short_rows, short_prefill, dtype=torch.long, device=self.device)
            self.short_lengths = torch.zeros(self.short_rows, dtype=torch.long, device=self.device)
        if K:  # the rounds' static inputs, and the KDA states after each of the first K verified tokens
            dtype = model.model.embed_tokens.weight.dtype
            self.spec_ids = torch.zeros(max_batch, K + 1, dtype=torch.long, device=self.device)
            self.spec_prev = torch.zeros(max_batch, K + 1, cfg.hidden_size, dtype=dtype, device=self.device)
            self.spec_last = torch.zeros(max_batch, dtype=torch.long, device=self.device)
            conv, rec = states.conv, states.recurrent
            self.conv_out = conv.new_zeros(conv.shape[0], max_batch, K, *conv.shape[2:])
            self.recurrent_out = rec.new_zeros(rec.shape[0], max_batch, K, *rec.shape[2:])

    def attach_pages(self, pages: PagePool) -> None:
        """Use `pages` as the latent pool from now on (the engine sizes it after the prefill warm-up has measured
        the activations' memory); before `capture`, whose graphs hold the pool's address."""
        if self.graphs:
            raise RuntimeError("the page pool is fixed once the decode steps are captured")
        self.pages = pages

    def captured(self) -> dict[str, list[int]]:
        """Step name ("decode", "verify", "draft1", ...) -> the batch sizes captured as CUDA graphs."""
        out: dict[str, list[int]] = {}
        for name, size in sorted(self.graphs):
            out.setdefault(name, []).append(size)
        return out

    def _compile(self) -> None:
        """The compiled steps: decode (with the draft's features when speculating) and the verification."""
        compile_ = (lambda fn: torch.compile(fn, backend=self.compile_backend)) if self.compiled else (lambda fn: fn)
        self.step = compile_(features_forward if self.speculative else decode_logits)
        self.verify_step = compile_(verify_forward)

    # ---- decode steps: plain, speculative verification, draft ------------------------------------------------
    def _batch(self, size: int, outs: bool = False, ragged: bool = False) -> DecodeBatch:
        """The step's view of the pools for `size` sequences."""
        return DecodeBatch(slots=self.inputs[1, :size], lengths=self.inputs[2, :size], latents=self.pages.pages,
                           tables=self.tables.tables, conv=self.states.conv, recurrent=self.states.recurrent,
                           kernels=self.kernels,
                           conv_out=self.conv_out[:, :size] if outs else None,
                           recurrent_out=self.recurrent_out[:, :size] if outs else None,
                           num_tokens=self.short_lengths[:size] if ragged else None)

    def _steps(self) -> dict:
        """step name -> (function of the batch size running it on the static inputs, compiled or not)."""
        S, K = self.short_prefill, self.speculative
        model = (self.model, self.draft) if K else (self.model,)
        steps = {"decode": (lambda size: self.step(*model, self.inputs[0, :size], self._batch(size)), self.compiled)}
        if S:
            steps["prefill"] = (lambda size: short_prefill_forward(
                self.model, self.short_ids[:size], self._batch(size, ragged=True)), False)
        if K:
            steps["verify"] = (lambda size: self.verify_step(
                self.model, self.draft, self.spec_ids[:size], self._batch(size, outs=True)),
                self.compiled)
            for T in sorted({1, K + 1}):
                steps[f"draft{T}"] = (lambda size, T=T: draft_forward(
                    self.draft, self.spec_prev[:size, :T], self.spec_ids[:size, :T], self.spec_last[:size],
                    self._batch(size)), False)
        return steps

    def _run(self, name: str, size: int):
        """One step on the static inputs: its graph's replay (outputs are views of the graph's static outputs:
        valid until the next replay) or the step itself."""
        if (name, size) in self.graphs:
            graph, out = self.graphs[name, size]
            graph.replay()
            return out
        fn, compiled = self._steps()[name]
        if not compiled:
            return fn(size)
        breaks = sum(counters["graph_break"].values())
        with torch._dynamo.config.patch(recompile_limit=len(self.buckets)):  # at most one graph per bucket
            out = fn(size)
        breaks = sum(counters["graph_break"].values()) - breaks  # (Dynamo counts them while it compiles)
        if breaks:
            log.warning("the compiled %s step at batch %d has %d graph breaks (TORCH_LOGS=graph_breaks names them): "
                        "it runs as pieces, each compiled and guarded on its own", name, size, breaks)
        return out

    def _buckets(self, name: str) -> list[int]:
        """The batch sizes the named step runs at (and is captured at)."""
        return graph_buckets(self.short_rows) if name == "prefill" else self.buckets

    def _size(self, n: int, name: str = "decode") -> int:
        """The batch a step of n sequences runs at: the smallest bucket >= n when graphs or compiled steps are in
        use (the extra rows on the padding slot), else n."""
        size = next((b for b in self._buckets(name) if b >= n), n) if self.graphs or self.compiled else n
        if size > self.max_batch:
            raise ValueError(f"a decode batch holds at most {self.max_batch} sequences, got {n}")
        return size

    def _set_inputs(self, ids: list[int], slots: list[int], lengths: list[int], size: int,
                    carried: tuple[torch.Tensor, list[int]] | None = None) -> None:
        """The static inputs of a step of `size` rows. `carried` (tokens on the device [m], source per row): a row
        whose source is i >= 0 takes tokens[i] as its id instead of ids[row] (a token the host has not read yet)."""
        pad = size - len(slots)
        rows = [ids + [0] * pad, slots + [self.states.padding_slot] * pad, lengths + [0] * pad]
        if carried is None:
            self.inputs[:, :size].copy_(to_device(rows, self.device))
            return
        tokens, sources = carried
        table = to_device(rows + [sources + [-1] * pad], self.device)
        self.inputs[1:, :size].copy_(table[1:3])
        self.inputs[0, :size] = torch.where(table[3] >= 0, tokens[table[3].clamp(min=0)], table[0])

    def capture(self) -> float:
        """Capture the decode steps at every bucket size (CUDA only); returns the seconds it took. If capture fails
        (an op in a step synchronises with the host, or a compiled step fails to compile), it is tried once more
        uncompiled; if that fails too, decode stays eager and uncompiled, and `graph_error` says why. The
        short-prefill step is captured last and alone: if it fails, short chunks go back to the model's forward
        (`short_prefill` 0) and the other graphs stay."""
        if not self.cuda_graphs:
            return 0.0
        start = time.perf_counter()
        while True:
            pool = torch.cuda.graph_pool_handle()  # a fresh pool for each attempt: a failed capture spoils its own
            try:
                self._capture([name for name in self._steps() if name != "prefill"], pool)
                break
            except RuntimeError as err:
                self.graphs.clear()
                torch.cuda.synchronize()
                self.graph_error = str(err).strip().splitlines()[0]
                if not self.compiled:
                    self.cuda_graphs = False
                    log.warning("CUDA graphs off, decoding eagerly: capture failed (%s)", self.graph_error)
                    break
                log.warning("capturing the compiled decode steps failed, capturing them uncompiled (%s)",
                            self.graph_error)
                self.compiled = False
                self._compile()
        if self.cuda_graphs and self.short_prefill:
            try:
                self._capture(["prefill"], pool)
            except Exception as err:  # (a Triton compile error is no RuntimeError)
                for size in self._buckets("prefill"):
                    self.graphs.pop(("prefill", size), None)
                self.short_prefill = 0
                log.warning("capturing the short-prefill step failed; short chunks prefill through the model's "
                            "forward: %s", str(err).splitlines()[0])
        self.capture_seconds = time.perf_counter() - start
        return self.capture_seconds

    def _capture(self, names: list[str], pool) -> None:
        """Warm up, then capture, the named steps at every bucket size, their graphs sharing `pool`."""
        self.inputs.zero_()
        self.inputs[1].fill_(self.states.padding_slot)  # warm-up and capture touch only the padding slot
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # compile the Triton kernels (and the steps, with compile_backend), set up cuBLAS, outside any capture
        with torch.cuda.stream(side):
            for name in names:
                for size in self._buckets(name):
                    self._run(name, size)
        torch.cuda.current_stream().wait_stream(side)
        # the outer stream context puts the current stream back even when a failed capture leaves early
        with torch.cuda.stream(torch.cuda.current_stream()):
            for name in names:
                for size in reversed(self._buckets(name)):  # largest first: the smaller graphs reuse its memory
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._run(name, size)
                    self.graphs[name, size] = (graph, out)
        torch.cuda.synchronize()

    @torch.no_grad()
    def warm_up_prefill(self, tokens: int = 16, long: tuple[int, tuple[int, ...]] | None = None) -> float:
        """Prefill chunks on the padding slot (its KDA state and the null page are scratch) of 1, 2 and `max_batch`
        sequences, with and without a KDA checkpoint, and `long` = (tokens, checkpoint offsets) of one sequence (the
        engine's longest prefill forward), so that what compiles on first use compiles now rather than inside a
        request's step (seconds each on a GPU): the Triton kernels' variants (block sizes chosen by
        the batch or the length, the checkpoint path) and, with compiled prefill units, their graphs (dynamic shapes:
        one for one sequence, one for several). If compiling the units fails, they go back to eager (logged).
        Returns the seconds."""
        start = time.perf_counter()
        pad = self.states.padding_slot
        try:
            for batch in sorted({1, 2, self.max_batch}):
                for offsets in ((), (tokens,)):
                    self.forward([[0] * tokens] * batch, [pad] * batch, [0] * batch, offsets)
            if self.draft is None:  # right-padded rows (with a draft the engine prefills equal lengths only)
                self.forward([[0] * tokens, [0] * (tokens // 2)], [pad] * 2, [0] * 2)
            if long is not None:
                self.forward([[0] * long[0]], [pad], [0], long[1])
            if self.short_prefill:  # its largest step, eagerly: the memory its CUDA graph will take
                self.inputs.zero_()
                self.inputs[1].fill_(pad)
                self.short_lengths.fill_(self.short_prefill)
                self._run("prefill", self.short_rows)
            log.info("prefill warmed up in %.1f s", time.perf_counter() - start)
        except Exception as err:  # Inductor's errors have no common base class
            if not self.prefill_compiled:
                raise
            log.warning("compiling the prefill units failed, prefilling eagerly: %s", str(err).splitlines()[0])
            uncompile_blocks(self.model)
            self.prefill_compiled = False
        return time.perf_counter() - start

    def capture_prefill(self) -> float:
        """Capture the prefill forward's per-token work (`PiecewisePrefill`) after `warm_up_prefill`; returns the
        seconds. If capture fails, prefill stays eager (logged) and the decode graphs are unaffected."""
        if self.piecewise is None:
            return 0.0
        try:
            return self.piecewise.capture()
        except Exception as err:  # (a Triton compile error is no RuntimeError)
            self.piecewise = None
            log.warning("capturing the prefill pieces failed, prefilling eagerly: %s", str(err).strip().splitlines()[0])
            return 0.0

    def decode(self, ids: list[int], slots: list[int], lengths: list[int],
               carried: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """One token for each of n sequences: ids, slots, lengths (tokens before it) -> logits [n, vocab]; ids may
        come from a device tensor instead (`carried`, as `_set_inputs`). With CUDA graphs the logits are a view of
        the graph's static output: valid until the next decode (copy to keep)."""
        out = self._decode(ids, slots, lengths, carried)
        return out[0] if self.speculative else out

    def decode_with_features(self, ids: list[int], slots: list[int], lengths: list[int]):
        """`decode` with a draft: (logits [n, vocab], the draft's features of the n tokens [n, D]), views as
        `decode`'s."""
        if not self.speculative:
            raise ValueError("the draft's features need a runner with a draft (speculative > 0)")
        return self._decode(ids, slots, lengths)

    def _decode(self, ids: list[int], slots: list[int], lengths: list[int],
                carried: tuple[torch.Tensor, list[int]] | None = None):
        size = self._size(len(ids))
        self._set_inputs(ids, slots, lengths, size, carried)
        out = self._run("decode", size)
        return tuple(t[: len(ids)] for t in out) if self.speculative else out[: len(ids)]

    @torch.no_grad()
    def round_costs(self, repeats: int = 5) -> dict[int, float]:
        """Batch bucket -> a speculative round's time (the verification, the first draft pass over K + 1 positions
        and K - 1 one-position passes) over a plain decode step's, the step including its share of the draft pass
        over K + 1 positions that writes the draft's latents of K plainly decoded tokens (the engine's
        `_write_pending`). Each step runs as it serves (its graph's replay, or eagerly) on the padding slot, the
        median of `repeats` after one warm-up run."""
        K = self.speculative
        if not K:
            raise ValueError("round costs need a runner with a draft (speculative > 0)")
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.inputs.zero_()
        self.inputs[1].fill_(self.states.padding_slot)  # the steps touch only the padding slot and the null page

        def seconds(name: str, size: int) -> float:
            self._run(name, size)
            times = []
            for _ in range(repeats):
                sync()
                start = time.perf_counter()
                self._run(name, size)
                sync()
                times.append(time.perf_counter() - start)
            return sorted(times)[len(times) // 2]

        costs = {}
        for size in self.buckets:
            first = seconds(f"draft{K + 1}", size)
            rest = seconds("draft1", size) if K > 1 else 0.0
            plain = seconds("decode", size) + first / K
            costs[size] = (seconds("verify", size) + first + (K - 1) * rest) / plain
        return costs

    def verify(self, ids: list[list[int]] | torch.Tensor, slots: list[int], lengths: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over K + 1 tokens per sequence (its last token and K drafts; host lists or a device tensor
        [n, K+1]) from position lengths[b]: (logits [n, K+1, vocab], the draft's features [n, K+1, D]). The pools
        advance by all K + 1 tokens; the KDA states after each of the first K are in `conv_out` / `recurrent_out`
        [n_kda, n, K, ...] until the next verification (`roll_back`). Outputs are views, as `decode`'s."""
        n, size = len(ids), self._size(len(ids))
        self._set_inputs([0] * n, slots, lengths, size)
        self._set_spec_ids(ids, size, self.speculative + 1)
        logits, features = self._run("verify", size)
        return logits[:n], features[:n]

    def prefill_short(self, chunks: list[list[int]], slots: list[int], starts: list[int]) -> torch.Tensor:
        """Feed each sequence its next chunk of at most `short_prefill` tokens (any lengths) from position starts[b]
        in static steps of at most `short_rows` sequences: the logits after each chunk [n, vocab] (a view, as
        `decode`'s, when one step holds them all). No KDA checkpoints."""
        n, S, rows = len(chunks), self.short_prefill, self.short_rows
        if not 0 < max(map(len, chunks)) <= S or min(map(len, chunks)) < 1:
            raise ValueError(f"short prefill chunks hold 1 to {S} tokens, got lengths {[len(c) for c in chunks]}")
        if n > rows:
            return torch.cat([self.prefill_short(chunks[i:i + rows], slots[i:i + rows], starts[i:i + rows]).clone()
                              for i in range(0, n, rows)])  # (each step's logits copied before the next replay)
        size = self._size(n, "prefill")
        self._set_inputs([0] * n, slots, starts, size)
        self.short_ids[:size].copy_(to_device([c + [0] * (S - len(c)) for c in chunks] + [[0] * S] * (size - n),
                                              self.device))
        self.short_lengths[:size].copy_(to_device([len(c) for c in chunks] + [0] * (size - n), self.device))
        return self._run("prefill", size)[:n]

    def roll_back(self, slots: list[int], kept: list[int]) -> None:
        """After `verify`: the sequence in slots[i] keeps its first kept[i] verified tokens; with kept[i] <= K its
        KDA states become the ones after its kept[i]-th token (the MLA latents past it are left to be rewritten)."""
        rows = [i for i, k in enumerate(kept) if k <= self.speculative]
        if not rows:
            return
        row, offset, slot = to_device([rows, [kept[i] - 1 for i in rows], [slots[i] for i in rows]], self.device)
        self.states.conv[:, slot] = self.conv_out[:, row, offset]
        self.states.recurrent[:, slot] = self.recurrent_out[:, row, offset]

    def _set_spec_ids(self, ids: list[list[int]] | torch.Tensor, size: int, T: int) -> None:
        """The first T ids of each of `size` rows of a draft pass or verification: host lists, or a device tensor
        [n, T] (tokens drawn on the device that the host has not read: no synchronisation); padding rows 0."""
        ids = ids if isinstance(ids, torch.Tensor) else to_device(ids, self.device)
        self.spec_ids[:len(ids), :T].copy_(ids)
        self.spec_ids[len(ids):size, :T].zero_()

    def draft_pass(self, prev: torch.Tensor, ids: list[list[int]] | torch.Tensor, slots: list[int],
                   starts: list[int], last: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over T positions per sequence (T = 1 or K + 1) from position starts[b]: prev [n, T, D] (target
        features or the draft's own hidden states), ids [n][T] (or a device tensor [n, T]). Writes the draft latents
        of those positions and returns (hidden [n, D], logits [n, vocab]) at each row's position `last[b]` (views,
        as `decode`'s)."""
        n, T = len(ids), (ids.shape[1] if isinstance(ids, torch.Tensor) else len(ids[0]))
        size = self._size(n)
        self._set_inputs([0] * n, slots, starts, size)
        self._set_spec_ids(ids, size, T)
        self.spec_last[:size].copy_(to_device(last + [0] * (size - n), self.device))
        self.spec_prev[:n, :T].copy_(prev)
        hidden, logits = self._run(f"draft{T}", size)
        return hidden[:n], logits[:n]

    # ---- prefill -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, chunks: list[list[int]], slots: list[int], starts: list[int],
                checkpoint_offsets: tuple[int, ...] = (), image_embeds: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict[int, dict[str, torch.Tensor]]]:
        """Feed each sequence its next chunk from position starts[b]: chunks of one length, or of different lengths
        (right-padded to the longest in one forward, `HybridCache.num_tokens`: a row's states at an offset past its
        length are its end states). Returns the logits after each chunk [B, vocab] and, per requested offset, the
        KDA states after that many tokens:
        {offset: {"conv": [n_kda, B, C, W-1], "recurrent": [n_kda, B, H, K, V]}}. image_embeds [N, hidden]: the
        image tokens of the chunks' image placeholders, row-major over the batch (K3ForCausalLM.forward)."""
        logits, checkpoints, _ = self.forward(chunks, slots, starts, checkpoint_offsets, image_embeds=image_embeds)
        return logits[:, -1], checkpoints

    def forward(self, chunks: list[list[int]], slots: list[int], starts: list[int],
                checkpoint_offsets: tuple[int, ...] = (), image_embeds: torch.Tensor | None = None):
        """`prefill`'s pass, returning (the logits after each chunk [B, 1, vocab], the checkpoints, the draft's
        features of the chunk's positions [B, T, D] or None without a draft)."""
        return run_to_end(self.forward_steps(chunks, slots, starts, checkpoint_offsets, image_embeds))

    def forward_pauses(self, tokens: int, images: bool = False) -> int:
        """How often `forward_steps` pauses for a forward of `tokens` (B x T) tokens: between each two token mixers
        when the prefill graphs replay it (text, no draft), else never."""
        return self.piecewise.pauses if self._piecewise(tokens, images) else 0

    def _piecewise(self, tokens: int, images: bool) -> bool:
        return self.piecewise is not None and self.piecewise.fits(tokens) and not images and self.draft is None

    @torch.no_grad()
    def forward_steps(self, chunks: list[list[int]], slots: list[int], starts: list[int],
                      checkpoint_offsets: tuple[int, ...] = (), image_embeds: torch.Tensor | None = None,
                      ) -> Generator[None, None, tuple]:
        """`forward` as a generator that pauses `forward_pauses` times (`PiecewisePrefill.steps`): the engine runs
        a long forward over several steps, decoding other sequences between its pieces. The slots' states are read
        at the start and written at the end, their latents written at the end: until it returns, nothing else may
        touch these slots and their pages, nor run another prefill forward."""
        B, T = len(chunks), max(map(len, chunks))
        sizes = [len(c) for c in chunks]
        ragged = min(sizes) < T
        if ragged and (self.draft is not None or image_embeds is not None):
            raise ValueError("chunks of different lengths take no draft or images")
        slot_t = to_device(slots, self.device)
        conv, recurrent = self.states.gather(slot_t)
        P, width = self.pages.page_size, self.pages.width
        past = max(starts)
        positions = torch.arange(past, device=self.device).expand(B, past)
        layers: list[KDALayerCache | MLALayerCache] = []
        for i in range(self.model.config.num_layers):
            if i in self.mla_layers:
                pool = self.pages.pages[self.mla_layers.index(i)].view(-1, width)
                layers.append(MLALayerCache(pool[paged_positions(self.tables.tables, slot_t, positions, P)]))
            else:
                j = self.kda_layers.index(i)
                layers.append(KDALayerCache(conv[j], recurrent[j]))
        cache = HybridCache(layers, starts, self.device)
        cache.checkpoint_offsets = checkpoint_offsets
        ids = to_device([c + [0] * (T - len(c)) for c in chunks] if ragged else chunks, self.device)
        real = to_device(sizes, self.device)
        features = None
        if ragged:
            cache.num_tokens = real
        piecewise = self._piecewise(B * T, image_embeds is not None)
        if ragged or piecewise:  # the logits after each row's last real token
            if piecewise:
                normed = yield from self.piecewise.steps(ids, cache)
            else:
                normed = self.model(ids, cache=cache, return_logits=False).head_inputs
            logits = self.model.lm_head(normed[torch.arange(B, device=self.device), real - 1]).unsqueeze(1)
        elif self.draft is None:  # (with a cache, MLA attends without cuDNN: ops.attention.NO_CUDNN)
            logits = self.model(ids, cache=cache, logits_to_keep=1, image_embeds=image_embeds).logits
        else:
            with tapped_hidden_states(self.model, self.draft.taps) as tapped:
                logits = self.model(ids, cache=cache, logits_to_keep=1, image_embeds=image_embeds).logits
                features = self.draft.fuse(tapped)

        kda_caches = [cache.layers[i] for i in self.kda_layers]
        if kda_caches:
            self.states.scatter(slot_t, torch.stack([c.conv_state for c in kda_caches]),
                                torch.stack([c.recurrent_state for c in kda_caches]))
        offset = torch.arange(T, device=self.device)
        new = to_device(starts, self.device).view(B, 1) + offset
        # a padding position writes into the null page (scratch): past a row's end its table may have no page
        flat = paged_positions(self.tables.tables, slot_t, new.clamp(max=self.tables.max_pages * P - 1), P)
        flat = torch.where(offset < real.view(B, 1), flat, 0).reshape(-1)
        rows = torch.arange(B, device=self.device).view(B, 1)
        for j, i in enumerate(self.mla_layers):
            latents = cache.layers[i].buffer[rows, new]  # [B,T,R+r]
            self.pages.pages[j].view(-1, width).index_copy_(0, flat, latents.reshape(-1, width))
        checkpoints = {
            offset: {"conv": torch.stack([states[i].conv_state for i in self.kda_layers]),
                     "recurrent": torch.stack([states[i].recurrent_state for i in self.kda_layers])}
            for offset, states in cache.checkpoints.items()}
        return logits, checkpoints, features

    @torch.no_grad()
    def draft_step(self, prev: torch.Tensor, ids: torch.Tensor, slots: list[int], starts: list[int]) -> torch.Tensor:
        """The draft over positions starts[b] .. starts[b] + T - 1 of each slot: prev [B,T,D] (target features or
        the draft's own hidden states), ids [B,T]. Reads the slot's draft latents before starts[b] and writes the
        new ones into the pool; returns the draft's hidden states [B,T,D]."""
        B, T = ids.shape
        slot_t = to_device(slots, self.device)
        P, width = self.pages.page_size, self.pages.width
        pool = self.pages.pages[-1].view(-1, width)
        past = torch.arange(max(starts), device=self.device).expand(B, -1)
        latents = MLALayerCache(pool[paged_positions(self.tables.tables, slot_t, past, P)])
        lengths = to_device(starts, self.device)
        hidden = self.draft.step(prev, ids, latents, lengths)
        new = lengths.view(B, 1) + torch.arange(T, device=self.device)
        rows = torch.arange(B, device=self.device).view(B, 1)
        pool.index_copy_(0, paged_positions(self.tables.tables, slot_t, new, P).reshape(-1),
                         latents.buffer[rows, new].reshape(-1, width).to(pool.dtype))
        return hidden
