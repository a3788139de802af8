"""Piecewise CUDA graphs of the prefill forward (as vLLM captures its models between attention calls).

A prefill forward of k3-debug costs its launches, not its arithmetic: about 900 kernels, most of them the per-token
work between the token mixers (norms, Block AttnRes, the MoE's routing, grouping and grouped GEMMs), launched one by
one from Python (41 ms on an H200's host for 512 tokens, whose GPU work is ~4 ms: bench/RESULTS.md, 2026-12-05).
That work depends on the number of tokens alone, so it is captured once per token bucket: the forward is cut at
every token mixer (KDA, MLA) into L + 1 pieces, each a CUDA graph. A mixer reads the cache and its position in each
sequence, so mixers run eagerly between the replays, on the real [B, T] rows:

    ids -> graph 0 -> x_0 -> mixer 0 (eager) -> out_0 -> graph 1 -> x_1 -> ... -> out_{L-1} -> graph L -> normed

Capture runs the model's own forward once per bucket with each layer's `_mix` standing in for the mixer: it ends the
piece being captured, keeps the mixer's input x_i (a tensor of the graph's memory), hands back a static buffer out_i
for the mixer's output (one per mixer, shared by every bucket: the memory grows with the model's width x depth x the
bucket sizes) and begins the next piece. All buckets share one memory pool: tensors that cross pieces
(AttnRes block sums, x_i) stay alive through their bucket's capture, and two buckets never replay interleaved.
Rows past the real tokens are padding: their ids and mixer outputs are whatever the last forward left (finite), and
per-token work keeps them to their own rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

SMALLEST_BUCKET = 256  # tokens: shorter prompt chunks take the runner's static short-prefill step
BUCKET_STEP = 4096  # buckets double up to this many tokens, then grow by it (padding <= 4096 tokens' work)


def token_buckets(largest: int, smallest: int = SMALLEST_BUCKET, step: int = BUCKET_STEP) -> list[int]:
    """Token counts to capture: smallest, 2x, 4x, ... up to `step`, then multiples of `step`, the last >= largest."""
    if largest < 1:
        raise ValueError(f"largest must be >= 1, got {largest}")
    sizes = [smallest]
    while sizes[-1] < largest:
        sizes.append(sizes[-1] * 2 if sizes[-1] < step else sizes[-1] + step)
    return sizes


@contextmanager
def mixers_replaced(layers: nn.ModuleList, mix: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Inside, layer i's token mixer call (`DecoderLayer._mix(x, cache, documents)`) is mix(i, x)."""
    for i, layer in enumerate(layers):
        layer._mix = lambda x, cache, documents, i=i: mix(i, x)  # an instance attribute over the method
    try:
        yield
    finally:
        for layer in layers:
            del layer._mix


@dataclass
class Pieces:
    """One bucket's graphs and the static tensors between them (all [1, N, ...])."""
    ids: torch.Tensor  # [1, N] token ids: graph 0's input
    graphs: list[torch.cuda.CUDAGraph]  # L + 1
    mixer_inputs: list[torch.Tensor]  # x_i [1, N, D]: graph i's output
    mixer_outputs: list[torch.Tensor]  # out_i [1, N, D]: graph i + 1's input
    normed: torch.Tensor  # [1, N, D]: model.norm of the last hidden state, the LM head's input


class PiecewisePrefill:
    """The prefill forward of a `K3ForCausalLM` with a cache, its per-token work replayed from CUDA graphs.

    `steps(ids, cache)` run to its end returns `model(ids, cache=cache, return_logits=False).head_inputs` (the
    model's inputs and cache effects; numerics within bf16 rounding: a bucket's padding changes the MoE's row counts,
    not its rows) for text (no image tokens) of B * T tokens up to the largest bucket."""

    def __init__(self, model: nn.Module, largest_tokens: int):
        self.model = model
        self.layers = model.model.layers
        self.buckets = token_buckets(largest_tokens)
        self.pieces: dict[int, Pieces] = {}
        self._outputs: list[torch.Tensor] = []  # the mixers' output buffers (`_mixer_output`)

    def fits(self, tokens: int) -> bool:
        return bool(self.pieces) and tokens <= self.buckets[-1]

    @torch.no_grad()
    def capture(self) -> float:
        """Warm up and capture every bucket, largest first, in one pool; returns the seconds. On failure nothing
        stays captured and the error propagates (the caller prefills eagerly)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                for tokens in reversed(self.buckets):
                    self._warm_up(tokens)  # Triton kernels compile and cuBLAS sets up outside any capture
                    torch.cuda.synchronize()
                    self.pieces[tokens] = self._capture(tokens, pool)
        except Exception:
            self.pieces.clear()
            self._outputs.clear()
            raise
        finally:
            torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def _trunk(self, ids: torch.Tensor) -> torch.Tensor:
        """The forward without a cache and without the MTP layers: the LM head's input [1, N, D]."""
        return self.model.model.norm(self.model.model(ids))

    def _warm_up(self, tokens: int) -> None:
        ids = torch.zeros(1, tokens, dtype=torch.long, device=self._device())
        with mixers_replaced(self.layers, lambda i, x: torch.zeros(x.shape, dtype=x.dtype, device=x.device)):
            self._trunk(ids)

    def _capture(self, tokens: int, pool) -> Pieces:
        ids = torch.zeros(1, tokens, dtype=torch.long, device=self._device())
        graphs = [torch.cuda.CUDAGraph() for _ in range(len(self.layers) + 1)]
        inputs: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []

        def cut(i: int, x: torch.Tensor) -> torch.Tensor:
            graphs[i].capture_end()
            inputs.append(x)
            outputs.append(self._mixer_output(i, x))  # outside any capture
            graphs[i + 1].capture_begin(pool=pool)
            return outputs[-1]

        with mixers_replaced(self.layers, cut):
            graphs[0].capture_begin(pool=pool)
            try:
                normed = self._trunk(ids)
            except Exception:
                if torch.cuda.is_current_stream_capturing():
                    try:
                        graphs[len(inputs)].capture_end()
                    except RuntimeError:  # an invalidated capture: the first error is the one to report
                        pass
                raise
            graphs[-1].capture_end()
        return Pieces(ids, graphs, inputs, outputs, normed)

    def _mixer_output(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Mixer i's static output for x [1, N, D]: the first N rows of one buffer per mixer that every bucket
        shares (the largest bucket is captured first; buckets never replay interleaved, and `steps` writes a mixer's
        output before the graph that reads it replays)."""
        if i == len(self._outputs):
            self._outputs.append(torch.zeros(x.shape, dtype=x.dtype, device=x.device))
        return self._outputs[i][:, :x.shape[1]]

    def _device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    @property
    def pauses(self) -> int:
        """How often `steps` pauses: between each two token mixers."""
        return len(self.layers) - 1

    def steps(self, ids: torch.Tensor, cache) -> Generator[None, None, torch.Tensor]:
        """ids [B, T] -> the LM head's input [B, T, D] (a view of static memory, valid until the next forward), the
        cache advanced by T as in the model's forward: a generator that pauses (yields) between each two token
        mixers (`pauses` times), so that other work may run on the device between the pieces (the engine's decode
        steps: their own graphs and pools); no other prefill forward may run until it returns (`run_to_end`)."""
        B, T = ids.shape
        n = B * T
        pieces = self.pieces[next(size for size in self.buckets if size >= n)]
        pieces.ids[0, :n].copy_(ids.reshape(-1))
        pieces.graphs[0].replay()
        for i, layer in enumerate(self.layers):
            if i:
                yield
            x = pieces.mixer_inputs[i]
            x = x.reshape(-1, x.shape[-1])[:n].view(B, T, -1)
            out = layer._mix(x, cache, None)
            pieces.mixer_outputs[i].view(-1, out.shape[-1])[:n].copy_(out.reshape(n, -1))
            pieces.graphs[i + 1].replay()
        cache.advance(T)
        normed = pieces.normed
        return normed.view(-1, normed.shape[-1])[:n].view(B, T, -1)


def run_to_end(steps: Generator):
    """Run a generator of pieces (`PiecewisePrefill.steps`, `ModelRunner.forward_steps`) through; its value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
