"""Shared by the server tests: `openk3 serve` as a real process on a free loopback port, found from its ready line."""

import select
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import httpx

READY = "openk3 serve: ready at "


@contextmanager
def serve_process(*args: str, timeout: float = 180):
    """Start `openk3 serve --port 0 ARGS` (one torch thread), wait for its ready line; yields the base URL
    (http://127.0.0.1:PORT). stderr goes to a file whose text failures show; the process is ended afterwards."""
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
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def metric(url: str, name: str) -> float:
    """The sum of the Prometheus samples whose name (with labels) starts with openk3_NAME."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"openk3_{name}"))
