"""``--trace`` (stages 02 on): one JSON line per request that says where its time went, and the engine's
busy seconds on /metrics (the busy fraction of the benchmark figure)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from common.trace import RequestTrace, Tracer, read_traces

from .conftest import serve_stage
from .stages import FASTAPI_STAGES

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 5


def wait_for_traces(path: Path, count: int, timeout_s: float = 10) -> list[dict]:
    """The trace is written when the response has gone out, a moment after the client has read it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and len(traces := read_traces(path)) >= count:
            return traces
        time.sleep(0.02)
    raise AssertionError(f"{path}: fewer than {count} traces after {timeout_s} s")


@pytest.fixture(params=FASTAPI_STAGES)
def traced_server(request: pytest.FixtureRequest, tmp_path: Path):
    folder = request.param
    engine = request.getfixturevalue(f"engine{folder[:2]}")  # the session's engine, served with a tracer
    path = tmp_path / "traces.jsonl"
    with serve_stage(folder, engine, tracer=Tracer(str(path))) as server:
        yield server, path


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_traced_request_says_where_its_time_went(traced_server, stream):
    server, path = traced_server
    busy_before = server.metric("llm_engine_busy_seconds_total")
    started = time.perf_counter()
    response = server.client().completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                                  max_tokens=MAX_TOKENS, stream=stream, extra_body={"ignore_eos": True})
    response_id = next(iter(response)).id if stream else response.id
    if stream:
        list(response)  # read to the end
    wall_s = time.perf_counter() - started
    [trace] = wait_for_traces(path, 1)

    assert trace["request_id"] == response_id  # the id the client saw
    names = [name for name, _, _ in trace["spans"]]
    assert names[:3] == ["tokenize", "queued", "prefill"]
    assert names.count("prefill") == 1 and names.count("queued") == 1
    assert names.count("decode") == MAX_TOKENS - 1  # the prefill samples the first token
    assert names.count("detokenize") == MAX_TOKENS
    assert names.count("send") >= (MAX_TOKENS if stream else 1)
    # The engine's spans follow one another: a prefill, then one decode after the other, never overlapping.
    engine_spans = [(start, start + d) for name, start, d in trace["spans"] if name in ("prefill", "decode")]
    ends, next_starts = [end for _, end in engine_spans[:-1]], [start for start, _ in engine_spans[1:]]
    assert all(end <= next_start + 2e-3 for end, next_start in zip(ends, next_starts, strict=True))  # ms, rounded
    queued = next(span for span in trace["spans"] if span[0] == "queued")
    assert queued[1] + queued[2] == pytest.approx(engine_spans[0][0], abs=2e-3)  # the wait ends as the prefill starts
    for name, total in trace["totals_ms"].items():
        assert total == pytest.approx(sum(d for n, _, d in trace["spans"] if n == name), abs=1e-2)
    assert 0 < trace["total_ms"] <= 1000 * wall_s + 50
    # The engine was busy for the prefill and the decodes, and for no longer than the request took. (Stages 02 and
    # 03 count a request's busy time once its generator is closed, which can come after its trace: wait for that.)
    assert server.wait_idle()
    busy_s = server.metric("llm_engine_busy_seconds_total") - busy_before
    assert sum(end - start for start, end in engine_spans) / 1000 <= busy_s + 1e-3
    assert busy_s <= wall_s


def test_without_trace_nothing_is_recorded():
    trace = Tracer(None).new("req-1")
    with trace.span("tokenize"):
        pass
    trace.add("prefill", time.perf_counter())
    trace.finish()
    assert trace.spans == []


def test_a_prefill_closes_the_wait_before_it_and_a_preemption_waits_again(tmp_path):
    path = tmp_path / "t.jsonl"
    trace = RequestTrace(Tracer(str(path)), "req-1")
    trace.add("tokenize", 0.0, 1.0)
    trace.add("prefill", 3.0, 4.0)  # queued 1.0 -> 3.0
    trace.add("detokenize", 4.0, 4.5)
    trace.add("decode", 5.0, 6.0)
    trace.add("prefill", 9.0, 10.0)  # preempted after its decode: queued again 6.0 -> 9.0, then recomputed
    trace.finish()
    [written] = read_traces(path)
    assert [(n, s, d) for n, s, d in written["spans"] if n == "queued"] == [("queued", 1000.0, 2000.0),
                                                                          ("queued", 6000.0, 3000.0)]
    assert written["totals_ms"]["queued"] == 5000.0 and written["total_ms"] == 10000.0
