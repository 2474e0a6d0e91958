"""The engine: a model and the generation loop, now yielding every token the moment it is sampled.

``Engine.generate`` is stage 01's loop turned into a generator: the caller gets each token
(with its safe-to-send text) before the next decode step starts. ``AsyncEngine`` runs that loop
on its own thread, one request at a time in arrival order, and hands tokens to the asyncio
event loop that serves HTTP, so the server stays responsive while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import Cache

from common.device import pick_device, pick_dtype
from common.trace import RequestTrace
from common.weights import resolve_model

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .metrics import Metrics
from .sampler import SamplingParams, compute_logprobs, make_generator, sample
from .sequence import Request, RequestOutput

log = logging.getLogger("llm-course")


class InvalidRequest(ValueError):
    """The engine cannot take this request (token ids outside the vocabulary, too long): a 400."""


class EngineStopped(RuntimeError):
    """The engine thread has exited: nothing it held or was sent will ever be served."""


@dataclass(frozen=True)
class EngineStats:
    """The engine's load at one moment (``/health`` reads it)."""

    running: int
    waiting: int


class Engine:
    """One model, one request at a time."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        model_dir = resolve_model(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=self.dtype, local_files_only=True
        ).to(self.device)
        self.model.eval()  # inference mode for every layer (no dropout)
        self.max_model_len: int = self.model.config.max_position_embeddings
        self.eos_token_ids = self._eos_token_ids()

    def _eos_token_ids(self) -> set[int]:
        """EOS ids from the generation config (may be a list) and the tokenizer."""
        ids = self.model.generation_config.eos_token_id
        eos = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return eos

    # --- text <-> token ids ---------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Render the conversation with the model's chat template, ready for the assistant's turn."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids  # the template has them

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse what would break the model, whoever calls it (the server checks too)."""
        vocab_size = self.model.config.vocab_size
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if bad := [i for i in [*prompt_ids, *params.logit_bias] if not 0 <= i < vocab_size]:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"{len(prompt_ids)} prompt + {params.max_tokens} new tokens exceed the context "
                                 f"length of {self.max_model_len}")

    # --- the two phases -------------------------------------------------------------------
    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, Cache]:
        """Run the whole prompt at once; return every position's logits and the filled cache.

        Hugging Face computes logits for all T positions: the last predicts the first new token, the
        others are what prompt logprobs (``echo``) score.
        """
        input_ids = torch.tensor([prompt_ids], device=self.device)  # [1, T]
        out = self.model(input_ids=input_ids, use_cache=True)
        return out.logits[0], out.past_key_values  # logits: [T, V]

    def decode_one_token(self, token_id: int, cache: Cache) -> tuple[torch.Tensor, Cache]:
        """Run one new token against the cache; the cache grows by one position per layer."""
        ### BEGIN SOLUTION 1.3
        input_ids = torch.tensor([[token_id]], device=self.device)  # [1, 1]
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        return out.logits[0, -1], out.past_key_values  # logits: [V]
        ### END SOLUTION

    # --- the generation loop --------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 trace: RequestTrace | None = None) -> Iterator[RequestOutput]:
        """Prefill, then decode one token per step until EOS, a stop string or ``max_tokens``.

        Yields after every token. Whoever iterates may simply stop (a client went away): the
        generator, and the KV cache it holds, is then dropped before the next decode step.
        """
        self.check_request(prompt_ids, params)
        generator = make_generator(params.seed, self.device)
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        output_ids: list[int] = []
        trace = trace or RequestTrace()  # spans, when the server runs with --trace

        with trace.span("prefill"):
            all_logits, cache = self.prefill(prompt_ids)
        logits = all_logits[-1]  # [V]: predicts the first new token
        prompt_logprobs = None  # paid for only when asked: scoring T positions costs T log-softmaxes
        if params.prompt_logprobs is not None:
            prompt_logprobs = compute_logprobs(all_logits[:-1], prompt_ids[1:], params.prompt_logprobs)
        if params.max_tokens == 0:  # only the prompt was to be scored (echo)
            yield RequestOutput(request_id, [], "", "length", len(prompt_ids), 0, [], prompt_logprobs)
            return
        while True:
            token_id = sample(logits, params, generator, output_ids)
            logprobs = None if params.logprobs is None else compute_logprobs(logits[None], [token_id], params.logprobs)
            output_ids.append(token_id)
            finish_reason = None
            with trace.span("detokenize"):  # the text of the token, and the stop checks
                if token_id in self.eos_token_ids and not params.ignore_eos:
                    text, finish_reason = detokenizer.flush(), "stop"
                else:
                    text = detokenizer.add(token_id)
                    if detokenizer.stopped:
                        finish_reason = "stop"
                    elif len(output_ids) == params.max_tokens:
                        text, finish_reason = text + detokenizer.flush(), "length"
            yield RequestOutput(request_id, [token_id], text, finish_reason, len(prompt_ids), len(output_ids),
                                logprobs, prompt_logprobs)
            if finish_reason is not None:
                return
            prompt_logprobs = None  # the first output carries them
            with trace.span("decode"):
                logits, cache = self.decode_one_token(token_id, cache)


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
