"""Fuzz each FastAPI stage from its own OpenAPI document: schemathesis generates requests, valid
and invalid, for every route; the server must answer each one with a documented status, the
declared content type and, for JSON, a body of the declared shape. Above all: never a 5xx, never
a hang.

The fuzzer sees the server's document with a few changes: ``max_tokens`` (and the chat route's
``max_completion_tokens``) is required and at most 2, ``model`` is the served one and token ids
are inside the vocabulary. Generation is the slow part of a request, and the fuzz is about what
the server accepts, not about long answers; the changes only make more cases reach the model.
Half the cases are negative (they break the schema on purpose) and must get a 400.

It has found four bugs so far: a temperature so small it is 0 in float32 and a top_p of 5e-324
made sampling fail (now greedy, and the best token always kept), and a seed past 64 bits made
torch overflow (now a 400), and a top_k past 64 bits overflowed stage 04's batched sampler.

The cases are the same on every run (``derandomize``), so CI is repeatable; ``FUZZ_RANDOM=1``
explores new ones. The newest stage, whose server every later change touches, gets 100 cases a route;
the earlier ones 50 cases of the same strategy (``FUZZ_CASES=200`` gives every stage 200). The four bugs
above each have a test of their own (test_sampler, test_04_continuous_batching, the schema's seed bound),
so the fuzz's share of the suite's time goes to new inputs, not to finding them again."""

from __future__ import annotations

import copy
import os
from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from .stages import FASTAPI_STAGES

STAGES = [folder[:2] for folder in FASTAPI_STAGES]
MODEL = "smollm2-135m-instruct"
VOCAB_SIZE = 49152  # SmolLM2's
CASES_PER_ROUTE_EARLIER = int(os.environ.get("FUZZ_CASES", 50))  # every earlier stage's
CASES_PER_ROUTE = max(100, CASES_PER_ROUTE_EARLIER)  # the newest stage's
MAX_FUZZ_TOKENS = 2
TIMEOUT_S = 60  # a request that takes longer than this is a hang
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


def small_requests(document: dict[str, Any]) -> dict[str, Any]:
    """The server's OpenAPI document, with output limits the fuzz can afford."""
    document = copy.deepcopy(document)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schema = document["components"]["schemas"][name]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in schema["properties"]:
                schema["properties"][field] = {"type": "integer", "minimum": 1, "maximum": MAX_FUZZ_TOKENS}
        schema["required"] = sorted({*schema.get("required", []), "max_tokens"})
        # The one model the servers serve, and token ids inside its vocabulary: anything else is a
        # 400 (as it should be), and the fuzz should reach the model too.
        schema["properties"]["model"] = {"enum": [MODEL, None]}
        for branch in schema["properties"].get("prompt", {}).get("anyOf", []):
            if branch.get("type") == "array":
                branch["items"]["maximum"] = VOCAB_SIZE - 1
    return document


def shorten(body: Any) -> Any:
    """Negative cases break the limits above on purpose; keep the ones the server would still run
    for a long time (a missing or a moderate ``max_tokens``) short. Huge values stay: they are 400s."""
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            value = body.get(field)
            if field == "max_tokens" and value is None:
                body[field] = MAX_FUZZ_TOKENS
            elif type(value) is int and MAX_FUZZ_TOKENS < value < 1_000_000:
                body[field] = MAX_FUZZ_TOKENS
    return body


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stage", STAGES)
def test_no_5xx_and_no_hang(stage, route, request):
    server = request.getfixturevalue(f"server{stage}")
    document = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    operation = schemathesis.openapi.from_dict(small_requests(document))[route]["POST"]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))
    statuses: Counter[int] = Counter()
    num_cases = CASES_PER_ROUTE if stage == STAGES[-1] else CASES_PER_ROUTE_EARLIER

    @given(case=cases)
    @settings(max_examples=num_cases, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              derandomize=os.environ.get("FUZZ_RANDOM") != "1")
    def fuzz(case) -> None:
        case.body = shorten(case.body)
        response = case.call_and_validate(base_url=server.url, timeout=TIMEOUT_S, checks=CHECKS)
        statuses[response.status_code] += 1

    fuzz()
    print(f"stage {stage} {route}: {sum(statuses.values())} cases, statuses {dict(statuses)}")
    assert sum(statuses.values()) >= num_cases
    assert set(statuses) >= {200, 400}  # some reached the model, some were refused
