"""What a replica and the gateway say to each other, in a module that both import and that imports no engine.

The gateway's process only validates, routes and relays: it must not load PyTorch or stage 09's engine (hundreds of
megabytes, and seconds of start-up, for nothing). Whatever a replica sends it is unpickled there, and unpickling an
object imports the module that defines its class: a message class defined in ``replica.py`` would make the gateway
import ``replica.py``, and with it torch and the whole engine. So the messages live here, beside the two pieces of
stage 09's HTTP layer that the gateway needs too (copies of ``server.py``'s, which imports the engine; a test keeps
them the same).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import Metric
from pydantic import BaseModel

from common.protocol import ErrorResponse


@dataclass(frozen=True)
class ResponseStart:
    """The first thing a replica's answer carries: the HTTP status and the headers of the stage 09 app."""

    status: int
    headers: list[tuple[str, str]]
    replica: str  # which replica answered (the gateway passes it on as the x-replica header)


@dataclass(frozen=True)
class EngineReport:
    """One replica's engine as its stage 09 server's /metrics shows it: every metric family of the server's registry,
    collected at one moment (``registry.collect()``: the same families and samples the text format is written from)."""

    replica: str
    metrics: list[Metric]


# As server.py's: what the OpenAPI document says a generation route returns (JSON, or an SSE stream, or an error).
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}},
    400: {"model": ErrorResponse, "description": "Invalid request"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    500: {"model": ErrorResponse, "description": "Generation failed"},
    503: {"model": ErrorResponse, "description": "Overloaded (retry after Retry-After seconds) or engine stopped"},
}


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (as server.py's)."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"
