"""The engine as the HTTP API sees it: in this process (`LocalCore`), or in a process of its own (`ProcessCore`).

The API (openk3.serve.api) needs little of the engine: its fixed facts (`CoreInfo`: the model's config, the
context limit, the sampled vocabulary, stop ids, the queue limit), the tokenizer, `add_request` / `cancel`, a sink
for each step's events, and a metrics snapshot. `LocalCore` runs the engine on a thread of the API's process (tests
and `openk3 serve --no-engine-process`): the engine's Python work and the event loop's then share one GIL, so every
streamed token's serialisation waits for the engine's step and the other way round. `ProcessCore` (the default of
`openk3 serve`) runs the engine in a child process (spawned: CUDA is initialised there alone), as vLLM's engine core
does: requests and cancellations go down one pipe, each step's events and a metrics snapshot come back, and a
reader thread hands them to the event loop. Requests are checked in the API's process (`check_prompt`), so a bad
one gets its 4xx at once; the queue limit is kept there too, counting the requests the engine has not finished
against `max_queue` + the running limit.
"""

from __future__ import annotations

import argparse
import gc
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace

from openk3.config import ModelConfig
from openk3.sampling import SamplingParams
from openk3.serve.prompts import check_prompt
from openk3.serve.scheduler import QueueFull, RequestEvent

log = logging.getLogger(__name__)

Sink = Callable[[list[tuple[Callable[[RequestEvent], None], RequestEvent]]], None]
SNAPSHOT_EVERY_S = 1.0  # an idle engine process still refreshes the API's metrics this often


@dataclass
class CoreInfo:
    """What the API needs to know of an engine, fixed once it has started."""

    model_config: ModelConfig
    max_model_len: int
    vocab_limit: int
    stop_ids: list[int]
    max_queue: int
    max_running: int
    tokenizer_dir: str | None  # where the engine's tokenizer came from (a checkpoint directory, or the fallback)
    ready: str  # the ready line's description of the engine: device, dtype, graphs, capacity, prefix cache

    @classmethod
    def of(cls, engine, tokenizer_dir: str | None, ready: str) -> CoreInfo:
        sched = engine.config.scheduler
        return cls(engine.model_config, engine.max_model_len, engine.vocab_limit, sorted(engine.stop_ids),
                   sched.max_queue, sched.max_running, tokenizer_dir, ready)


class LocalCore:
    """The engine on a thread of this process."""

    def __init__(self, engine, info: CoreInfo | None = None):
        self.engine = engine
        self.info = info or CoreInfo.of(engine, None, "")
        self.tokenizer = engine.tokenizer
        self._loop = None
        self._leaders: dict = {}  # rid -> the engine's Request, while it may lead another choice (`after`)

    def start(self, sink: Sink) -> None:
        from openk3.serve.engine import EngineLoop  # (the engine imports this package's prompts, not this module)

        self.engine.event_sink = sink
        self._loop = EngineLoop(self.engine).start()

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.stop()

    def add_request(self, prompt: list[int], params: SamplingParams, rid: str, on_event, after: str | None = None,
                    images: list | None = None, every_token: bool = True) -> None:
        for done in [k for k, r in self._leaders.items() if r.finish_reason is not None]:
            del self._leaders[done]
        request = self.engine.add_request(prompt, params, rid=rid, on_event=on_event,
                                          after=self._leaders.get(after), images=images, every_token=every_token)
        self._leaders[rid] = request

    def cancel(self, rid: str) -> None:
        self.engine.cancel(rid)

    def snapshot(self) -> dict:
        return self.engine.snapshot()

    def alive(self) -> bool:
        return self._loop is None or self._loop.thread.is_alive()


class ProcessCore:
    """The engine in a child process, started from the `openk3 serve` arguments (`start_process`)."""

    def __init__(self, process, conn, info: CoreInfo, tokenizer, first_snapshot: dict):
        self.process, self.conn, self.info, self.tokenizer = process, conn, info, tokenizer
        self._snapshot = first_snapshot
        self._handlers: dict[str, Callable[[RequestEvent], None]] = {}
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._stopping = False

    @classmethod
    def start_process(cls, args: argparse.Namespace, build: Callable, describe: Callable[..., str]
                      ) -> tuple[ProcessCore, str]:
        """Spawn the engine process, which builds its engine with build(args) -> (engine, name) and states it with
        describe(engine) (module-level functions: they reach the child by name); wait until it is built; (the core,
        the model's name). ValueError with the child's one-line reason if it could not build the engine."""
        from openk3.tokenizer import load_tokenizer

        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=engine_process_main, args=(args, child, build, describe), name="openk3-engine",
                              daemon=True)
        with signals_ignored():
            process.start()
        child.close()
        try:
            message = parent.recv()
        except EOFError:
            process.join(5)
            raise ValueError(f"the engine process exited while starting (exit code {process.exitcode})") from None
        except BaseException:  # Ctrl-C while it starts: it ignores signals, so it is ended here
            process.kill()
            raise
        if message[0] == "failed":
            process.join(30)
            raise ValueError(message[1])
        _, info, name, snapshot = message
        tokenizer = load_tokenizer(info.tokenizer_dir, info.model_config.vocab_size)
        return cls(process, parent, info, tokenizer, snapshot), name

    def start(self, sink: Sink) -> None:
        self._sink = sink
        self._reader = threading.Thread(target=self._read, name="openk3-engine-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Each message from the engine: a step's events (to their requests' handlers, in one hand-over to the
        event loop) and the latest metrics snapshot."""
        while True:
            try:
                events, snapshot = self.conn.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    log.error("the engine process ended (exit code %s); failing the open requests",
                              self.process.exitcode)
                    self._fail_open()
                return
            self._snapshot = snapshot
            if events:
                pairs = []
                for event in events:
                    handler = self._handlers.pop(event.rid, None) if event.finished else \
                        self._handlers.get(event.rid)
                    if handler is not None:
                        pairs.append((handler, event))
                if pairs:
                    self._sink(pairs)

    def _fail_open(self) -> None:
        pairs = [(handler, RequestEvent(rid, "", True, "error")) for rid, handler in self._handlers.items()]
        self._handlers.clear()
        if pairs:
            self._sink(pairs)

    def _send(self, message) -> None:
        with self._send_lock:
            self.conn.send(message)

    def add_request(self, prompt: list[int], params: SamplingParams, rid: str, on_event, after: str | None = None,
                    images: list | None = None, every_token: bool = True) -> None:
        check_prompt(prompt, self.info.max_model_len, self.info.model_config, images)
        if not self.process.is_alive():
            raise RuntimeError(f"the engine process has ended (exit code {self.process.exitcode})")
        if len(self._handlers) >= self.info.max_queue + self.info.max_running:
            raise QueueFull(f"the engine holds {len(self._handlers)} requests (max_queue={self.info.max_queue} "
                            f"waiting + {self.info.max_running} running)")
        self._handlers[rid] = on_event
        self._send(("add", rid, list(prompt), params, after, images, every_token))

    def cancel(self, rid: str) -> None:
        self._send(("cancel", rid))

    def snapshot(self) -> dict:
        return self._snapshot

    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            self._send(("stop",))
        except (OSError, ValueError):
            pass
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
        self.conn.close()
        log.info("the engine process stopped (exit code %s)", self.process.exitcode)


@contextmanager
def stop_signals_handled_by(handler):
    """SIGINT and SIGTERM handled by `handler` meanwhile, the previous handlers restored after. Off the main thread
    (where Python cannot set handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, restored in previous.items():
            signal.signal(sig, restored)


def signals_ignored():
    """SIGINT and SIGTERM ignored meanwhile, in this process and in a child started meanwhile, which keeps them
    ignored: Ctrl-C in a terminal, or a supervisor's SIGTERM, reaches the whole process group, and it is the API's
    process that stops the engine process (`ProcessCore.stop`, or its pipe closing)."""
    return stop_signals_handled_by(signal.SIG_IGN)


def _event_in_sink(_event: RequestEvent) -> None:
    """The engine process's on_event: events reach the API through the step's sink, not one by one."""


def keep_startup_objects() -> None:
    """Take what start-up made (torch's modules, the model, compiled code and graphs) out of the garbage collector's
    sight for the rest of the process (`gc.freeze`): they live as long as the server, and a full collection walks
    every object it tracks, pausing every stream meanwhile. The API process streaming to 64 clients (bench/api_host.py's
    app on a 2-core CPU, 40 s at ~7.5k tok/s) ran a full collection of 220.6 ms over 338k tracked objects, of 2.8 ms
    with them frozen (bench/RESULTS.md, 2026-12-07 eighth session); the engine process holds far more (compiled
    code and graphs)."""
    gc.collect()
    gc.freeze()


def release_startup_objects() -> None:
    """Undo `keep_startup_objects` before the process exits: frozen objects are never collected at exit, and
    triton's nanobind extension (which torch imports) then prints some 600 lines of "nanobind: leaked ..." for its
    objects among them."""
    gc.unfreeze()


def engine_process_main(args: argparse.Namespace, conn, build: Callable, describe: Callable[..., str]) -> None:
    """The engine process: build the engine, then run steps, taking requests and cancellations between them and
    sending each step's events with a metrics snapshot. Ends when the API says stop or its pipe closes."""
    from openk3.checkpoints import INPUT_ERRORS, resolve_checkpoint

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine, name = build(args)
    except Exception as exc:  # any failure to build is the server's one-line start-up error
        if not isinstance(exc, INPUT_ERRORS):  # not a bad flag or input (out of memory, a bug): the traceback is logged
            log.exception("the engine failed to start")
        conn.send(("failed", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__))
        return
    keep_startup_objects()
    try:
        tokenizer_dir = str(resolve_checkpoint(args.ckpt)) if args.ckpt else None
        conn.send(("ready", CoreInfo.of(engine, tokenizer_dir, describe(engine)), name, engine.snapshot()))
        run_engine(engine, conn)
    finally:
        release_startup_objects()


def run_engine(engine, conn) -> None:
    """The engine process's loop, until the API says stop or its pipe closes."""
    requests = {}
    # the API's process keeps the queue limit (`ProcessCore.add_request`, waiting and running counted together): a
    # burst it took may all wait here until a step admits it, and a refusal here would fail it with a 500, not a 429
    sched = engine.scheduler.config
    engine.scheduler.config = replace(sched, max_queue=sched.max_queue + sched.max_running)

    def sink(pairs) -> None:
        events = [event for _, event in pairs]
        for event in events:
            if event.finished:
                requests.pop(event.rid, None)
        conn.send((events, engine.snapshot()))

    engine.event_sink = sink
    last = time.monotonic()
    while True:
        wait = 0.0 if engine.has_work() else 0.05
        try:
            while conn.poll(wait):
                message = conn.recv()
                wait = 0.0
                if message[0] == "stop":
                    return
                if message[0] == "cancel":
                    engine.cancel(message[1])
                    continue
                _, rid, prompt, params, after, images, every_token = message
                try:
                    requests[rid] = engine.add_request(prompt, params, rid=rid, on_event=_event_in_sink,
                                                       after=requests.get(after), images=images,
                                                       every_token=every_token)
                except (ValueError, QueueFull) as exc:  # (checked in the API's process already)
                    log.warning("request %s refused by the engine: %s", rid, exc)
                    conn.send(([RequestEvent(rid, "", True, "error")], engine.snapshot()))
        except (EOFError, OSError):
            return
        if engine.has_work():
            try:
                engine.step()
            except Exception:
                log.exception("engine step failed; ending the running requests")
                engine.fail_all()
        elif time.monotonic() - last > SNAPSHOT_EVERY_S:
            conn.send(([], engine.snapshot()))
            last = time.monotonic()
