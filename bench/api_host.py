"""The HTTP API's host cost per streamed token, with a synthetic engine: how many tokens a second the API process of
`openk3 serve` can stream, and its CPU time per token.

    python bench/api_host.py [--clients 64] [--step-ms 2] [--reply 256] [--json bench/api_host.json]

At 32-64 clients the GPU server's rate follows its host (bench/RESULTS.md, 2026-12-06 fifth session): the engine
runs in a process of its own, and the API's process turns every sampled token into a server-sent event. This
benchmark isolates that process. It starts the real app (`openk3.serve.api.create_app`) under uvicorn in a child
process, over a synthetic core in place of the engine process: a thread that every --step-ms emits one token for
each running request, as the engine process's reader thread hands over a step's events, until the reply has
--reply tokens. C streaming clients (raw HTTP over asyncio, so that their own parsing costs little) each send one
completion request after another. Measured: tokens streamed a second, end to end, and the server process's CPU
seconds per token (from /proc: user + system), at a step rate the API keeps up with and at one it does not (the
synthetic core then runs ahead and the API streams as fast as it can), for uvicorn's stack as `openk3 serve` runs
it (uvloop and httptools) and for its pure-Python one (asyncio and h11), the peer, alternated over --rounds; each
row is its best round (the least CPU a token: this machine is shared), every round's figures beside it.

Prints a table and writes JSON: rows {stack, step_ms, clients, demanded_tok_per_s, tok_per_s,
server_cpu_us_per_token, server_cpu_share, rounds_*}, env.stacks. Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from openk3.config import get_preset
from openk3.serve.core import CoreInfo
from openk3.serve.scheduler import RequestEvent
from openk3.tokenizer import ByteTokenizer

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class SyntheticCore:
    """The core interface the API reads (openk3.serve.core), with a thread in place of the engine: each step it
    emits one token (one byte of text) for every running request, through the sink in one hand-over."""

    def __init__(self, step_s: float, max_running: int = 1024):
        cfg = get_preset("k3-tiny")
        self.info = CoreInfo(cfg, 1 << 16, cfg.vocab_size, [], 4096, max_running, None, "synthetic core")
        self.tokenizer = ByteTokenizer()
        self.step_s = step_s
        self._running: dict[str, list] = {}  # rid -> [handler, tokens left, prompt tokens]
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def start(self, sink) -> None:
        self._sink = sink
        threading.Thread(target=self._run, name="synthetic-engine", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            pairs = []
            with self._lock:
                for rid, row in list(self._running.items()):
                    row[1] -= 1
                    done = row[1] == 0
                    pairs.append((row[0], RequestEvent(rid, "a", done, "length" if done else None, row[2],
                                                       row[3] - row[1])))
                    if done:
                        del self._running[rid]
            if pairs:
                self._sink(pairs)
            time.sleep(max(0.0, self.step_s - (time.perf_counter() - started)))

    def add_request(self, prompt, params, rid, on_event, after=None, images=None, every_token=True) -> None:
        with self._lock:
            self._running[rid] = [on_event, params.max_tokens, len(prompt), params.max_tokens]

    def cancel(self, rid: str) -> None:
        with self._lock:
            self._running.pop(rid, None)

    def snapshot(self) -> dict:
        return {}

    def alive(self) -> bool:
        return True

    def stop(self) -> None:
        self._stop.set()


# uvicorn's event loop and HTTP parser: "auto" is what `openk3 serve` runs (uvicorn's choice: uvloop and httptools,
# dependencies of the project), "h11" its pure-Python stack (asyncio's loop, h11), the peer
STACKS = {"auto": {}, "h11": {"loop": "asyncio", "http": "h11"}}


def serve(port: int, step_s: float, stack: str) -> None:
    import uvicorn

    from openk3.serve.api import create_app
    from openk3.serve.core import keep_startup_objects

    app = create_app(SyntheticCore(step_s), "synthetic")
    keep_startup_objects()  # as `openk3 serve` does before it runs uvicorn
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", **STACKS[stack])


def installed_stack() -> dict:
    """What uvicorn's "auto" resolves to here: uvloop and httptools when they import."""
    have = lambda name: importlib.util.find_spec(name) is not None
    return {"loop": "uvloop" if have("uvloop") else "asyncio", "http": "httptools" if have("httptools") else "h11"}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


async def client(port: int, reply: int, deadline: float, counts: list[int]) -> None:
    """Completion requests one after another until `deadline`; counts[0] += each reply's token events (a reply
    with other than `reply` of them raises)."""
    body = json.dumps({"model": "synthetic", "prompt": "hello", "max_tokens": reply, "stream": True,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < deadline:
            writer.write(head + body)
            await writer.drain()
            events = 0
            while True:  # chunked transfer: count the events until [DONE]
                line = await reader.readline()
                if not line:
                    raise RuntimeError("the server closed the connection")
                if line.startswith(b"data: {"):
                    events += 1
                elif line.startswith(b"data: [DONE]"):
                    break
            if events != reply:  # one event a token, each on its own line, however the writes were grouped
                raise RuntimeError(f"a reply streamed {events} token events, expected {reply}")
            counts[0] += events
            await reader.readline()  # the chunked body's last chunk ("0") and its blank line
            await reader.readline()
    finally:
        writer.close()


async def drive(port: int, clients: int, reply: int, seconds: float) -> int:
    counts = [0]
    deadline = time.perf_counter() + seconds
    await asyncio.gather(*(client(port, reply, deadline, counts) for _ in range(clients)))
    return counts[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(stack: str, step_ms: float, clients: int, reply: int, seconds: float) -> dict:
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--step-ms", str(step_ms),
                               "--stacks", stack])
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError("the API server did not start")
        asyncio.run(drive(port, clients, reply, 1.0))  # warm-up
        cpu0, t0 = cpu_seconds(server.pid), time.perf_counter()
        tokens = asyncio.run(drive(port, clients, reply, seconds))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(server.pid) - cpu0
    finally:
        server.terminate()
        server.wait(10)
    return {"stack": stack, "step_ms": step_ms, "clients": clients, "demanded_tok_per_s": clients * 1e3 / step_ms,
            "tok_per_s": tokens / wall, "server_cpu_us_per_token": cpu / tokens * 1e6, "server_cpu_share": cpu / wall}


def best_of(runs: list[dict]) -> dict:
    """The round with the least CPU a token (this machine is shared: the others' load only adds), with every
    round's figures beside it."""
    best = min(runs, key=lambda r: r["server_cpu_us_per_token"])
    return {**best, "rounds_tok_per_s": [r["tok_per_s"] for r in runs],
            "rounds_cpu_us_per_token": [r["server_cpu_us_per_token"] for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[64])
    ap.add_argument("--step-ms", type=float, nargs="+", default=[8.0, 1.0],
                    help="the synthetic engine's step time(s): one the API keeps up with, one it does not")
    ap.add_argument("--reply", type=int, default=256, help="tokens a reply")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds a row")
    ap.add_argument("--stacks", nargs="+", choices=sorted(STACKS), default=["auto", "h11"],
                    help="uvicorn's loop and HTTP parser: auto (what openk3 serve runs: uvloop and httptools) and "
                         "h11 (asyncio and h11, its pure-Python stack), alternated")
    ap.add_argument("--rounds", type=int, default=2, help="times each row is measured (the stacks alternated)")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the child: the server on this port
    args = ap.parse_args()
    if args.serve is not None:
        return serve(args.serve, args.step_ms[0] / 1e3, args.stacks[0])
    runs = [measure(stack, step, c, args.reply, args.seconds) for _ in range(args.rounds) for c in args.clients
            for step in args.step_ms for stack in args.stacks]
    rows = [best_of([r for r in runs if (r["stack"], r["step_ms"], r["clients"]) == key])
            for key in dict.fromkeys((r["stack"], r["step_ms"], r["clients"]) for r in runs)]
    print("| stack | clients | step (ms) | demanded tok/s | streamed tok/s | server CPU us / token | "
          "server CPU share |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stack']} | {r['clients']} | {r['step_ms']:g} | {r['demanded_tok_per_s']:,.0f} | "
              f"{r['tok_per_s']:,.0f} | {r['server_cpu_us_per_token']:.1f} | {r['server_cpu_share']:.2f} |")
    if args.json:
        env = {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
               "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "reply": args.reply}
        env["stacks"] = {name: STACKS[name] or installed_stack() for name in args.stacks}
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
