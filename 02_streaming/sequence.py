"""Request state: what the engine thread and the HTTP side both need to know about one request."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Literal

from common.trace import RequestTrace

from .sampler import SamplingParams, TokenLogprobs


@dataclass
class RequestOutput:
    """One step's news for the client: the sampled token, the text it made safe to send."""

    request_id: str
    token_ids: list[int]  # the tokens this step added: one (none for a prompt scored with max_tokens 0)
    text: str  # may be "" while a character or a possible stop string is incomplete
    finish_reason: str | None  # None while running; then "stop", "length", or "error"
    prompt_tokens: int
    completion_tokens: int  # tokens generated so far, this one included
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, if the request asked
    # In the first output only, if the request asked: prompt tokens 1... (the first has no logprob).
    prompt_logprobs: list[TokenLogprobs] | None = None
    error: Exception | None = None  # why the request failed, with finish_reason "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failed(cls, request_id: str, error: Exception, prompt_tokens: int, completion_tokens: int = 0) -> RequestOutput:
        """The last output of a request that failed: the server turns ``error`` into an HTTP status."""
        return cls(request_id, [], "", "error", prompt_tokens, completion_tokens, error=error)


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # Where the engine thread delivers RequestOutputs (or an exception): the HTTP side's loop/queue.
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    arrival_time: float = field(default_factory=time.perf_counter)
    # waiting -> running -> finished, or -> aborted when the client goes away (the engine checks
    # before every decode step). Moves happen under AsyncEngine's lock.
    state: Literal["waiting", "running", "finished", "aborted"] = "waiting"
    trace: RequestTrace = field(default_factory=RequestTrace)  # spans, when the server runs with --trace
