"""The engine: a model and the generation loop, now yielding every token the moment it is sampled.

``Engine.generate`` is stage 01's loop turned into a generator: the caller gets each token
(with its safe-to-send text) before the next decode step starts. ``AsyncEngine`` runs that loop
on its own thread, one request at a time in arrival order, and hands tokens to the asyncio
event loop that serves HTTP, so the server stays responsive while the model computes.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import Cache

from .detokenizer import IncrementalDetokenizer
from .metrics import Metrics
from .sampler import SamplingParams, compute_logprobs, make_generator, sample
from .sequence import Request, RequestOutput


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """float32 on CPU (exact, and fast enough for a 135M model); bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


class Engine:
    """One model, one request at a time."""

    def __init__(self, model_dir: Path, device: str = "auto", dtype: str = "auto") -> None:
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
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
        input_ids = torch.tensor([[token_id]], device=self.device)  # [1, 1]
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        return out.logits[0, -1], out.past_key_values  # logits: [V]

    # --- the generation loop --------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Prefill, then decode one token per step until EOS, a stop string or ``max_tokens``.

        Yields after every token. Whoever iterates may simply stop (a client went away): the
        generator, and the KV cache it holds, is then dropped before the next decode step.
        """
        generator = make_generator(params.seed, self.device)
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        output_ids: list[int] = []

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
            logits, cache = self.decode_one_token(token_id, cache)


class EngineStopped(RuntimeError):
    """The engine thread has exited: nothing it held or was sent will ever be served."""


class AsyncEngine:
    """Runs ``Engine.generate`` on one thread, first come first served, for an asyncio server."""

    def __init__(self, engine: Engine, metrics: Metrics | None = None) -> None:
        self.engine = engine
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

    @property
    def load(self) -> dict[str, int]:
        """Requests being generated for and requests queued, as the metrics count them."""
        value = self.metrics.registry.get_sample_value
        return {"running": int(value("llm_requests_running")), "waiting": int(value("llm_requests_waiting"))}

    # --- the HTTP side (asyncio) ----------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as the engine thread produces them.

        If the consumer stops early (the client disconnected, the task was cancelled), the
        ``finally`` marks the request aborted and the engine thread drops it at its next step.
        """
        self._next_id += 1
        request = Request(f"req-{self._next_id}", prompt_ids, params, loop=asyncio.get_running_loop())
        with self._lock:
            if self._stopped:
                raise EngineStopped("the engine has stopped; the server must be restarted")
            self.metrics.waiting.inc()
            self._inbox.put(request)
        try:
            while True:
                output = await request.outputs.get()
                if isinstance(output, Exception):
                    raise output
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
        finally:  # a normal stop, or a bug that killed the thread: fail whatever is left at once
            with self._lock:
                self._stopped = True
            while not self._inbox.empty():
                if (request := self._inbox.get()) is not None and request.state == "waiting":
                    self._deliver(request, EngineStopped("the engine stopped before serving this request"))

    def _serve_in_order(self) -> None:
        while (request := self._inbox.get()) is not None:
            with self._lock:
                if request.state == "aborted":  # its client left while it waited
                    continue
                request.state = "running"
                self.metrics.waiting.dec()
                self.metrics.running.inc()
            try:
                self._serve(request)
            except Exception as exc:  # fail this request, keep serving the others
                self._deliver(request, exc)
            except BaseException:  # the thread itself is going down: say so, then go
                self._deliver(request, EngineStopped("the engine stopped while serving this request"))
                raise
            finally:
                with self._lock:
                    if request.state == "running":
                        request.state = "finished"
                    self.metrics.running.dec()

    def _serve(self, request: Request) -> None:
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        last_token_time = request.arrival_time
        for output in self.engine.generate(request.request_id, request.prompt_ids, request.params):
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

    @staticmethod
    def _deliver(request: Request, item: RequestOutput | Exception) -> None:
        """Hand an item to the request's asyncio queue from this (non-asyncio) thread."""
        try:
            request.loop.call_soon_threadsafe(request.outputs.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            request.state = "aborted"
