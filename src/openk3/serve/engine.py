"""The serving engine: continuous batching over the hybrid model with the K3 prefix cache (SPEC §7).

One `step()`: apply cancellations, admit requests (a prefix hit resumes prefill at the hit boundary with the
restored KDA states and MLA pages), run one batched decode forward for every decoding sequence, then batched
prefill chunks within the step's token budget. Every full hash block a sequence completes (in prefill or decode)
is registered with the MLA latents of its h tokens. A prefill chunk covers up to `prefill_chunk_blocks` hash
blocks and ends at the prompt's last full hash block (the turn boundary) or at the prompt's end; inside it the
model records KDA checkpoints every `checkpoint_every` hash blocks (1, the default, is SPEC §7's ideal: a
checkpoint at every boundary) in the same forward (`HybridCache.checkpoint_offsets`); decode passes every
boundary one token at a time. Chunking and checkpoint offsets are the same whether or not the cache is on, so
greedy output does not depend on it. Images (SPEC §12): a request may carry prepared images (openk3.images) whose
placeholder runs are in its prompt; admission encodes those not inside the prefix hit, each prefill chunk passes
the model the image tokens of the placeholders it holds, and the prefix cache keys the prompt by image content
(`PromptImages.cache_prompt`). `EngineLoop` runs steps on a background thread; `add_request` and `cancel` are
thread-safe. Work that raises ends only the requests it was for (`_isolated`: one sequence's sampling and
bookkeeping, or the forward a batch shares) with finish_reason "error"; the others keep running.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from openk3.cache import HybridCache, KDAState, MLAState, SequenceState
from openk3.sampling import SamplingParams, sample_token
from openk3.serve.prefix_cache import PrefixCache, PrefixCacheConfig, image_keyed_tokens
from openk3.serve.scheduler import Request, RequestEvent, Scheduler, SchedulerConfig

log = logging.getLogger(__name__)


def default_block_sizes(max_seq_len: int) -> tuple[int, int]:
    """(h, P) keeping K3's ratio P = 12 h: (512, 6144) at K3's 1M context, (16, 192) for toy contexts."""
    h = 512 if max_seq_len >= 1 << 20 else 64 if max_seq_len >= 1 << 16 else 16
    return h, 12 * h


@dataclass
class EngineConfig:
    prefix_cache: bool = True
    hash_block: int | None = None  # None: default_block_sizes
    page_size: int | None = None
    cache_bytes: int = 256 << 20  # device tier of the prefix cache
    host_cache_bytes: int = 0
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    checkpoint_every: int = 1  # hash blocks between KDA checkpoints during prefill
    prefill_chunk_blocks: int = 12  # hash blocks per prefill forward at most (one physical page at K3's ratio)
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        for name in ("checkpoint_every", "prefill_chunk_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine field {name!r} must be >= 1 hash block, got {getattr(self, name)}")


@dataclass
class PromptImages:
    """A request's images: prepared (openk3.images.PreparedImage, prompt order), where each one's placeholder run
    starts in the prompt, the prompt as the prefix cache keys it, and each image's tokens [n, hidden] once the
    prefill first needs them (an image inside the prefix hit is never encoded)."""

    prepared: list
    starts: list[int]
    cache_prompt: list[int]
    embeds: list[torch.Tensor | None]

    @classmethod
    def locate(cls, prompt: list[int], image_token_id: int, prepared: list) -> PromptImages:
        """ValueError unless the prompt holds, in order, one contiguous run of placeholders per image."""
        cache_prompt = image_keyed_tokens(prompt, image_token_id, [(im.num_tokens, im.digest) for im in prepared])
        slots = [i for i, t in enumerate(prompt) if t == image_token_id]
        starts, seen = [], 0
        for k, im in enumerate(prepared):
            run = slots[seen:seen + im.num_tokens]
            if run[-1] - run[0] != im.num_tokens - 1:
                raise ValueError(f"the {im.num_tokens} placeholders of image {k} are not contiguous in the prompt")
            starts.append(run[0])
            seen += im.num_tokens
        return cls(list(prepared), starts, cache_prompt, [None] * len(prepared))

    def chunk_embeds(self, start: int, end: int, model: torch.nn.Module) -> list[torch.Tensor]:
        """The image tokens of the placeholders in prompt positions [start, end), in order (`model` encodes an
        image the first time a chunk reaches it)."""
        out = []
        for k, (s, im) in enumerate(zip(self.starts, self.prepared)):
            lo, hi = max(start, s), min(end, s + im.num_tokens)
            if lo < hi:
                if self.embeds[k] is None:
                    self.embeds[k] = model.encode_images(im.batch.to(next(model.parameters()).device))
                out.append(self.embeds[k][lo - s:hi - s])
        return out


@dataclass
class EngineMetrics:
    requests_received: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    ttft_seconds_sum: float = 0.0
    ttft_count: int = 0


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None):
        self.model = model.eval()
        self.model_config = mc = model.config
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        default_h, default_p = default_block_sizes(mc.max_seq_len)
        self.hash_block = config.hash_block or default_h
        page_size = config.page_size or (config.hash_block * 12 if config.hash_block else default_p)
        self.mla_layers = [i for i in range(mc.num_layers) if mc.layer_kind(i) == "mla"]
        self.kda_layers = [i for i in range(mc.num_layers) if mc.layer_kind(i) == "kda"]
        empty = model.new_cache(1)
        self.empty_state = empty.extract(0)
        weight = next(model.parameters())
        latent = mc.mla.kv_lora_rank + mc.mla.qk_rope_head_dim
        self.prefix_cache = PrefixCache(PrefixCacheConfig(
            hash_block=self.hash_block, page_size=page_size,
            page_bytes=max(1, len(self.mla_layers) * page_size * latent * weight.element_size()),
            device_bytes=config.cache_bytes, host_bytes=config.host_cache_bytes,
            disk_dir=config.disk_cache_dir, disk_bytes=config.disk_cache_bytes, device=str(weight.device),
        )) if config.prefix_cache else None
        self.scheduler = Scheduler(config.scheduler)
        self.metrics = EngineMetrics()
        self.stop_ids = set(tokenizer.stop_ids)
        self.vocab_limit = min(tokenizer.vocab_size, mc.vocab_size)
        self._decode_batch: tuple[list[Request], HybridCache] | None = None
        self._lock = threading.Lock()
        self._cancels: set[str] = set()
        self._ids = itertools.count()
        self.wake = threading.Event()

    # ---- the client side (thread-safe) --------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams, rid: str | None = None,
                    on_event=None, images: list | None = None) -> Request:
        """Queue a request; raises ValueError for an unusable prompt and QueueFull when throttled. `images`:
        prepared images (openk3.images.PreparedImage) whose placeholder runs the prompt holds, in order."""
        limit = self.model_config.max_seq_len
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= limit:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context holds {limit}")
        if max(prompt) >= self.model_config.vocab_size or min(prompt) < 0:
            raise ValueError(f"token ids must be in [0, {self.model_config.vocab_size})")
        vision = self.model_config.vision
        if images and vision is None:
            raise ValueError(f"the model {self.model_config.name!r} has no vision tower: it cannot take images")
        located = PromptImages.locate(list(prompt), vision.image_token_id, images) if vision is not None else None
        number = next(self._ids)
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + number
        request = Request(rid=rid or f"req-{number}", prompt=list(prompt), params=params, on_event=on_event,
                          generator=torch.Generator().manual_seed(seed), images=located if images else None)
        with self._lock:
            self.scheduler.submit(request)
            self.metrics.requests_received += 1
        self.wake.set()
        return request

    def cancel(self, rid: str) -> None:
        """Stop a request at the next step boundary and free its sequence, locks and state."""
        with self._lock:
            self._cancels.add(rid)
        self.wake.set()

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._cancels)

    # ---- one step -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            for r in [r for r in (*self.scheduler.waiting, *self.scheduler.running) if r.rid in cancels]:
                self._finish(r, "cancelled")
            admitted = self.scheduler.admit(self._locked_fraction())
        for r in admitted:
            with self._isolated([r]):
                self._start(r)
        decoding = [r for r in self.scheduler.running if not r.prefilling]
        if decoding:
            with self._isolated(decoding):
                self._decode(decoding)
        for round_ in self.scheduler.prefill_rounds(self._chunk_end):
            alike: dict[tuple[int, tuple[int, ...]], list[Request]] = {}  # same chunk length and checkpoints
            for r in round_:
                if r.finish_reason is None:  # not failed in an earlier round
                    end = self._chunk_end(r, r.fed)
                    alike.setdefault((end - r.fed, self._checkpoint_offsets(r.fed, end)), []).append(r)
            for group in alike.values():
                with self._isolated(group):
                    self._prefill(group)
        self.metrics.steps += 1

    def _locked_fraction(self) -> float:
        cache = self.prefix_cache
        if cache is None:
            return 0.0
        locked = sum(cache.config.page_bytes for p in cache.pages if p.locks)
        return locked / cache.config.device_bytes

    def _chunk_end(self, r: Request, pos: int) -> int:
        h = self.hash_block
        turn_boundary = (len(r.prompt) // h) * h
        return min((pos // h + self.config.prefill_chunk_blocks) * h,
                   turn_boundary if turn_boundary > pos else len(r.prompt))

    def _checkpoint_offsets(self, start: int, end: int) -> tuple[int, ...]:
        """Offsets into a prefill chunk [start, end) where KDA checkpoints are wanted: every `checkpoint_every`
        hash blocks, and the chunk's end when it is a hash-block boundary (a turn boundary or a page's end)."""
        h, span = self.hash_block, self.hash_block * self.config.checkpoint_every
        ends = set(range((start // span + 1) * span, end + 1, span))
        if end % h == 0:
            ends.add(end)
        return tuple(sorted(e - start for e in ends))

    def _start(self, r: Request) -> None:
        """Admission: look the prompt up and restore the hit (KDA checkpoint + MLA pages) as the sequence's state."""
        self.metrics.prompt_tokens += len(r.prompt)
        r.state = self.empty_state.clone()
        if self.prefix_cache is None:
            return
        r.lease = self.prefix_cache.acquire(self._cache_tokens(r), max_hit=len(r.prompt) - 1)
        hit = r.lease.hit_tokens
        if hit:
            kv = torch.cat(r.lease.hit_kv, dim=1)  # [n_mla, hit, latent]
            ckpt = r.lease.hit_checkpoint
            kda = {layer: KDAState(ckpt["conv"][j].clone(), ckpt["recurrent"][j].clone())
                   for j, layer in enumerate(self.kda_layers)}
            mla = {layer: MLAState(kv[j].clone()) for j, layer in enumerate(self.mla_layers)}
            r.state = SequenceState.assemble(hit, kda, mla)
            r.fed = r.cached_tokens = hit

    @staticmethod
    def _cache_tokens(r: Request) -> list[int]:
        """The sequence as the prefix cache keys it: images by content (PromptImages.cache_prompt)."""
        return (r.prompt if r.images is None else r.images.cache_prompt) + r.output

    # ---- forwards -----------------------------------------------------------------------------------------
    def _decode(self, requests: list[Request]) -> None:
        """One token for every decoding sequence; their states stay in one batch cache between steps."""
        if self._decode_batch is None or self._decode_batch[0] != requests:
            self._release_decode_batch()
            cache = HybridCache.from_sequences([r.state for r in requests])
            for r in requests:
                r.state = None
            self._decode_batch = (list(requests), cache)
        cache = self._decode_batch[1]
        ids = torch.tensor([[r.output[-1]] for r in requests], device=cache.lengths.device)
        logits = self.model(ids, cache=cache).logits[:, -1]
        for row, r in enumerate(requests):
            with self._isolated([r]):
                r.fed += 1
                self._register_blocks(r, r.fed - 1, cache, row)
                self._accept(r, logits[row])

    def _release_decode_batch(self) -> None:
        """Give the sequences of the current decode batch their own states back (finished ones need none)."""
        if self._decode_batch is not None:
            members, cache = self._decode_batch
            for row, r in enumerate(members):
                if r.finish_reason is None:
                    r.state = cache.extract(row)
            self._decode_batch = None

    def _prefill(self, requests: list[Request]) -> None:
        """The next chunk (same length for all) of each request's prompt."""
        cache = HybridCache.from_sequences([r.state for r in requests])
        ends = [self._chunk_end(r, r.fed) for r in requests]
        ids = torch.tensor([r.prompt[r.fed:end] for r, end in zip(requests, ends)], device=cache.lengths.device)
        cache.checkpoint_offsets = self._checkpoint_offsets(requests[0].fed, ends[0])
        images = [e for r, end in zip(requests, ends) if r.images
                  for e in r.images.chunk_embeds(r.fed, end, self.model)]
        logits = self.model(ids, cache=cache, logits_to_keep=1,
                            image_embeds=torch.cat(images) if images else None).logits[:, -1]
        for row, (r, end) in enumerate(zip(requests, ends)):
            with self._isolated([r]):
                start, r.fed = r.fed, end
                self._register_blocks(r, start, cache, row)
                r.state = cache.extract(row)
                if not r.prefilling:
                    r.first_token_at = time.perf_counter()
                    self.metrics.ttft_seconds_sum += r.first_token_at - r.arrival
                    self.metrics.ttft_count += 1
                    self._accept(r, logits[row])

    def _register_blocks(self, r: Request, start: int, cache: HybridCache, row: int) -> None:
        """Hand the hash blocks completed between `start` and `r.fed` to the prefix cache: their MLA latents, and
        the KDA states at each block end the forward recorded (or, at `r.fed`, the state it just left)."""
        h = self.hash_block
        if self.prefix_cache is None or r.lease.detached:
            return
        for end in range((start // h + 1) * h, r.fed + 1, h):
            kv = torch.stack([cache.layers[i].buffer[row, end - h:end] for i in self.mla_layers])
            states = cache.layers if end == r.fed else cache.checkpoints.get(end - start)
            ckpt = None
            if states is not None:
                ckpt = {"conv": torch.stack([states[i].conv_state[row] for i in self.kda_layers]),
                        "recurrent": torch.stack([states[i].recurrent_state[row] for i in self.kda_layers])}
            turn_end = end <= len(r.prompt) < end + h  # the last boundary of the prompt ends the user's turn
            self.prefix_cache.append(r.lease, self._cache_tokens(r)[end - h:end], kv, ckpt, turn_boundary=turn_end)

    # ---- tokens, stops, events ----------------------------------------------------------------------------
    def _accept(self, r: Request, logits: torch.Tensor) -> None:
        token = sample_token(logits[: self.vocab_limit].float().cpu(), r.params, r.generator)
        r.output.append(token)
        self.metrics.generation_tokens += 1
        reason = None
        if token in self.stop_ids and not r.params.ignore_eos:
            reason = "stop"
        elif len(r.output) >= r.params.max_tokens or r.length >= self.model_config.max_seq_len:
            reason = "length"
        text = self.tokenizer.decode_plain([t for t in r.output if t not in self.stop_ids])
        cut = min((i for i in (text.find(s) for s in r.params.stop if s) if i >= 0), default=-1)
        if cut >= 0:
            text, reason = text[:cut], "stop"
        r.text = text
        if reason is not None:
            self._finish(r, reason)
        else:
            self._emit(r, self._sendable(r))

    def _sendable(self, r: Request) -> int:
        """How much of the text is final: hold back a partial UTF-8 character and a possible stop-string start."""
        n = len(r.text.rstrip("\ufffd"))
        for s in r.params.stop:
            for k in range(min(len(s) - 1, n), 0, -1):
                if r.text[:n].endswith(s[:k]):
                    n = min(n, len(r.text[:n]) - k)
                    break
        return max(n, r.sent)

    def _emit(self, r: Request, upto: int, finished: bool = False) -> None:
        delta, r.sent = r.text[r.sent:upto], upto
        if r.on_event is not None:
            r.on_event(RequestEvent(r.rid, delta, finished, r.finish_reason, len(r.prompt), len(r.output),
                                    r.cached_tokens))

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        if r.lease is not None:
            if reason not in ("cancelled", "error"):  # a turn that ended normally
                self.prefix_cache.mark_turn_boundary(r.lease)
            self.prefix_cache.release(r.lease)
        r.state = r.images = None
        self.scheduler.remove(r)
        self.metrics.requests_finished[reason] = self.metrics.requests_finished.get(reason, 0) + 1
        self._emit(r, len(r.text), finished=True)

    # ---- failure isolation --------------------------------------------------------------------------------
    @contextmanager
    def _isolated(self, requests: list[Request]):
        """Run one piece of a step's work on `requests`: admitting one, one sequence's bookkeeping and sampling
        after a forward, or a batched forward. If it raises, those requests alone end with finish_reason "error"
        (the API answers 500 or ends the stream with it; their locks and states are freed) and the step goes on
        for every other request. A forward's failure cannot be pinned on one row, so it ends its whole batch."""
        try:
            yield
        except Exception:
            log.exception("engine work on %s failed; ending it alone", ", ".join(r.rid for r in requests))
            for r in requests:
                if r.finish_reason is None:
                    self._finish(r, "error")

    def fail_all(self, reason: str = "error") -> None:
        """After an unexpected exception in a step: end every request so that clients get an answer."""
        self._decode_batch = None
        with self._lock:
            for r in [*self.scheduler.waiting, *self.scheduler.running]:
                self._finish(r, reason)


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
                log.exception("engine step failed outside any request's work; ending every request")
                engine.fail_all()
