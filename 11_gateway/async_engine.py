"""The engine thread and its bridge to asyncio: the HTTP side submits requests and reads outputs, the
thread alone drives the engine. Each turn of its loop hands over the news of the step the engine just processed,
while the step it launched runs."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from common.trace import NO_TRACE, RequestTrace, StepClock, Tracer

from .engine import Engine, EngineStopped, InvalidRequest
from .metrics import Metrics
from .sampler import SamplingParams
from .sequence import Request, RequestOutput, StepResult
from .stats import EngineStats

log = logging.getLogger("llm-course")


# --- what the HTTP side sends the engine thread ------------------------------------------------------


@dataclass
class AddRequest:
    request: Request


@dataclass
class AbortRequest:
    request_id: str  # its client left


@dataclass
class Shutdown:
    pass


InboxMessage = AddRequest | AbortRequest | Shutdown
RANK_CHECK_S = 1.0  # how often an idle engine checks that its other ranks are alive


class AsyncEngine:
    """Runs the engine's step loop on its own thread and bridges it to asyncio.

    The HTTP side never touches the engine: ``generate`` puts the request in an inbox and reads
    outputs from the request's own asyncio queue, and ``stats()`` returns the snapshot the thread
    took after its last step. The thread takes everything from the inbox (new requests, aborts)
    between two steps, so the engine is only ever used by one thread.

    A step's outputs cross to the event loop together, in one call: each crossing wakes the loop (a write
    to its self-pipe, a system call), so one per output would cost a batch of 64 sixty-four wake-ups.
    """

    def __init__(self, engine: Engine, metrics: Metrics | None = None, tracer: Tracer = NO_TRACE) -> None:
        self._engine = engine
        self._tracer = tracer  # with --trace, each step's phases too
        # What the server may read from any thread: fixed at start-up.
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.kv_capacity_tokens = engine.kv_capacity_tokens
        self.metrics = metrics or Metrics()
        self._stats = engine.stats()  # replaced (never modified) by the engine thread
        self.metrics.watch(self.stats)
        self._inbox: queue.Queue[InboxMessage] = queue.Queue()
        self._requests: dict[str, Request] = {}  # owned by the engine thread
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._lock = threading.Lock()  # so that no request slips into the inbox after the thread's last look
        self._stopped = False  # set under the lock when the thread exits: submitting then fails fast
        self._next_id = 0
        self._num_steps = 0
        self._counted = self._stats  # the snapshot the counters were last moved to

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(Shutdown())
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        """Serving: the thread runs and has not begun to stop (stopping the other ranks takes a moment)."""
        return self._thread.is_alive() and not self._stopped

    def stats(self) -> EngineStats:
        return self._stats

    def encode(self, prompt: str) -> list[int]:
        return self._engine.encode(prompt)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self._engine.encode_chat(messages)

    # --- the HTTP side (asyncio) ----------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, trace: RequestTrace | None = None,
                       n: int = 1) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as the engine thread produces them.

        A failure arrives as an output with ``error`` set (the last one). If the consumer stops
        early (the client disconnected, the task was cancelled), the ``finally`` asks the engine
        thread to drop the request, which frees its blocks.
        """
        self._next_id += 1
        request = Request(f"req-{self._next_id}", prompt_ids, params, loop=asyncio.get_running_loop(),
                          trace=trace or RequestTrace(), n=n)
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self._inbox.put(AddRequest(request))
        if stopped:
            yield RequestOutput.failed(request.request_id, EngineStopped("the engine has stopped"), len(prompt_ids))
            return
        try:
            unfinished = request.n  # samples still running; one error ends the request
            while True:
                output = await request.outputs.get()
                yield output
                unfinished -= output.finished
                if unfinished == 0 or output.error is not None:
                    request.finished = True
                    return
        finally:
            if not request.finished:
                self._inbox.put(AbortRequest(request.request_id))

    # --- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        stopped = EngineStopped("the engine stopped before this request finished")
        failed = True  # until the loop returns: a rank gone, a GPU failed, a bug
        try:
            self._step_loop()
            failed = False
        except EngineStopped as exc:  # the engine cannot go on (the GPU failed, a rank died): stop serving, say why
            log.error("%s", exc)
            stopped = exc
        finally:  # a normal stop, or a bug that killed the thread: fail whatever is left at once
            with self._lock:
                self._stopped = True
            failed_outputs = []
            for request_id, request in self._requests.items():
                self._engine.abort(request_id)  # its blocks go back to the pool
                failed_outputs.append((request, RequestOutput.failed(request_id, stopped, len(request.prompt_ids))))
            self._requests.clear()
            while not self._inbox.empty():
                if isinstance(message := self._inbox.get(), AddRequest):
                    request = message.request
                    failed_outputs.append((request, RequestOutput.failed(request.request_id, stopped,
                                                                         len(request.prompt_ids))))
            self._deliver(failed_outputs)
            self._stats = self._engine.stats()
            self._engine.shutdown(graceful=not failed)  # the other ranks stop too

    def _step_loop(self) -> None:
        while True:
            # Idle: sleep until something arrives. Busy: take what has arrived, without waiting.
            if not self._drain_inbox(block=not self._engine.has_unfinished()):
                return
            clock = StepClock()
            result = self._engine.step(clock)
            stats = self._engine.stats()
            self.metrics.count(self._counted, stats)  # the counters move before the new snapshot is published:
            self._stats = self._counted = stats  # whoever sees an idle engine sees its counters complete
            self.metrics.count_verifications(result.accepted_lengths)
            now = time.perf_counter()
            ready = []
            for output in result.outputs:
                if (request := self._requests.get(output.request_id)) is None:
                    continue  # another of its samples failed in this step: the request has ended
                request.num_finished += output.finished
                if output.error is not None:  # one sample failed: the request fails, its other samples stop
                    self._engine.abort(output.request_id)
                if request.num_finished == request.n or output.error is not None:
                    del self._requests[output.request_id]
                if output.error is None:
                    self._record(request, output, now)
                ready.append((request, output))
            self._deliver(ready)
            clock.lap("handoff")
            self._observe(clock, result)

    def _observe(self, clock: StepClock, result: StepResult) -> None:
        """A turn's phases into /metrics (and --trace): the step it launched and the step before it that it processed
        (the last step's tokens are read in a turn that launches nothing). An idle look at the scheduler is no step."""
        if not result.num_tokens and not result.outputs:
            return
        self.metrics.engine_busy.inc(clock.last - clock.started)  # its rate: the busy fraction
        self.metrics.observe_step(clock.phases, result.num_decoding)
        self._num_steps += 1
        self._tracer.write_step(self._num_steps, clock, len(result.outputs), result.num_tokens, result.num_decoding)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every queued add and abort; False when asked to stop. Idle, check every second that the
        other ranks are still there: a dead one stops the engine, and /health says so."""
        while True:
            try:
                watch = block and self._engine.tp.size > 1  # idle, with ranks to check on
                message = self._inbox.get(block=block, timeout=RANK_CHECK_S if watch else None)
            except queue.Empty:
                if block:  # idle: the time to check on the ranks
                    self._engine.check_ranks()
                    continue
                break
            if isinstance(message, Shutdown):
                return False
            if isinstance(message, AddRequest):
                self._add(message.request)
            elif message.request_id in self._requests:  # an abort of a request that has not finished yet
                del self._requests[message.request_id]
                self._engine.abort(message.request_id)
            block = False  # after the first message, take only what is already there
        self._stats = self._engine.stats()
        return True

    def _add(self, request: Request) -> None:
        try:
            self._engine.add_request(request.request_id, request.prompt_ids, request.params, request.trace, request.n)
        except InvalidRequest as exc:
            self._deliver([(request, RequestOutput.failed(request.request_id, exc, len(request.prompt_ids)))])
            return
        self._requests[request.request_id] = request
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))

    def _record(self, request: Request, output: RequestOutput, now: float) -> None:
        self.metrics.generation_tokens.inc(len(output.token_ids))
        if output.index != 0:
            return  # the latencies of a request with n samples: those of its first
        if output.completion_tokens == 1:
            self.metrics.ttft.observe(now - request.arrival_time)
        else:
            self.metrics.itl.observe(now - request.last_token_time)
        request.last_token_time = now

    @staticmethod
    def _deliver(ready: list[tuple[Request, RequestOutput]]) -> None:
        """Hand outputs to their requests' asyncio queues from this (non-asyncio) thread: one call per event
        loop (a server has one), whatever the number of outputs."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Request, RequestOutput]]] = {}
        for request, output in ready:
            by_loop.setdefault(request.loop, []).append((request, output))
        for loop, outputs in by_loop.items():
            try:
                loop.call_soon_threadsafe(put_all, outputs)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass


def put_all(ready: list[tuple[Request, RequestOutput]]) -> None:
    """On the event loop: each output into its request's queue."""
    for request, output in ready:
        request.outputs.put_nowait(output)
