"""The API process's side of the engine core: it submits requests and aborts as messages through the core's pipe,
and a reader thread detokenizes each turn's news, applies the stop strings and hands the outputs to asyncio. The
core itself runs in its own process (``core.py``) and sends token ids only.

This module imports no engine: the messages come from ``messages.py``, the tokenizing from ``text.py``, and the
core's entry point (``run_core``) imports ``core.py`` only once it runs, in the child."""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from common.trace import NO_TRACE, RequestTrace, Tracer
from common.weights import load_tokenizer, resolve_model

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .messages import AbortRequest, AddRequest, CoreInput, EngineStopped, Ready, Shutdown, StartFailed, StepNews
from .metrics import Metrics
from .sampler import SamplingParams
from .sequence import Request, RequestOutput
from .stats import EngineStats
from .text import encode, encode_chat

log = logging.getLogger("llm-course")
STOP_S = 10.0  # how long stop() waits for the core to exit before it kills it


class CoreFailedToStart(RuntimeError):
    """The core process could not build the engine (the reason is its error's message)."""


class Core(Protocol):
    """What the API process holds of the running core: a server's is its child process (``multiprocessing``'s
    ``Process`` has all of this). A test that reaches into an engine it built runs the same loop on a thread of its
    own process instead (``tests/cores.py``), and hands it to ``AsyncEngine.attach``."""

    @property
    def exitcode(self) -> int | None: ...  # None while it runs (a thread has none)

    def join(self, timeout: float | None = None) -> None: ...

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...


def run_core(config: EngineConfig, conn: Connection, threads: int | None) -> None:
    """The core process's entry point. ``spawn`` pickles it by module and name and the child imports that module to
    find it: this one, which imports no engine. ``core.py``, and with it the engine, is imported here, in the child
    alone, when it runs."""
    from .core import core_main

    core_main(config, conn, threads)


class AsyncEngine:
    """The engine core's client, for asyncio: ``generate`` sends an ``AddRequest`` and reads the request's outputs
    from its own asyncio queue; ``stats()`` returns the snapshot that came with the core's last news.

    Given an ``EngineConfig`` (what a server does), the core is a child process that builds the engine: ``spawn``,
    not ``fork``, so that it starts without this process's threads (and on CUDA, without its CUDA state).
    ``attach`` takes a core started some other way: the end of its pipe and a handle to join it by.

    A turn's outputs cross to the event loop together, in one call: each crossing wakes the loop (a write to its
    self-pipe, a system call), so one per output would cost a batch of 64 sixty-four wake-ups.
    """

    def __init__(self, config: EngineConfig, metrics: Metrics | None = None, tracer: Tracer = NO_TRACE,
                 threads: int | None = None) -> None:
        tokenizer = load_tokenizer(resolve_model(config.model))
        conn, core_end = mp.Pipe()
        core = mp.get_context("spawn").Process(target=run_core, args=(config, core_end, threads), name="engine-core")
        core.start()  # not a daemon: with several ranks, the core starts their processes
        core_end.close()  # the child holds its end: when it exits, this side reads the end of the pipe
        self._connect(conn, core, tokenizer, metrics, tracer)
        atexit.register(self.stop)  # before multiprocessing's own exit handler waits for the child

    @classmethod
    def attach(cls, conn: Connection, core: Core, tokenizer: PreTrainedTokenizerBase, metrics: Metrics | None = None,
               tracer: Tracer = NO_TRACE) -> AsyncEngine:
        """The client of a core already running at the other end of ``conn``: it waits for the core's Ready, as a
        server's waits for its child's. (The tests run the loop on a thread, on an engine they built.)"""
        client = cls.__new__(cls)
        client._connect(conn, core, tokenizer, metrics, tracer)
        return client

    def _connect(self, conn: Connection, core: Core, tokenizer: PreTrainedTokenizerBase, metrics: Metrics | None,
                 tracer: Tracer) -> None:
        self._tracer = tracer  # with --trace, each turn's phases too
        self.metrics = metrics or Metrics()
        self.tokenizer = tokenizer
        self._conn, self._core = conn, core
        ready = self._wait_until_ready()
        # What the server may read from any thread: fixed at start-up.
        self.max_model_len = ready.max_model_len
        self.kv_capacity_tokens = ready.kv_capacity_tokens
        self._stats = self._counted = ready.stats  # replaced (never modified) by the reader thread
        self.metrics.watch(self.stats)
        self._reader = threading.Thread(target=self._read, name="core-reader", daemon=True)
        self._requests: dict[str, Request] = {}  # awaiting news; added under the lock, removed by the reader
        self._lock = threading.Lock()  # registering a request against the reader's last look
        self._send_lock = threading.Lock()  # one message at a time into the pipe
        self._stopped = False  # set under the lock when the core's pipe ends: submitting then fails fast
        self._next_id = 0
        self._num_steps = 0

    def _wait_until_ready(self) -> Ready:
        try:
            message = self._conn.recv()
        except EOFError:
            raise CoreFailedToStart(f"the engine core exited while starting (exit code {self._core_exitcode()})") \
                from None
        if isinstance(message, StartFailed):
            self._core.join()
            raise CoreFailedToStart(message.reason)
        assert isinstance(message, Ready), message
        return message

    def start(self) -> None:
        self._reader.start()

    def stop(self) -> None:
        """Ask the core to stop, wait for it (then kill it, if it does not), and for the last of its news. Safe to
        call twice (the server's shutdown, then the interpreter's exit)."""
        self._send(Shutdown())
        self._core.join(timeout=STOP_S)
        if self._core.is_alive():
            log.error("the engine core did not stop in %.0f s: killed", STOP_S)
            self._core.kill()
            self._core.join(timeout=STOP_S)  # a process killed is gone at once (a test's thread cannot be killed)
        if self._reader.is_alive():
            self._reader.join(timeout=STOP_S)
        else:  # never started (a server that never served): nothing reads the pipe
            self._conn.close()

    @property
    def alive(self) -> bool:
        """Serving: the core's pipe is open (the core has not exited, nor begun to stop)."""
        return self._reader.is_alive() and not self._stopped

    def stats(self) -> EngineStats:
        return self._stats

    def encode(self, prompt: str) -> list[int]:
        return encode(self.tokenizer, prompt)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    # --- the HTTP side (asyncio) ----------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, trace: RequestTrace | None = None,
                       n: int = 1) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as the core's news brings them.

        A failure arrives as an output with ``error`` set (the last one). If the consumer stops
        early (the client disconnected, the task was cancelled), the ``finally`` asks the core
        to drop the request, which frees its blocks.
        """
        self._next_id += 1
        request = Request(f"req-{self._next_id}", prompt_ids, params, loop=asyncio.get_running_loop(),
                          trace=trace or RequestTrace(), n=n,
                          detokenizers=[IncrementalDetokenizer(self.tokenizer, params.stop) for _ in range(n)])
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self._requests[request.request_id] = request  # before the add: its news may come at once
        if stopped:
            yield RequestOutput.failed(request.request_id, EngineStopped("the engine has stopped"), len(prompt_ids))
            return
        self._send(AddRequest(request.request_id, prompt_ids, params, n, request.trace.tracer is not None))
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
                with self._lock:
                    self._requests.pop(request.request_id, None)
                self._send(AbortRequest(request.request_id))

    def _send(self, message: CoreInput) -> None:
        """One message to the core (the event loop's adds and aborts, stop()'s Shutdown: one at a time). A large
        prompt may wait here for the core to finish its step and read the pipe."""
        with self._send_lock:
            try:
                self._conn.send(message)
            except OSError:  # the core has exited: the reader fails what was waiting
                pass

    # --- the reader thread ----------------------------------------------------------------
    def _read(self) -> None:
        """Hand each turn's news to the event loop until the core's end of the pipe closes: then fail, at once,
        whatever still waits (the core died, or stopped without answering it)."""
        try:
            while True:
                try:
                    news: StepNews = self._conn.recv()
                except (EOFError, OSError):
                    break
                self._take(news)
        finally:
            with self._lock:
                self._stopped = True
                waiting, self._requests = list(self._requests.values()), {}
            self._conn.close()
            if waiting:
                stopped = EngineStopped(f"the engine core exited (exit code {self._core_exitcode()})")
                deliver([(request, RequestOutput.failed(request.request_id, stopped, len(request.prompt_ids)))
                         for request in waiting])

    def _take(self, news: StepNews) -> None:
        """One turn's news: counters and the stats snapshot, the traced requests' spans, then each output
        detokenized (``detokenize``) and handed to its request's event loop, all in one call."""
        core_s = news.clock.last - news.clock.started if news.clock is not None else 0.0  # the turn in the core
        if news.clock is not None:
            news.clock.lap("handoff")  # pickled in the core, through the pipe, read here
        self.metrics.prompt_tokens.inc(news.prompt_tokens)
        self.metrics.count(self._counted, news.stats)  # the counters move before the new snapshot is published:
        self._stats = self._counted = news.stats  # whoever sees an idle engine sees its counters complete
        self.metrics.count_verifications(news.accepted_lengths)
        for request_id, spans in news.spans.items():  # a request's spans may come a turn before its output
            if (traced := self._requests.get(request_id)) is not None:
                traced.trace.spans.extend(spans)
        now = time.perf_counter()
        ready = []
        for output in news.outputs:
            if (request := self._requests.get(output.request_id)) is None:
                continue  # its client has left
            if output.error is None and request.detokenizers[output.index].stopped:
                continue  # a stop string ended this sample: what the core computed since is dropped
            output = self._detokenize(request, output)
            with self._lock:
                request.num_finished += output.finished
                if request.num_finished == request.n or output.error is not None:
                    self._requests.pop(output.request_id, None)
            if output.error is None:
                self._record(request, output, now)
            ready.append((request, output))
        if news.clock is not None and ready:
            news.clock.lap("detokenize")
        deliver(ready)
        self._observe(news, core_s)

    def _detokenize(self, request: Request, output: RequestOutput) -> RequestOutput:
        """``output`` with its text; cut at a stop string, which ends the sample here and is sent to the core as
        an abort of that sample. A failure to detokenize fails the request alone (and the core drops it)."""
        if output.error is not None:
            return output
        started = time.perf_counter()
        try:
            text_output = detokenize(request.detokenizers[output.index], output)
        except Exception as exc:
            self._abort_soon(request, AbortRequest(request.request_id))
            return RequestOutput.failed(request.request_id, exc, output.prompt_tokens, output.completion_tokens,
                                        output.index)
        request.trace.add("detokenize", started)
        if text_output.finished and not output.finished:
            self._abort_soon(request, AbortRequest(request.request_id, output.index))
        return text_output

    def _abort_soon(self, request: Request, abort: AbortRequest) -> None:
        """Have the event loop send ``abort``, ahead of the outputs this turn hands it. Not this thread: it must
        never wait on the pipe to the core, which may itself be waiting for this thread to read its news."""
        try:
            request.loop.call_soon_threadsafe(self._send, abort)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _observe(self, news: StepNews, core_s: float) -> None:
        """A turn's phases into /metrics (and --trace): the core's (the step it launched and the step before it that
        it processed; the last step's tokens are read in a turn that launches nothing), then this process's:
        ``handoff``, from the end of the turn in the core to its outputs handed to the event loop here (pickled,
        through the pipe, read: one clock, the machine's monotonic one, for both processes), and ``detokenize``.
        These two run while the core takes its next turn, so the core's busy time (``core_s``) leaves them out.
        An idle look at the scheduler is no step."""
        clock = news.clock
        if clock is None or (not news.num_tokens and not news.outputs):
            return
        clock.lap("handoff")
        self.metrics.engine_busy.inc(core_s)  # its rate: the core's busy fraction
        self.metrics.observe_step(clock.phases, news.device_seconds, news.device_decoding)
        self._num_steps += 1
        self._tracer.write_step(self._num_steps, clock, len(news.outputs), news.num_tokens, news.num_decoding)

    def _record(self, request: Request, output: RequestOutput, now: float) -> None:
        self.metrics.generation_tokens.inc(len(output.token_ids))
        if output.index != 0:
            return  # the latencies of a request with n samples: those of its first
        if output.completion_tokens == 1:
            self.metrics.ttft.observe(now - request.arrival_time)
        else:
            self.metrics.itl.observe(now - request.last_token_time)
        request.last_token_time = now

    def _core_exitcode(self) -> int | None:
        """The core process's exit code (a negative one: the signal that killed it); None for a thread."""
        self._core.join(timeout=1.0)  # its pipe has closed: it is exiting, if not gone
        return self._core.exitcode


def detokenize(detokenizer: IncrementalDetokenizer, output: RequestOutput) -> RequestOutput:
    """The text of a core output's tokens, safe to send: whole characters, a possible stop string held back. A
    stop string found in the text ends the sample there: the tokens after the one that completed it are neither
    sent nor counted, and the output finishes with ``"stop"`` (the core, which knows no text, has not finished it).
    At the sample's end (EOS, max_tokens) the rest of the text is flushed."""
    text, kept = "", 0
    for token_id in output.token_ids:
        kept += 1
        text += detokenizer.add(token_id)  # EOS and other special tokens add no text
        if detokenizer.stopped:
            dropped = len(output.token_ids) - kept
            return replace(output, token_ids=output.token_ids[:kept], text=text, finish_reason="stop",
                           completion_tokens=output.completion_tokens - dropped,
                           logprobs=None if output.logprobs is None else output.logprobs[:kept])
    if output.finished:
        text += detokenizer.flush()
    return replace(output, text=text)


def deliver(ready: list[tuple[Request, RequestOutput]]) -> None:
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
