"""``--trace`` (stages 02 on): one JSON line per request that says where its time went, and the engine's
busy seconds on /metrics (the busy fraction of the benchmark figure)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from common.trace import RequestTrace, StepClock, Tracer, read_step_traces, read_traces

from .conftest import serve_stage
from .stages import FASTAPI_STAGES, has

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
        yield server, path, folder


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_traced_request_says_where_its_time_went(traced_server, stream):
    server, path, folder = traced_server
    busy_before = server.metric("llm_engine_busy_seconds_total")
    phases_before = step_phases(server)
    decodes_before = server.metric("llm_decode_step_seconds_count") if folder >= "04" else 0.0
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
    if folder >= "04":  # a batching stage also says where each step's time went
        check_step_phases(server, folder, path, phases_before, decodes_before, busy_s, stream)


STEP_PHASES = {"schedule", "prepare", "execute", "update", "detokenize", "handoff"}  # and sample, or verify (08 on)
# With overlap scheduling (stage 10 on) a turn launches one step and processes the one before: a turn that launches
# nothing has no preparing or executing phase, a turn that processes nothing no update or detokenizing.
LAUNCH_PHASES, PROCESS_PHASES = {"prepare", "execute"}, {"update", "detokenize"}
# From stage 10 these two are the API process's, timed while the core takes its next turn: not the core's busy time.
API_PHASES = {"handoff", "detokenize"}


def step_phases(server) -> dict[str, tuple[float, float]]:
    """Each phase's (count, seconds) from llm_step_phase_seconds on /metrics; {} on a stage without it."""
    text = httpx.get(f"{server.url}/metrics").text
    phases: dict[str, list[float]] = {}
    for line in text.splitlines():
        if line.startswith("llm_step_phase_seconds_count{") or line.startswith("llm_step_phase_seconds_sum{"):
            name, value = line.rsplit(" ", 1)
            phase = name.split('phase="')[1].split('"')[0]
            phases.setdefault(phase, [0.0, 0.0])["_sum{" in name] = float(value)
    return {phase: (count, seconds) for phase, (count, seconds) in phases.items()}


def check_step_phases(server, folder: str, path: Path, before: dict[str, tuple[float, float]], before_decodes: float,
                      busy_s: float, stream: bool) -> None:
    """The request's steps (one prefill, MAX_TOKENS - 1 decodes) each wrote a line with every phase, and /metrics
    counted the same steps; their phases add up to no more than the engine's busy time. With overlap scheduling a
    line is a turn: the step it launched (if any), and the news of the step before it (the first turn has none; a
    turn that launches nothing reads the last step's tokens); a step that cannot overlap (one with guesses) has its
    news in its own turn, with the step before's."""
    overlap = has(folder, "overlap")
    deadline = time.monotonic() + 10  # the engine thread writes a step's line just after handing its outputs over
    steps = read_step_traces(path)
    while sum(step["seqs"] for step in steps) < MAX_TOKENS and time.monotonic() < deadline:
        time.sleep(0.02)
        steps = read_step_traces(path)
    assert [step["step"] for step in steps] == sorted(step["step"] for step in steps)
    launched = [step for step in steps if step["tokens"]]
    assert [step["decoding"] for step in launched] == [0] + [1] * (MAX_TOKENS - 1)  # the prefill, then decodes
    assert sum(step["seqs"] for step in steps) == MAX_TOKENS  # nothing else ran: each step is the request's
    if not overlap:
        assert steps == launched and all(step["seqs"] == 1 for step in steps)
    # From stage 10 the executor queues the forward pass on the device ("launch"); the wait for it is "read".
    step_phases_of, launch_phases = (STEP_PHASES - {"execute"} | {"launch"}, {"prepare", "launch"}) if overlap else \
        (STEP_PHASES, LAUNCH_PHASES)
    for step in steps:
        absent = (set() if step["tokens"] else launch_phases) | (set() if step["seqs"] else PROCESS_PHASES)
        phases = step_phases_of - absent
        assert phases <= step["phases_ms"].keys()
        assert all(ms >= 0 for ms in step["phases_ms"].values())
    after = step_phases(server)
    counted = {phase: after[phase][0] - before.get(phase, (0, 0))[0] for phase in after}
    assert all(counted[phase] == sum(phase in step["phases_ms"] for step in steps) for phase in step_phases_of)
    assert server.metric("llm_decode_step_seconds_count") - before_decodes == MAX_TOKENS - 1
    phase_s = sum(after[phase][1] - before.get(phase, (0, 0))[1] for phase in after)
    core_s = phase_s - sum(after[phase][1] - before.get(phase, (0, 0))[1] for phase in after
                           if overlap and phase in API_PHASES)
    assert core_s <= busy_s + 1e-6  # busy time is the steps' phases (the core's), from the first to the last
    traced_s = sum(sum(step["phases_ms"].values()) for step in steps) / 1000
    assert traced_s == pytest.approx(phase_s, abs=1e-3)
    writes = [line for line in httpx.get(f"{server.url}/metrics").text.splitlines()
              if line.startswith("llm_stream_write_seconds_count")]
    assert len(writes) == 1 and (float(writes[0].split()[-1]) >= MAX_TOKENS) == stream


def test_a_step_clock_adds_up_each_phases_laps():
    clock = StepClock()
    for phase in ("update", "detokenize", "update", "detokenize"):
        time.sleep(0.001)
        clock.lap(phase)
    assert list(clock.phases) == ["update", "detokenize"]  # in the order they first ran
    assert all(seconds >= 0.002 for seconds in clock.phases.values())  # two laps of at least 1 ms each
    assert sum(clock.phases.values()) == pytest.approx(clock.last - clock.started)


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
