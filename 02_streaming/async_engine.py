"""The engine thread and its bridge to asyncio: the HTTP side submits requests and reads outputs, the
thread alone drives the engine."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

import torch

from common.trace import RequestTrace

from .engine import Engine, EngineStopped
from .metrics import Metrics
from .sampler import SamplingParams
from .sequence import Request, RequestOutput
from .stats import EngineStats

log = logging.getLogger("llm-course")


class AsyncEngine:
    """Runs ``Engine.generate`` on one thread, first come first served, for an asyncio server."""

    def __init__(self, engine: Engine, metrics: Metrics | None = None) -> None:
        self._engine = engine
        # What the server may read from any thread: fixed at start-up.
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.metrics = metrics or Metrics()
        self._inbox: queue.Queue[Request | None] = queue.Queue()  # None asks the thread to exit
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._lock = threading.Lock()  # guards request.state moves between the two threads
        self._stopped = False  # set under the lock when the thread exits: submitting then fails fast
        self._next_id = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        """Requests being generated for and requests queued, as the gauges count them (both threads move
        them, under the lock)."""
        value = self.metrics.registry.get_sample_value
        return EngineStats(int(value("llm_requests_running")), int(value("llm_requests_waiting")))

    def encode(self, prompt: str) -> list[int]:
        return self._engine.encode(prompt)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self._engine.encode_chat(messages)

    # --- the HTTP side (asyncio) ----------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       trace: RequestTrace | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as the engine thread produces them.

        A failure arrives as an output with ``error`` set (the last one). If the consumer stops early
        (the client disconnected, the task was cancelled), the ``finally`` marks the request aborted
        and the engine thread drops it at its next step.
        """
        self._next_id += 1
        request = Request(f"req-{self._next_id}", prompt_ids, params, loop=asyncio.get_running_loop(),
                          trace=trace or RequestTrace())
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self.metrics.waiting.inc()
                self._inbox.put(request)
        if stopped:
            yield RequestOutput.failed(request.request_id, EngineStopped("the engine has stopped"), len(prompt_ids))
            return
        try:
            while True:
                output = await request.outputs.get()
                yield output
                if output.finished:
                    return
        finally:
            self._abort(request)

    def _abort(self, request: Request) -> None:
        """Forget a request: at once if it still waits, at the engine's next step if it runs."""
        ### BEGIN SOLUTION 2.3
        with self._lock:
            if request.state == "waiting":
                self.metrics.waiting.dec()
            if request.state != "finished":
                request.state = "aborted"
        ### END SOLUTION

    # --- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve_in_order()
        except EngineStopped as exc:  # the engine cannot go on (the GPU failed): stop serving, and say why
            log.error("%s", exc)
        finally:  # a normal stop, or a bug that killed the thread: fail whatever is left at once
            with self._lock:
                self._stopped = True
            while not self._inbox.empty():
                if (request := self._inbox.get()) is not None and request.state == "waiting":
                    self._fail(request, EngineStopped("the engine stopped before serving this request"))

    def _serve_in_order(self) -> None:
        while (request := self._inbox.get()) is not None:
            with self._lock:
                if request.state == "aborted":  # its client left while it waited
                    continue
                request.state = "running"
                self.metrics.waiting.dec()
                self.metrics.running.inc()
            started = time.perf_counter()
            try:
                self._serve(request)
            except torch.AcceleratorError as exc:  # a CUDA error is sticky: every later request would fail too
                self._fail(request, EngineStopped(f"the GPU failed: {exc}"))
                raise EngineStopped(f"the GPU failed: {exc}") from exc
            except Exception as exc:  # fail this request, keep serving the others
                self._fail(request, exc)
            except BaseException:  # the thread itself is going down: say so, then go
                self._fail(request, EngineStopped("the engine stopped while serving this request"))
                raise
            finally:
                self.metrics.engine_busy.inc(time.perf_counter() - started)  # its rate: the busy fraction
                with self._lock:
                    if request.state == "running":
                        request.state = "finished"
                    self.metrics.running.dec()

    def _serve(self, request: Request) -> None:
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        last_token_time = request.arrival_time
        for output in self._engine.generate(request.request_id, request.prompt_ids, request.params, request.trace):
            now = time.perf_counter()
            if output.completion_tokens == 1:
                self.metrics.ttft.observe(now - request.arrival_time)
            else:
                self.metrics.itl.observe(now - last_token_time)
            last_token_time = now
            self.metrics.generation_tokens.inc()
            self._deliver(request, output)
            if request.state == "aborted":
                return  # leaving the loop drops the generator and its KV cache

    def _fail(self, request: Request, error: Exception) -> None:
        self._deliver(request, RequestOutput.failed(request.request_id, error, len(request.prompt_ids)))

    @staticmethod
    def _deliver(request: Request, output: RequestOutput) -> None:
        """Hand an output to the request's asyncio queue from this (non-asyncio) thread."""
        try:
            request.loop.call_soon_threadsafe(request.outputs.put_nowait, output)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            request.state = "aborted"
