"""Shared by the server tests: `openk3 serve` as a real process on a free loopback port, found from its ready line."""

import select
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

import httpx

READY = "openk3 serve: ready at "


def o1_checkpoint(directory, preset: str = "k3-tiny", seed: int = 0) -> str:
    """A checkpoint of `preset` with O(1)-scale random weights (tests/random_weights.py): unlike the default init
    (std 0.02), its greedy tokens depend on the whole context, so cache-on / cache-off comparisons mean something."""
    from openk3.config import get_preset
    from openk3.interop import save_pretrained
    from openk3.model import K3ForCausalLM
    from random_weights import randomise

    model = K3ForCausalLM(get_preset(preset))
    randomise(model, seed)
    save_pretrained(model, directory)
    return str(directory)


@contextmanager
def serve_process(*args: str, timeout: float = 180):
    """Start `openk3 serve --port 0 ARGS` (one torch thread), wait for its ready line; yields (the base URL
    http://127.0.0.1:PORT, the ready line). stderr goes to a file that failures show; the process is ended after."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "openk3", "serve", "--host", "127.0.0.1", "--port", "0",
                                 "--threads", "1", *args], stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            line, deadline = "", time.monotonic() + timeout
            while not line.startswith(READY):
                left = deadline - time.monotonic()
                if proc.poll() is not None or left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                    log.seek(0)
                    raise AssertionError(f"the server did not become ready:\n{log.read().decode()[-4000:]}")
                line = proc.stdout.readline()
            url = line[len(READY):].split()[0].removesuffix("/v1")
            assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
            yield url, line.strip()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def inprocess_server(engine, model_name: str, log_level: str = "critical"):
    """`create_app(engine)` under uvicorn on a thread of this process, on a free loopback port; yields the base URL.
    uvicorn leaves logging alone (no log_config): its records and the app's reach the root logger (pytest's caplog)
    from `log_level` up."""
    import uvicorn

    from openk3.serve.api import create_app
    from openk3.serve.command import listen_socket

    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model_name), log_level=log_level, log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the in-process server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def metric(url: str, name: str) -> float:
    """The sum of the Prometheus samples whose name (with labels) starts with openk3_NAME."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"openk3_{name}"))
