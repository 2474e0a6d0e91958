"""Run a stage's app on a free loopback port in a background thread, for tests that use real clients."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from common.net import free_port

if TYPE_CHECKING:
    import openai


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    engine: Any = None

    def client(self, **kwargs: Any) -> openai.OpenAI:
        import openai  # here, not at the top: collecting the GPU tests imports no client library

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    def metric(self, name: str) -> float:
        """Read one unlabelled sample from GET /metrics."""
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until /metrics shows nothing running or waiting (a session server's earlier test may
        have left a request that its client abandoned still finishing); True once idle."""
        deadline = time.monotonic() + timeout
        while True:
            if self.metric("llm_requests_running") == 0 and self.metric("llm_requests_waiting") == 0:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


def wait_healthy(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not become healthy in {timeout}s")


@contextmanager
def start_flask(app: Any) -> Iterator[LiveServer]:
    from werkzeug.serving import make_server

    port = free_port()
    server = make_server("127.0.0.1", port, app, threaded=False)  # one request at a time, like the stage
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    try:
        yield LiveServer(url)
    finally:
        server.shutdown()
        thread.join(timeout=10)


@contextmanager
def start_fastapi(app: Any) -> Iterator[LiveServer]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    try:
        yield LiveServer(url)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
