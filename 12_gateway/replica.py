"""A replica: one stage 11 server, whole, inside a Ray Serve replica.

The replica starts the engine core (its own child process) and the OpenAI app exactly as
``python -m 11_quantization`` does (with its default ``--quantization auto``), and the
gateway calls that app in-process, over ASGI: the request's method, path and body go in, the response
comes back as it is sent (its status and headers, then each piece of its body). So every check, every
error object and every stream is stage 11's own, and a client that leaves the gateway leaves the app as
well (its stream is cancelled, the engine drops the request and frees its blocks).

It also tells Ray Serve what only it knows: how many requests wait in its scheduler and how many it is
generating for (``record_autoscaling_stats``, which the autoscaling policy reads), and tells the gateway everything
its stage 11 server's /metrics would show (``report``, which the gateway's /metrics shows for the whole fleet).
What it sends the gateway is defined in gateway_messages.py, which the gateway can import without loading PyTorch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import suppress
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI
from starlette.types import Message

from .async_engine import AsyncEngine
from .config import EngineConfig
from .gateway_messages import EngineReport, ResponseStart
from .server import create_app

log = logging.getLogger("llm-course")


class ModelReplica:
    """A stage 11 engine and its app. ``fleet.py`` makes it a Ray Serve deployment; a test can build one bare."""

    def __init__(self, config: EngineConfig, served_name: str, threads: int = 1) -> None:
        self.replica = replica_id()
        self.served_name = served_name
        # The engine core is this replica's child process, computing on the cores Ray reserved for the replica.
        self.engine = AsyncEngine(config, threads=threads)
        self.app: FastAPI = create_app(self.engine, served_name)
        self.engine.start()  # (the app's lifespan would start it; called over ASGI, the app has none)

    async def handle(self, method: str, path: str, body: bytes,
                     prefix_hashes: list[bytes] | None = None) -> AsyncIterator[ResponseStart | bytes]:
        """Call the app; yield its response start, then each piece of its body as it is sent.

        ``prefix_hashes`` is for the router (it reads them from the call); the app hashes blocks itself."""
        async for message in call_app(self.app, method, path, body):
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield ResponseStart(message["status"], headers, self.replica)
            elif message.get("body"):
                yield message["body"]

    def describe(self) -> dict[str, Any]:
        """What the gateway's /v1/models says of the model: its name and context length."""
        return {"model": self.served_name, "max_model_len": self.engine.max_model_len}

    def health(self) -> dict[str, Any]:
        stats = self.engine.stats()
        return {"replica": self.replica, "alive": self.engine.alive, **asdict(stats),
                "prefix_cache_hit_rate": stats.prefix_cache.hit_rate}

    def report(self) -> EngineReport:
        """Every metric of this replica's stage 11 server, as its /metrics would show them now: the gateway asks each
        replica every second (``FleetView.refresh_engines``) and shows them all on its own /metrics."""
        return EngineReport(self.replica, list(self.engine.metrics.registry.collect()))

    def record_autoscaling_stats(self) -> dict[str, float]:
        stats = self.engine.stats()
        return {"waiting": float(stats.waiting), "running": float(stats.running)}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine stopped is replaced."""
        if not self.engine.alive:
            raise RuntimeError("the engine has stopped")

    def __del__(self) -> None:
        if hasattr(self, "engine"):
            self.engine.stop()


def replica_id() -> str:
    """This replica's id inside Ray Serve ("" outside it, in a test that builds a replica bare)."""
    from ray import serve

    with suppress(Exception):  # RayServeException: not inside a replica
        return serve.get_replica_context().replica_id.unique_id
    return ""


async def call_app(app: FastAPI, method: str, path: str, body: bytes) -> AsyncIterator[Message]:
    """Call an ASGI app with one request; yield the messages it sends, until its body ends.

    When the caller stops early (the client left the gateway), the app's next ``receive`` says
    ``http.disconnect`` and its task is cancelled, as a server does when a connection closes."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("gateway", 0), "server": ("replica", 0)}
    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))  # the app returned (or failed): no more messages
    try:
        while (message := await sent.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                return
    finally:
        gone.set()
        task.cancel()  # (nothing, if it has returned)
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:  # its 500 is sent: the error is for the log
            log.error("the app failed: %r", task.exception())
