"""The engine: the stage's own model, a paged KV cache, and the streaming generation loop.

Stage 02's loop is unchanged in shape (prefill, then one decode step per token, yielding each token
as it is sampled), but the KV cache is no longer Hugging Face's per-request tensor. At start-up the
engine reserves one pool of blocks for every request it will ever serve; a request's cache is the
list of blocks in its block table, taken one at a time as it grows and all given back when it ends.
``AsyncEngine`` still runs one request at a time: the pool can hold many sequences, and stage 04
will use that to batch them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import closing
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from common.device import pick_device, pick_dtype
from common.trace import RequestTrace
from common.weights import resolve_model

from .attention import AttentionMetadata, use_triton
from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kv_cache import KVCache, budget_bytes
from .metrics import Metrics
from .model import LlamaForCausalLM
from .sampler import SamplingParams, compute_logprobs, make_generator, sample
from .sequence import Request, RequestOutput

log = logging.getLogger("llm-course")

WARM_UP_TOKENS = 256  # the start-up's extend step: a typical prompt, which the kernel's tiles are tuned on


class InvalidRequest(ValueError):
    """The engine cannot take this request (token ids outside the vocabulary, too long): a 400."""


class EngineStopped(RuntimeError):
    """The engine thread has exited: nothing it held or was sent will ever be served."""


@dataclass(frozen=True)
class KVBlockStats:
    total: int
    used: int
    free: int
    block_size: int


@dataclass(frozen=True)
class EngineStats:
    """The engine's load at one moment (``/health`` and ``/metrics`` read it)."""

    running: int
    waiting: int
    kv_blocks: KVBlockStats


class Engine:
    """One model, one KV-cache pool, one request at a time."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        model_dir = resolve_model(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=self.dtype, device=self.device)
        self.max_model_len: int = self.model.config.max_position_embeddings
        self.eos_token_ids = set(self.model.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        # The pool is allocated after the weights, so that on CUDA it takes a share of what they left.
        shape = self.model.config.cache_shape(config.block_size, self.dtype)
        budget = budget_bytes(self.device, config.kv_cache_mb, config.gpu_memory_utilization)
        self.kv_cache = KVCache.allocate(shape, budget, self.device)
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size)
        self.warm_up()

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole pool can hold: the most any one sequence can ever reach."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    def kv_blocks(self) -> KVBlockStats:
        blocks = self.block_manager
        return KVBlockStats(blocks.num_blocks, blocks.num_used, blocks.num_free, blocks.block_size)

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
        # A sequence that outgrew the whole pool could never run.
        if len(prompt_ids) + params.max_tokens > self.kv_capacity_tokens:
            raise InvalidRequest(f"{len(prompt_ids)} prompt + {params.max_tokens} new tokens exceed the "
                                 f"{self.kv_capacity_tokens} tokens of the KV cache")

    # --- the two phases -------------------------------------------------------------------
    def _tensor(self, values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _forward(self, token_ids: list[int], start: int, block_table: list[int]) -> torch.Tensor:
        """Run ``token_ids`` at positions ``start...`` of one sequence, whose first ``start`` tokens are
        in the cache already; write their K/V to the pool and return their hidden states."""
        end = start + len(token_ids)
        self.block_manager.grow(block_table, end)  # a new block only when the last one is full
        return self._run(token_ids, start, block_table, self.block_manager.slot_mapping(block_table, start, end))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the kernels now rather than in a user's request: a decode step and an extend step that
        read block 0 for every position and write nowhere (slot -1). The extend step is prompt-sized, since
        the Triton kernel's autotuner picks its tiles on that first call (the PyTorch reference compiles
        nothing, and two tokens do)."""
        block_size = self.block_manager.block_size
        extend_tokens = WARM_UP_TOKENS if use_triton(self.device) else 2
        for num_tokens in (1, min(extend_tokens, self.max_model_len)):
            self._run([0] * num_tokens, 0, [0] * -(-num_tokens // block_size), [-1] * num_tokens)

    def _run(self, token_ids: list[int], start: int, block_table: list[int], slot_mapping: list[int]) -> torch.Tensor:
        """One forward pass of one sequence's tokens at positions ``start...``; their hidden states."""
        end = start + len(token_ids)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping, torch.int64),
            query_start_loc=self._tensor([0, len(token_ids)]),  # one sequence in this stage
            query_lens=self._tensor([len(token_ids)]),
            seq_lens=self._tensor([end]),
            block_tables=self._tensor([block_table]),  # [1, num_blocks]
            max_query_len=len(token_ids),
            logits_indices=self._tensor([len(token_ids) - 1], torch.int64),
        )
        input_ids = self._tensor(token_ids, torch.int64)  # [T]
        positions = torch.arange(start, end, device=self.device)  # [T]
        return self.model(input_ids, positions, self.kv_cache, meta)  # [T, hidden]

    def prefill(self, prompt_ids: list[int], block_table: list[int],
                score_prompt: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the whole prompt at once, writing its K/V into the sequence's blocks.

        Returns the last position's logits, [V], which predict the first new token. Only with
        ``score_prompt`` (prompt logprobs) do the other T - 1 rows go through the output projection
        too, [T - 1, V]: separately, so that the last row's logits are the same either way.
        """
        hidden = self._forward(prompt_ids, 0, block_table)  # [T, hidden]
        prompt_logits = self.model.compute_logits(hidden[:-1]) if score_prompt else None
        return self.model.compute_logits(hidden[-1:])[0], prompt_logits

    def decode_one_token(self, token_id: int, position: int, block_table: list[int]) -> torch.Tensor:
        """Run one new token at ``position``, reading the cache through the block table; logits: [V]."""
        hidden = self._forward([token_id], position, block_table)  # [1, hidden]
        return self.model.compute_logits(hidden)[0]

    # --- the generation loop --------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 trace: RequestTrace | None = None) -> Iterator[RequestOutput]:
        """Prefill, then decode one token per step until EOS, a stop string or ``max_tokens``.

        Yields after every token. Whoever iterates may simply stop (a client went away): closing
        the generator runs the ``finally``, which hands the sequence's blocks back to the pool.
        """
        self.check_request(prompt_ids, params)
        generator = make_generator(params.seed, self.device)
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        output_ids: list[int] = []
        trace = trace or RequestTrace()  # spans, when the server runs with --trace
        block_table: list[int] = []
        try:
            with trace.span("prefill"):
                logits, prompt_logits = self.prefill(prompt_ids, block_table, params.prompt_logprobs is not None)
            prompt_logprobs = None  # paid for only when asked (echo): T - 1 more rows of logits
            if prompt_logits is not None:
                prompt_logprobs = compute_logprobs(prompt_logits, prompt_ids[1:], params.prompt_logprobs)
            if params.max_tokens == 0:  # only the prompt was to be scored (echo)
                yield RequestOutput(request_id, [], "", "length", len(prompt_ids), 0, [], prompt_logprobs)
                return
            while True:
                token_id = sample(logits, params, generator, output_ids)
                logprobs = None
                if params.logprobs is not None:
                    logprobs = compute_logprobs(logits[None], [token_id], params.logprobs)
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
                position = len(prompt_ids) + len(output_ids) - 1  # the sampled token's own position
                with trace.span("decode"):
                    logits = self.decode_one_token(token_id, position, block_table)
        finally:
            self.block_manager.free(block_table)


class AsyncEngine:
    """Runs ``Engine.generate`` on one thread, first come first served, for an asyncio server."""

    def __init__(self, engine: Engine, metrics: Metrics | None = None) -> None:
        self._engine = engine
        # What the server may read from any thread: fixed at start-up.
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.metrics = metrics or Metrics()
        self.kv_capacity_tokens = engine.kv_capacity_tokens
        self._kv_blocks = engine.kv_blocks()  # replaced by the engine thread, which alone changes the pool
        self.metrics.watch(self.stats)
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
        return EngineStats(int(value("llm_requests_running")), int(value("llm_requests_waiting")), self._kv_blocks)

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
                self._kv_blocks = self._engine.kv_blocks()  # its blocks are back in the pool
                with self._lock:
                    if request.state == "running":
                        request.state = "finished"
                    self.metrics.running.dec()

    def _serve(self, request: Request) -> None:
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        last_token_time = request.arrival_time
        # closing(): leaving early (an abort) closes the generator at once, so its blocks return now.
        outputs = self._engine.generate(request.request_id, request.prompt_ids, request.params, request.trace)
        with closing(outputs):
            for output in outputs:
                now = time.perf_counter()
                if output.completion_tokens == 1:
                    self.metrics.ttft.observe(now - request.arrival_time)
                else:
                    self.metrics.itl.observe(now - last_token_time)
                last_token_time = now
                self.metrics.generation_tokens.inc(len(output.token_ids))
                self._kv_blocks = self._engine.kv_blocks()
                self._deliver(request, output)
                if request.state == "aborted":
                    return  # leaving the ``with`` closes the generator, which frees the blocks

    def _fail(self, request: Request, error: Exception) -> None:
        self._deliver(request, RequestOutput.failed(request.request_id, error, len(request.prompt_ids)))

    @staticmethod
    def _deliver(request: Request, output: RequestOutput) -> None:
        """Hand an output to the request's asyncio queue from this (non-asyncio) thread."""
        try:
            request.loop.call_soon_threadsafe(request.outputs.put_nowait, output)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            request.state = "aborted"
