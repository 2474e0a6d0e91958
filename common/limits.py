"""Admission limits every FastAPI stage shares: how many generation requests, and how large a body.

A server without limits queues without end: memory grows, latency grows, and every client
eventually times out. Past ``max_requests`` (running and queued together) a generation request is
refused at once with 503 and a ``Retry-After`` header, which well-behaved clients (the ``openai``
client among them) honour. A body over ``max_body_bytes`` is refused with 413 before it is parsed.

Both are plain ASGI middleware, so they see every request before FastAPI does, and the in-flight
count is exact: it drops when the response ends, whether it finished, failed or its client left.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .protocol import APIError

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class Limits:
    max_requests: int = 512  # generation requests held at once, running and queued
    max_body_bytes: int = 1 << 20  # 1 MiB: a full 8k-token context as text is about 40 KB
    retry_after_s: int = 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Limits:
        return cls(max_requests=args.max_requests, max_body_bytes=args.max_body_kb * 1024)


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    defaults = Limits()
    parser.add_argument("--max-requests", type=int, default=defaults.max_requests,
                        help="generation requests held at once, running and queued; past it, 503 "
                             f"with Retry-After (default: {defaults.max_requests})")
    parser.add_argument("--max-body-kb", type=int, default=defaults.max_body_bytes // 1024,
                        help=f"largest request body; past it, 413 (default: {defaults.max_body_bytes // 1024})")


def add_limits(app: FastAPI, limits: Limits) -> None:
    app.add_middleware(RequestLimit, limits=limits)


class RequestLimit:
    """Refuse generation requests past the in-flight cap (503) and bodies past the size cap (413)."""

    def __init__(self, app: ASGIApp, limits: Limits) -> None:
        self.app = app
        self.limits = limits
        self.in_flight = 0  # generation requests between arrival and the end of their response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            await self._refuse(scope, receive, send, self._too_large())
            return
        if scope["path"] not in GENERATION_PATHS:
            await self.app(scope, self._counted(receive), send)
            return
        if self.in_flight >= self.limits.max_requests:
            error = APIError(f"the server holds {self.in_flight} requests, its limit; retry in "
                             f"{self.limits.retry_after_s} s", 503, code="server_overloaded")
            await self._refuse(scope, receive, send, error, {"Retry-After": str(self.limits.retry_after_s)})
            return
        self.in_flight += 1
        try:
            await self.app(scope, self._counted(receive), send)
        finally:
            self.in_flight -= 1

    def _counted(self, receive: Receive) -> Receive:
        """A body sent without Content-Length (chunked) is measured as it arrives.

        Raised while FastAPI reads the body, an HTTPException reaches the client as our error object."""
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limits.max_body_bytes:
                raise HTTPException(413, self._too_large().detail.message)
            return message

        return receive_within_limit

    def _too_large(self) -> APIError:
        return APIError(f"the request body is larger than {self.limits.max_body_bytes} bytes", 413,
                        code="request_too_large")

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, error: APIError,
                      headers: dict[str, str] | None = None) -> None:
        response = JSONResponse(error.body(), status_code=error.status_code, headers=headers)
        await response(scope, receive, send)
