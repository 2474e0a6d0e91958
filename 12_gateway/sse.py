"""Server-sent events: how a streamed answer is framed, and how the OpenAPI document describes a route that may
answer with them. No engine here: anything that streams (the stage's server, a gateway in front of servers)
imports it without importing PyTorch."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from common.protocol import ErrorResponse

# What the OpenAPI document says a generation route returns: JSON, or an SSE stream, or an error.
# Each streamed event's data is a JSON chunk (or, after a failure, an error object), then "[DONE]".
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}},
    400: {"model": ErrorResponse, "description": "Invalid request"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    500: {"model": ErrorResponse, "description": "Generation failed"},
    503: {"model": ErrorResponse, "description": "Overloaded (retry after Retry-After seconds) or engine stopped"},
}


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"
