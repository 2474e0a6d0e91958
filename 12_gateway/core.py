"""The engine core: the step loop in a process of its own, taking and sending the typed messages of ``messages.py``.

A server's process does two kinds of work. The API side parses HTTP, tokenizes, streams SSE, and runs an event loop
that wakes for every client; the core schedules, launches steps and reads their tokens. In one process they share one
interpreter lock, so every client's chunk is time the core cannot launch the next step. Here the core runs alone:

    API process                                     core process (core_main)
    HTTP, tokenize, SSE  --AddRequest/AbortRequest-->   EngineCore.run: take messages, step, send news
    AsyncEngine's reader <------- StepNews ----------   (one message per turn, whatever the batch size)

Both directions go through one ``multiprocessing`` pipe, pickled; the messages are defined in ``messages.py``, which
the API process can import without the engine (unpickling a message imports its class's module). A turn sends one
``StepNews``: every output of the step it processed, the engine's stats snapshot, the turn's clock (for /metrics and
``--trace``) and the spans of the requests that are traced. One message per turn, never one per token: at 64
sequences a message per token would be 64 pickles, 64 system calls and 64 wake-ups of the reader.

The core knows nothing of HTTP or asyncio: requests are ids, prompts are token ids. When the API process goes away,
the core reads the end of the pipe and stops; when the core dies, the API process reads the end of the pipe and
fails what was in flight (``async_engine.py``). vLLM's ``EngineCore`` and mini-sglang's scheduler process are the
same split (over ZeroMQ sockets).
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

import torch

from common.device import DeviceUnavailable
from common.trace import NO_TRACE, RequestTrace, Span, StepClock

from .config import EngineConfig
from .distributed import RanksOutOfStep
from .engine import Engine
from .messages import (
    AddRequest,
    CoreInput,
    CoreOutput,
    EngineStopped,
    InvalidRequest,
    Ready,
    Shutdown,
    StartFailed,
    StepNews,
)
from .sequence import RequestOutput

log = logging.getLogger("llm-course")
RANK_CHECK_S = 1.0  # how often an idle core checks that its other ranks are alive


class EngineCore:
    """Owns the engine and one end of the pipe. ``run`` steps the engine while it has work and otherwise sleeps
    until a message comes; between two turns it takes every message already there (adds, aborts)."""

    def __init__(self, engine: Engine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.remaining: dict[str, set[int]] = {}  # request id -> its samples not finished yet
        self.traces: dict[str, RequestTrace] = {}  # traced requests' spans, sent and emptied each turn
        self.rejected: list[RequestOutput] = []  # refused at admission, sent with the next news
        self.prompt_tokens = 0

    def run(self) -> None:
        """Serve until Shutdown or the end of the pipe; then fail what is left and stop the other ranks."""
        stopped = EngineStopped("the engine stopped before this request finished")
        failed = True  # until the loop returns: a rank gone, a GPU failed, a bug
        try:
            self._loop()
            failed = False
        except EngineStopped as exc:  # the engine cannot go on (the GPU failed, a rank died): say why, stop
            log.error("%s", exc)
            stopped = exc
        finally:
            outputs = [RequestOutput.failed(request_id, stopped, 0) for request_id in self.remaining]
            for request_id in self.remaining:
                self.engine.abort(request_id)  # its blocks go back to the pool
            self.remaining.clear()
            self._send(StepNews(outputs, self.engine.stats()))
            self.conn.close()  # the API process reads the end of the pipe: nothing more comes
            self.engine.shutdown(graceful=not failed)  # the other ranks stop too

    def _loop(self) -> None:
        while self._take_messages(block=not self.engine.has_unfinished()):
            clock = StepClock()
            result = self.engine.step(clock)
            outputs = self.rejected + [output for output in result.outputs if self._keep(output)]
            news = StepNews(outputs, self.engine.stats(), self.prompt_tokens, clock, result.num_tokens,
                            result.num_decoding, result.accepted_lengths, self._new_spans(), result.device_seconds,
                            result.device_decoding)
            self.rejected, self.prompt_tokens = [], 0
            self._send(news)

    def _keep(self, output: RequestOutput) -> bool:
        """Count a sample's end; a failed sample ends its request (its other samples are dropped)."""
        if output.index not in self.remaining.get(output.request_id, ()):
            return False  # the request or this sample has ended: failed in this step, or dropped by the API process
        if output.error is not None:
            self.engine.abort(output.request_id)
            del self.remaining[output.request_id]
        elif output.finished:
            self._sample_done(output.request_id, output.index)
        return True

    def _sample_done(self, request_id: str, index: int) -> None:
        remaining = self.remaining[request_id]
        remaining.discard(index)
        if not remaining:
            del self.remaining[request_id]

    def _take_messages(self, block: bool) -> bool:
        """Apply every message that has come; False on Shutdown or when the API process is gone. Idle, wait for the
        first one, checking every second that the other ranks are still there (a dead one stops the engine)."""
        watch = self.engine.tp.size > 1
        while True:
            timeout = (RANK_CHECK_S if watch else None) if block else 0.0
            if not self.conn.poll(timeout):
                if block:  # idle: the time to check on the ranks
                    self.engine.check_ranks()
                    continue
                return True
            try:
                message: CoreInput = self.conn.recv()
            except EOFError:  # the API process has exited
                return False
            ### BEGIN SOLUTION 10.6
            if isinstance(message, Shutdown):
                return False
            if isinstance(message, AddRequest):
                self._add(message)
            elif message.index is None and message.request_id in self.remaining:  # its client has left
                del self.remaining[message.request_id]
                self.engine.abort(message.request_id)
            elif message.index in self.remaining.get(message.request_id, ()):  # a stop string ended this sample
                self._sample_done(message.request_id, message.index)
                self.engine.abort(message.request_id, message.index)
            ### END SOLUTION
            block = False  # after the first message, take only what is already there

    def _add(self, message: AddRequest) -> None:
        # A traced request's spans are recorded here (its trace has a tracer) and written by the API process.
        trace = RequestTrace(NO_TRACE, message.request_id) if message.traced else None
        try:
            self.engine.add_request(message.request_id, message.prompt_ids, message.params, trace, message.n)
        except InvalidRequest as exc:
            self.rejected.append(RequestOutput.failed(message.request_id, exc, len(message.prompt_ids)))
            return
        self.remaining[message.request_id] = set(range(message.n))
        self.prompt_tokens += len(message.prompt_ids)
        if trace is not None:
            self.traces[message.request_id] = trace

    def _new_spans(self) -> dict[str, list[Span]]:
        """The spans each traced request gained this turn, moved out of its trace; finished requests are let go."""
        spans = {}
        for request_id, trace in list(self.traces.items()):
            if trace.spans:
                spans[request_id], trace.spans = trace.spans, []
            if request_id not in self.remaining:
                del self.traces[request_id]
        return spans

    def _send(self, message: CoreOutput) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError):  # the API process has gone: nobody to tell
            pass


def core_main(config: EngineConfig, conn: Connection, threads: int | None = None) -> None:
    """The core process: build the engine (``threads`` PyTorch threads, if given), describe it, say Ready, run the
    loop. The engine is built and stepped on this process's main thread: one OpenMP pool, the one that computes."""
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        engine = Engine(config)
    except (DeviceUnavailable, ValueError, RanksOutOfStep) as exc:  # no such device, a bad budget or draft, a
        conn.send(StartFailed(str(exc)))  # --tensor-parallel-size that does not split the model, a rank that exited
        return
    describe(engine)
    conn.send(Ready(engine.max_model_len, engine.kv_capacity_tokens, engine.stats()))
    EngineCore(engine, conn).run()


def describe(engine: Engine) -> None:
    """What the engine holds and does: the model, the pool, the step, the caches, the ranks, graphs, speculation
    (the demo prints it, and a server's core process once it has built the engine)."""
    cache, config = engine.kv_cache, engine.config
    print(f"Loaded {config.model} on {engine.device} ({engine.dtype}), context {engine.max_model_len} tokens")
    print(f"KV cache: {cache.num_blocks} blocks x {config.block_size} tokens = {engine.kv_capacity_tokens} tokens, "
          f"{cache.num_bytes / 2**20:.0f} MiB ({cache.shape.bytes_per_token} bytes per token)")
    print(f"Steps: up to {config.max_num_seqs} sequences, {engine.max_num_batched_tokens} tokens (decodes and their "
          "guesses first, then prompt chunks)")
    print(f"Prefix cache: {config.prefix_cache}")
    memory = engine.stats().memory
    print(f"Weights: {memory.quantization}, {memory.weight_bytes / 2**20:.0f} MiB (in float: "
          f"{memory.unquantized_weight_bytes / 2**20:.0f} MiB); the KV cache {memory.kv_cache_bytes / 2**20:.0f} MiB")
    others = " (each of the others prints its own)" if engine.tp.size > 1 else ""
    group = " in a process group of one" if engine.tp.size == 1 and engine.tp.group is not None else ""
    print(f"Tensor parallel{group}: {engine.memory_report()}{others}")
    runner = engine.runner
    if runner.capture_seconds is not None:
        print(f"CUDA graphs: decode steps captured for batch sizes {runner.sizes}, steps with guesses for "
              f"{runner.verify_sizes} rows, in {runner.capture_seconds:.1f} s, holding "
              f"{runner.graph_memory_bytes / 2**20:.0f} MiB of the GPU")
    else:
        why = "--enforce-eager" if config.enforce_eager else "they need CUDA and the Triton kernels"
        print(f"CUDA graphs: off ({why}); steps run eagerly from static buffers: decodes in buckets {runner.sizes}, "
              f"steps with guesses in buckets of {runner.verify_sizes} rows")
    if config.speculative == "draft":
        draft, model = engine.proposer.model.config, engine.model.config
        source = config.draft_model or f"the model's first {draft.num_layers} of {model.num_layers} layers"
        print(f"Speculation: a draft model ({source}) guesses k = {config.num_speculative_tokens} tokens; its cache "
              f"{engine.draft_kv_cache.num_bytes / 2**20:.0f} MiB")
    elif config.speculative == "ngram":
        print(f"Speculation: n-gram prompt lookup guesses k = {config.num_speculative_tokens} tokens")
    else:
        print("Speculation: off")
    if config.disable_overlap:
        print("Overlap scheduling: off (--disable-overlap): each step's tokens are read before the next is scheduled")
    elif not engine.overlaps:
        print("Overlap scheduling: off on a CPU without --device-thread on: a launch computes the step, so step N's "
              "news would wait for step N + 1; each step's tokens are read before the next is launched")
    else:
        print("Overlap scheduling: step N + 1 is launched before step N's tokens are read; steps with guesses or "
              "penalties, or several ranks, wait for the step before")
