"""Where one request's time goes: its spans, written as one JSON line when its response ends.

    python -m 04_continuous_batching --trace              # one line per request on stderr
    python -m 04_continuous_batching --trace traces.jsonl # appended to a file

Any stage from 02 takes ``--trace``. A request's life, in the order it happens:

* ``tokenize``: the HTTP handler turns the prompt (or the chat) into token ids;
* ``queued``: it waits for the engine (in the inbox, then in the scheduler's waiting queue);
* ``prefill``: the forward pass over its prompt;
* ``decode``: one span per forward pass that produced one of its tokens;
* ``detokenize``: after each token, the engine turns it into safe-to-send text (and checks stops);
* ``send``: the HTTP side hands each chunk to the network (streaming), or the whole answer.

On a batching stage (04 on) a prefill or decode span is the whole step's time: the request shared
that forward pass with the rest of the batch, and waited for all of it. A preempted request waits
(``queued``) and is prefilled again. Tracing costs two clock reads per span; off, it costs nothing.

A batching stage also writes one line per engine step, ``{"step": ...}``: where that step's time went,
phase by phase (``StepClock``: schedule, prepare, execute, sample, update, detokenize, and the
hand-off of its outputs to the event loop; from stage 08, propose, and verify for sample), the same
phases its /metrics counts in
``llm_step_phase_seconds``. ``read_traces`` reads the requests' lines, ``read_step_traces`` the steps'.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

ENGINE_SPANS = ("prefill", "decode")  # forward passes: the time between them is the request's wait


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # time.perf_counter() seconds
    end: float


class RequestTrace:
    """One request's spans. The HTTP side adds tokenize and send, the engine thread the rest; never both at
    once for one request (the engine's spans come before the output that the HTTP side then sends)."""

    def __init__(self, tracer: Tracer | None = None, request_id: str = "") -> None:
        self.tracer = tracer  # None: tracing is off, and every method does nothing
        self.request_id = request_id
        self.spans: list[Span] = []
        self.idle_since = time.perf_counter()  # when it last stopped being worked on: the start of a wait

    def add(self, name: str, start: float, end: float | None = None) -> None:
        """Record a span; a prefill first records the wait before it (``queued``)."""
        if self.tracer is None:
            return
        end = time.perf_counter() if end is None else end
        if name == "prefill":
            self.spans.append(Span("queued", self.idle_since, start))
        self.spans.append(Span(name, start, end))
        if name in ENGINE_SPANS or name == "tokenize":
            self.idle_since = end

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the body of a ``with`` block as a span called ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start)

    async def sending(self, events: AsyncGenerator[str, None],
                      observe: Callable[[float], None] | None = None) -> AsyncIterator[str]:
        """Pass a stream's events through, timing how long each takes to hand to the network; write the
        trace when the stream ends. The time after ``yield`` is the server writing the event out; ``observe``
        (a metric's, say) is given each of those times, traced or not."""
        try:
            async with aclosing(events):  # closing this stream (the client left) closes ``events`` now
                async for event in events:
                    start = time.perf_counter()
                    yield event
                    if observe is not None:
                        observe(time.perf_counter() - start)
                    self.add("send", start)
        finally:
            self.finish()

    def finish(self, send_started: float | None = None) -> None:
        """The response has gone out (since ``send_started``, for a whole answer): write the trace."""
        if self.tracer is None:
            return
        if send_started is not None:
            self.add("send", send_started)
        self.tracer.write(self)

    def as_dict(self) -> dict[str, Any]:
        """Spans in milliseconds from the first one: ``[name, start_ms, duration_ms]``, and totals per name.
        ``origin_s`` is the first span's start on the server's clock, to line up several requests' traces."""
        origin = min((s.start for s in self.spans), default=0.0)
        spans = [[s.name, round(1000 * (s.start - origin), 3), round(1000 * (s.end - s.start), 3)] for s in self.spans]
        totals: dict[str, float] = {}
        for name, _, duration in spans:
            totals[name] = round(totals.get(name, 0.0) + duration, 3)
        end = max((s.end for s in self.spans), default=origin)
        return {"request_id": self.request_id, "origin_s": round(origin, 6),
                "total_ms": round(1000 * (end - origin), 3), "totals_ms": totals, "spans": spans}


class StepClock:
    """Where one engine step's time goes: ``lap(phase)`` ends the phase that began at the previous lap (or
    when the clock started) and adds its time to ``phase``. A phase may come back (detokenize, then update,
    once per sequence): its laps add up. One clock read per lap: cheap enough to run on every step."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}  # seconds per phase, in the order they first ran

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now


class Tracer:
    """Writes every finished request's trace as one JSON line, to stderr or to a file; and, from the engine
    thread, one line per step (``write_step``)."""

    def __init__(self, path: str | None) -> None:
        self.path = path  # None: off; "-": stderr
        self._lock = threading.Lock()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Tracer:
        return cls(args.trace)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def new(self, request_id: str) -> RequestTrace:
        return RequestTrace(self if self.enabled else None, request_id)

    def write(self, trace: RequestTrace) -> None:
        self._write_line(json.dumps(trace.as_dict()))

    def write_step(self, step: int, clock: StepClock, num_seqs: int, num_tokens: int, num_decoding: int) -> None:
        """One engine step's line: its start on the server's clock (``start_s``, as a request's ``origin_s``),
        its size (sequences with news, tokens run, sequences that decoded), and its phases in milliseconds."""
        if not self.enabled:
            return
        phases = {name: round(1000 * seconds, 3) for name, seconds in clock.phases.items()}
        self._write_line(json.dumps({"step": step, "start_s": round(clock.started, 6), "seqs": num_seqs,
                                     "tokens": num_tokens, "decoding": num_decoding, "phases_ms": phases}))

    def _write_line(self, line: str) -> None:
        with self._lock:
            if self.path == "-":
                print(line, file=sys.stderr, flush=True)
            else:
                with open(self.path, "a") as out:  # type: ignore[arg-type]
                    print(line, file=out)


NO_TRACE = Tracer(None)


def add_trace_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", nargs="?", const="-", default=None, metavar="FILE",
                        help="write each request's spans (queued, tokenize, prefill, decode, detokenize, send) "
                             "as one JSON line, to stderr or appended to FILE (from stage 04, also each "
                             "engine step's phases)")


def read_traces(source: str | Path | TextIO) -> list[dict[str, Any]]:
    """The requests' traces in a file (or a log that has other lines too: only the trace lines are read)."""
    return _read_lines(source, '{"request_id"')


def read_step_traces(source: str | Path | TextIO) -> list[dict[str, Any]]:
    """The engine steps' lines in a file (``Tracer.write_step``), in the order they were written."""
    return _read_lines(source, '{"step"')


def _read_lines(source: str | Path | TextIO, start: str) -> list[dict[str, Any]]:
    text = source.read() if hasattr(source, "read") else Path(source).read_text()  # type: ignore[union-attr]
    return [json.loads(line) for line in text.splitlines() if line.startswith(start)]
