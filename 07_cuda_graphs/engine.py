"""The engine: one step at a time within a token budget, every request in flight batched into each pass.

Each ``step`` is the same four calls: the scheduler picks the sequences that take part and how many
tokens each (``schedule``: one for every decoding sequence, then chunks of prompts, within the step's
token budget); the executor (``executor.py``) lays them out as one flat batch and runs the model
(``launch``), and the scheduler counts the step's tokens as computed; the step is read back once
(``read``: the next token of every sequence whose step reaches its last token); and the scheduler
appends the new ones, finishes the sequences that are done and frees their blocks (``postprocess``). A
request that arrives mid-way joins at the next step; a long prompt is computed a chunk per step,
alongside everyone else's decodes.

``Engine`` is the synchronous core (``add_request``, ``step``, ``abort``); ``AsyncEngine``
(``async_engine.py``) runs its step loop on a thread for the asyncio server.
"""

from __future__ import annotations

import torch

from common.device import pick_device, pick_dtype
from common.trace import RequestTrace, StepClock
from common.weights import load_tokenizer, resolve_model

from .block_manager import BlockManager
from .config import CPU_TOKEN_BUDGET, CUDA_TOKEN_BUDGET, EngineConfig
from .detokenizer import IncrementalDetokenizer
from .executor import Executor
from .model import LlamaForCausalLM
from .model_runner import start_runner
from .prefix_index import HashIndex, PrefixIndex
from .radix_tree import RadixTree
from .sampler import SamplingParams, make_generator
from .scheduler import Scheduler
from .sequence import Sequence, StepResult
from .stats import EngineStats, KVBlockStats, PrefixCacheStats


class InvalidRequest(ValueError):
    """The engine cannot take this request (token ids outside the vocabulary, too long): a 400."""


class EngineStopped(RuntimeError):
    """The engine thread has exited: nothing it held or was sent will ever be served."""


def make_index(kind: str, block_size: int) -> PrefixIndex | None:
    """The prefix cache's index (``--prefix-cache``): the hash chain, the radix tree, or none."""
    indexes: dict[str, type[HashIndex] | type[RadixTree]] = {"hash": HashIndex, "radix": RadixTree}
    return indexes[kind](block_size) if kind != "off" else None


def token_budget(config: EngineConfig, device: torch.device) -> int:
    """The step's token budget: ``--max-num-batched-tokens``, or the device's default. Every running sequence
    decodes in every step, so the budget must hold ``max_num_seqs`` tokens at least."""
    budget = config.max_num_batched_tokens or (CUDA_TOKEN_BUDGET if device.type == "cuda" else CPU_TOKEN_BUDGET)
    if budget < config.max_num_seqs:
        raise ValueError(f"--max-num-batched-tokens {budget} is below --max-num-seqs {config.max_num_seqs}: every "
                         "running sequence decodes in every step, so the budget must be at least max_num_seqs")
    return budget


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample ``index``'s own seed, derived from the request's: sample 0 draws what ``n`` = 1 would, and every
    sample of a seeded request is reproducible. (A step of 2**64 / golden ratio spreads the seeds apart.)"""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % 2**64


class Engine:
    """One model, one KV-cache pool, and a scheduler that batches every request it holds."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.max_num_batched_tokens = token_budget(config, self.device)  # checked before the weights are loaded
        model_dir = resolve_model(config.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=self.dtype, device=self.device)
        self.max_model_len: int = self.model.config.max_position_embeddings
        self.eos_token_ids = set(self.model.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.runner = start_runner(config, self.model, self.device, self.max_num_batched_tokens)
        self.kv_cache = self.runner.kv_cache
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size,
                                          make_index(config.prefix_cache, config.block_size))
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                   self.eos_token_ids)
        self.executor = Executor(self.runner)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole pool can hold: the most any one sequence can ever reach."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    def stats(self) -> EngineStats:
        blocks, scheduler = self.block_manager, self.scheduler
        return EngineStats(len(scheduler.running), len(scheduler.waiting),
                           KVBlockStats(blocks.num_blocks, blocks.num_used, blocks.num_evictable, blocks.num_free,
                                        blocks.num_cached, blocks.block_size),
                           scheduler.num_preemptions,
                           PrefixCacheStats(scheduler.prefix_cache_queries, scheduler.prefix_cache_hits))

    # --- text <-> token ids ---------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Render the conversation with the model's chat template, ready for the assistant's turn."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids  # the template has them

    # --- requests in and out --------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse what would break the engine, whoever calls it: the server checks too, but on CUDA an
        index out of range is a device-side assert that takes every later batch down with it."""
        vocab_size = self.model.config.vocab_size
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if bad := [i for i in [*prompt_ids, *params.logit_bias] if not 0 <= i < vocab_size]:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"{len(prompt_ids)} prompt + {params.max_tokens} new tokens exceed the context "
                                 f"length of {self.max_model_len}")
        # A sequence that outgrew the whole pool could never run, even alone.
        if len(prompt_ids) + params.max_tokens > self.kv_capacity_tokens:
            raise InvalidRequest(f"{len(prompt_ids)} prompt + {params.max_tokens} new tokens exceed the "
                                 f"{self.kv_capacity_tokens} tokens of the KV cache")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    trace: RequestTrace | None = None, n: int = 1) -> None:
        """Queue a request for ``n`` samples; it joins the batch at a coming step. Raises InvalidRequest if it
        cannot run.

        Sample 0 is queued now. The other samples start after its prefill (the scheduler's ``_fork``): by then
        the prompt's full blocks are in the prefix cache, and each sample computes only the prompt's last block."""
        assert n >= 1 and not (n > 1 and params.prompt_logprobs is not None), "prompt logprobs are scored once"
        self.check_request(prompt_ids, params)
        samples = [Sequence(request_id, list(prompt_ids), params, make_generator(sample_seed(params.seed, i),
                                                                                 self.device),
                            IncrementalDetokenizer(self.tokenizer, params.stop), trace=trace or RequestTrace(), index=i)
                   for i in range(n)]
        samples[0].forks = samples[1:]
        self.scheduler.add(samples[0])

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is (its client left); its blocks return to the pool now."""
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step -------------------------------------------------------------------------
    def step(self, clock: StepClock | None = None) -> StepResult:
        """One iteration, four calls: ``schedule`` (who runs, and how many tokens each), ``executor.launch``
        (prepare, run the model; the scheduler then counts the step as run), ``InFlight.read`` (the one wait: sample
        on the logits, each sequence's next token on the host) and ``scheduler.postprocess`` (append each new token,
        finish and free). Returns the output of every sequence that has news (a chunk that ends part-way through its
        prompt has none).

        ``clock`` times each phase (the server's /metrics and --trace show them). On a GPU the forward pass
        runs asynchronously: ``execute`` only launches it, and its time shows in ``sample``, the first phase
        that waits for its result."""
        clock = clock or StepClock()
        batch = self.scheduler.schedule()
        clock.lap("schedule")
        if not batch.seqs:
            return StepResult([])
        num_tokens = batch.num_tokens
        try:
            flight = self.executor.launch(batch, clock)
            self.scheduler.launched(batch)
            sampled = flight.read(clock)
        except Exception as exc:  # one pass for the whole batch: all of it fails (their caches are half written)
            if isinstance(exc, torch.AcceleratorError):
                # A CUDA error (a device-side assert, say) is sticky: every later kernel on this GPU fails
                # too. Failing this batch and going on would fail every batch after it, so the engine
                # stops, and the server says so (503) instead of answering each request with a 500.
                raise EngineStopped(f"the GPU failed: {exc}") from exc
            return StepResult([self.scheduler.fail(seq, exc) for seq in batch.seqs], num_tokens)
        for seq, kind in zip(batch.seqs, flight.kinds, strict=True):  # the whole step: each waited for all of it
            seq.trace.add(kind, clock.started, clock.last)
        return StepResult(self.scheduler.postprocess(batch, sampled, clock), num_tokens,
                          num_decoding=flight.kinds.count("decode"))

    def generate_offline(self, prompts: list[list[int]],
                         params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline use (the demo, the tests): run every prompt to the end, all batched; their output ids. (The
        server streams through ``AsyncEngine.generate`` instead.)"""
        params = params if isinstance(params, list) else [params] * len(prompts)
        outputs: dict[str, list[int]] = {}
        for i, (prompt_ids, p) in enumerate(zip(prompts, params, strict=True)):
            self.add_request(f"offline-{i}", prompt_ids, p)
            outputs[f"offline-{i}"] = []
        while self.has_unfinished():
            for output in self.step().outputs:
                if output.error is not None:
                    raise output.error
                outputs[output.request_id].extend(output.token_ids)
        return list(outputs.values())
