"""The engine: continuous batching, each step within a token budget. Many requests share every forward pass.

Stage 03 ran one request's whole generation before looking at the next. Here the engine runs
*steps*: before each forward pass the scheduler decides which sequences take part and how many
tokens each (one for every decoding sequence, then chunks of prompts, within the step's token
budget), the model runner builds one flat batch from them, the sampler picks the next token of
every sequence whose known tokens are now all computed, and finished sequences leave and free their
blocks. A request that arrives mid-way joins at the next step; a long prompt is computed a chunk per
step, alongside everyone else's decodes (new in stage 06).

New in stage 08: a decoding sequence may also bring guesses of its next tokens (``proposer.py``). The
scheduler reserves room for them, the proposer fills it, the model runs the last token and the guesses
in one pass, and verification (``speculative.py``) keeps the longest run the model agrees with, plus
one token of its own: 1 to k + 1 tokens per sequence and step, exactly those it would have produced
one by one. The rejected guesses' blocks go back to the pool.

New in stage 09: the model may be split across N processes (``--tensor-parallel-size``). This engine is
rank 0: it starts the other ranks (``run_worker``), and every rank builds the same engine, step for step,
so that their start-up collectives line up (the number of KV blocks is the smallest any rank can hold).
Then only rank 0 schedules; the others run the forward pass of each step it sends them. A rank that dies,
or a step that fails on one, stops the engine (the ranks can no longer be in step) and every rank.

``Engine`` is the synchronous core (``add_request``, ``step``, ``abort``). ``AsyncEngine`` runs its
step loop on a thread for the asyncio server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch
from transformers import AutoTokenizer

from common.device import keep_freed_memory, pick_device, pick_dtype
from common.trace import RequestTrace
from common.weights import resolve_model

from .attention import use_triton
from .block_manager import BlockManager
from .config import CPU_TOKEN_BUDGET, CUDA_TOKEN_BUDGET, EngineConfig
from .detokenizer import IncrementalDetokenizer
from .distributed import (
    SINGLE,
    RanksOutOfStep,
    TPGroup,
    device_of,
    exit_with_parent,
    join,
    spawn_workers,
    stop_workers,
    under_torchrun,
)
from .kv_cache import KVCache, budget_bytes
from .metrics import Metrics
from .model import LlamaForCausalLM, ModelConfig
from .model_runner import ModelRunner, StepInput
from .prefix_index import HashIndex, PrefixIndex
from .proposer import DraftProposer, NgramProposer, layer_skip_draft, load_draft
from .radix_tree import RadixTree
from .sampler import SamplingParams, TokenLogprobs, compute_logprobs, make_generator
from .scheduler import Scheduler
from .sequence import Request, RequestOutput, Sequence
from .speculative import Speculation, verify

log = logging.getLogger("llm-course")


class InvalidRequest(ValueError):
    """The engine cannot take this request (token ids outside the vocabulary, too long): a 400."""


class EngineStopped(RuntimeError):
    """The engine thread has exited: nothing it held or was sent will ever be served."""


@dataclass(frozen=True)
class KVBlockStats:
    total: int
    used: int  # held by at least one sequence
    evictable: int  # held by none, still findable in the prefix cache
    free: int
    cached: int  # in the prefix cache: shared, or evictable
    block_size: int


@dataclass(frozen=True)
class PrefixCacheStats:
    queries: int  # prompt tokens looked up at admission
    hits: int  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class SpeculationStats:
    proposed: int  # guesses checked
    accepted: int  # of those, kept
    runs: int  # verifications: (sequence, step) pairs that brought at least one guess

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Guesses kept per verification; each also emits one token of the model's own."""
        return self.accepted / self.runs if self.runs else 0.0


@dataclass(frozen=True)
class EngineStats:
    """The engine's load at one moment, taken on the engine thread (``/health`` and ``/metrics`` read it)."""

    running: int
    waiting: int
    kv_blocks: KVBlockStats
    prefix_cache: PrefixCacheStats
    speculation: SpeculationStats


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


def check_tensor_parallel(config: EngineConfig, model: ModelConfig) -> None:
    """Refuse, before any process starts, what tensor parallelism cannot run."""
    model.check_tensor_parallel_size(config.tensor_parallel_size)
    if config.tensor_parallel_size > 1 and config.speculative == "draft":
        raise ValueError("--speculative draft: the draft model would run on rank 0 alone beside a split model; "
                         "with --tensor-parallel-size above 1, use --speculative ngram or off")


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample ``index``'s own seed, derived from the request's: sample 0 draws what ``n`` = 1 would, and every
    sample of a seeded request is reproducible. (A step of 2**64 / golden ratio spreads the seeds apart.)"""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % 2**64


class Engine:
    """One model, one KV-cache pool, and a scheduler that batches every request it holds.

    With tensor parallelism, each rank's engine holds its slices of the model and of the pool; ``tp`` is
    given to ranks > 0 (``run_worker``), while rank 0 starts the ranks itself (``start_ranks``)."""

    def __init__(self, config: EngineConfig, tp: TPGroup | None = None) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.max_num_batched_tokens = token_budget(config, self.device)  # checked before the weights are loaded
        model_dir = resolve_model(config.model)
        check_tensor_parallel(config, ModelConfig.from_pretrained(model_dir))  # before any process starts
        self.workers: list[BaseProcess] = []  # ranks 1 .. N-1, when this engine started them (not under torchrun)
        self.tp = tp if tp is not None else self.start_ranks(config)
        self.device = device_of(self.device, self.tp)  # on CUDA each rank its own GPU
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=self.dtype, device=self.device, tp=self.tp)
        self.max_model_len: int = self.model.config.max_position_embeddings
        self.eos_token_ids = set(self.model.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        # The pool is allocated after the weights, so that on CUDA it takes a share of what they left.
        shape = self.model.config.cache_shape(config.block_size, self.dtype, self.tp.size)  # this rank's KV heads
        if self.device.type == "cuda":  # what the largest step's activations take, before the pool takes the rest
            self.run_dummy_step(min(self.max_num_batched_tokens, self.max_model_len),
                                KVCache.allocate(shape, shape.bytes_per_block, self.device))
        if self.device.type == "cpu":  # attention's gathers allocate tens of MB per layer and step: keep them
            keep_freed_memory()
        draft = self.make_draft(config)  # before the budget: a separate draft's weights are not the pool's to take
        budget = budget_bytes(self.device, config.kv_cache_mb, config.gpu_memory_utilization)
        # A draft model keeps its own K/V in a second pool of as many blocks: the budget pays for both.
        draft_shape = draft.config.cache_shape(config.block_size, self.dtype) if draft is not None else None
        num_blocks = budget // (shape.bytes_per_block + (draft_shape.bytes_per_block if draft_shape else 0))
        num_blocks = self.tp.min(num_blocks)  # one block table serves every rank: each must have every block
        self.kv_cache = KVCache.allocate(shape, num_blocks * shape.bytes_per_block, self.device)
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size,
                                          make_index(config.prefix_cache, config.block_size))
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager, self.device, config.max_num_seqs,
                                  self.max_model_len)
        self.proposer: NgramProposer | DraftProposer | None = None
        if config.speculative == "ngram":
            self.proposer = NgramProposer()
        elif draft is not None:
            self.draft_kv_cache = KVCache.allocate(draft_shape, num_blocks * draft_shape.bytes_per_block, self.device)
            self.proposer = DraftProposer(draft, self.draft_kv_cache, self.block_manager, self.device,
                                          config.max_num_seqs, self.max_model_len, self.max_num_batched_tokens)
        self.speculation = SpeculationStats(0, 0, 0)
        self.accepted_lengths: list[int] = []  # the last step's: guesses kept per verification
        self.sequences: dict[str, list[Sequence]] = {}  # every unfinished request's samples, by request id
        # Warm up: compile every kernel now (a decode step and an extend step), not in a user's request.
        for num_tokens in (1, 2):
            self.run_dummy_step(num_tokens, self.kv_cache)
        self.capture_seconds: float | None = None  # how long capturing the graphs took; None: not captured
        self.graph_memory_bytes = 0  # what the captured graphs hold on the GPU
        if self.device.type == "cuda" and use_triton(self.device) and not config.enforce_eager:
            self.capture_seconds, self.graph_memory_bytes = self.runner.capture()
            log.info("captured the decode step for batch sizes %s in %.1f s (%.0f MiB)", self.runner.sizes,
                     self.capture_seconds, self.graph_memory_bytes / 2**20)

    def start_ranks(self, config: EngineConfig) -> TPGroup:
        """Rank 0: start ranks 1 .. N-1 and join them in one process group (under torchrun, they were started
        with this process, and env:// says where to meet). One rank: no processes, no group."""
        if under_torchrun():
            size = int(os.environ["WORLD_SIZE"])
            if size != config.tensor_parallel_size:
                raise ValueError(f"torchrun started {size} processes: pass --tensor-parallel-size {size}")
            return join(int(os.environ["RANK"]), size, "env://", self.device, config.dist_timeout,
                        local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        if config.tensor_parallel_size == 1:
            return SINGLE
        init_method, self.workers = spawn_workers(config.tensor_parallel_size, run_worker, (config,))
        return join(0, config.tensor_parallel_size, init_method, self.device, config.dist_timeout)

    def check_ranks(self) -> None:
        """Rank 0: raise EngineStopped if a rank it started has exited (torchrun watches its own ranks)."""
        for rank, worker in enumerate(self.workers, start=1):
            if not worker.is_alive():
                raise EngineStopped(f"tensor-parallel rank {rank} exited (exit code {worker.exitcode})")

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every other rank and leave none behind: ``graceful``, tell them and give them time to leave;
        after a failure (the ranks out of step, one gone or stuck), terminate them at once."""
        if self.tp.size == 1 or self.tp.rank != 0:
            return
        if graceful and all(worker.is_alive() for worker in self.workers):
            try:
                self.tp.broadcast(None)  # serve() returns on every rank
            except Exception as exc:  # a rank is gone: there is nobody left to tell
                log.warning("could not tell the other ranks to stop: %s", exc)
        stop_workers(self.workers, timeout_s=10.0 if graceful else 0.0)
        self.tp.close()
        self.tp = SINGLE  # once only

    def memory_report(self) -> str:
        return (f"rank {self.tp.rank} of {self.tp.size}: weights {self.model.num_weight_bytes / 2**20:.1f} MiB, "
                f"KV cache {self.kv_cache.num_bytes / 2**20:.1f} MiB ({self.kv_cache.num_blocks} blocks of "
                f"{self.kv_cache.shape.num_kv_heads} KV heads)")

    def make_draft(self, config: EngineConfig) -> LlamaForCausalLM | None:
        """The draft model of ``--speculative draft``: a local folder's, or the model's own first layers."""
        if config.num_speculative_tokens < 0:
            raise ValueError(f"--num-speculative-tokens {config.num_speculative_tokens}: it must be 0 or more")
        if config.speculative != "draft":
            return None
        if config.draft_model:
            return load_draft(str(resolve_model(config.draft_model)), self.model, self.tokenizer.get_vocab(),
                              self.dtype, self.device)
        num_layers = config.draft_layers or max(1, self.model.config.num_layers // 3)
        if not 1 <= num_layers <= self.model.config.num_layers:
            raise ValueError(f"--draft-layers {num_layers}: the model has {self.model.config.num_layers} layers")
        return layer_skip_draft(self.model, num_layers)

    def run_dummy_step(self, num_tokens: int, kv_cache: KVCache) -> None:
        """One forward pass of ``num_tokens`` tokens of one sequence that writes nothing (slot -1) and reads
        block 0 for every position: to compile the kernels, and to measure the activations' peak."""
        step = StepInput(input_ids=[0] * num_tokens, positions=list(range(num_tokens)),
                         slot_mapping=[-1] * num_tokens, query_start_loc=[0, num_tokens], seq_lens=[num_tokens],
                         block_tables=[[0] * -(-num_tokens // kv_cache.shape.block_size)],
                         logits_indices=[num_tokens - 1], prompt_logits_indices=[], num_prompt_logits=[0])
        ModelRunner(self.model, kv_cache, BlockManager(kv_cache.num_blocks, kv_cache.shape.block_size),
                    self.device, self.config.max_num_seqs, self.max_model_len).execute(step)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole pool can hold: the most any one sequence can ever reach."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    def stats(self) -> EngineStats:
        blocks, scheduler = self.block_manager, self.scheduler
        return EngineStats(len(scheduler.running), len(scheduler.waiting),
                           KVBlockStats(blocks.num_blocks, blocks.num_used, blocks.num_evictable, blocks.num_free,
                                        blocks.num_cached, blocks.block_size),
                           PrefixCacheStats(scheduler.prefix_cache_queries, scheduler.prefix_cache_hits),
                           self.speculation)

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

        Sample 0 is queued now. The other samples start after its prefill (``_fork``): by then the prompt's
        full blocks are in the prefix cache, and each sample computes only the prompt's last block itself."""
        assert request_id not in self.sequences, f"duplicate request id {request_id}"
        assert n >= 1 and not (n > 1 and params.prompt_logprobs is not None), "prompt logprobs are scored once"
        self.check_request(prompt_ids, params)
        samples = [Sequence(request_id, list(prompt_ids), params, make_generator(sample_seed(params.seed, i),
                                                                                 self.device),
                            IncrementalDetokenizer(self.tokenizer, params.stop), trace=trace or RequestTrace(), index=i)
                   for i in range(n)]
        k = self.config.num_speculative_tokens if self.proposer is not None else 0
        for sample in samples:
            sample.speculation = Speculation(k)
        samples[0].forks = samples[1:]
        self.sequences[request_id] = samples[:1]
        self.scheduler.add(samples[0])

    def _fork(self, seq: Sequence) -> None:
        """Its prefill is done: queue the request's other samples, first in line, to share its prompt blocks."""
        self.sequences[seq.request_id] += seq.forks
        for fork in reversed(seq.forks):
            self.scheduler.add(fork, first=True)
        seq.forks = []

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is (its client left); its blocks return to the pool now."""
        for seq in list(self.sequences.get(request_id, [])):
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        """A sequence is done (finished, failed or dropped): it leaves the engine, its blocks return."""
        samples = self.sequences[seq.request_id]
        samples.remove(seq)
        if not samples:
            del self.sequences[seq.request_id]
        seq.forks = []  # samples never started (it failed or was aborted before its prefill) go with it
        self.scheduler.finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, let the proposer guess, run one forward pass for the whole batch, verify and sample, and
        report the new tokens of every sequence that has some (a mid-prompt chunk has none)."""
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        self.accepted_lengths = []
        try:
            self._propose([seq for seq in batch.seqs if seq.num_lookahead_slots])
            step = self.runner.prepare(batch)
            logits, prompt_logits = self.runner.execute(step)  # [R, V]: 1 + k rows per sampling sequence; [M, V]
            scored = prompt_logits.split(step.num_prompt_logits) if prompt_logits is not None else None
            kinds = ["decode" if seq.output_ids and seq.num_new_tokens == 1 else "prefill" for seq in batch.seqs]
            for i, seq in enumerate(batch.seqs):
                if scored is not None and step.num_prompt_logits[i]:
                    self._score_prompt(seq, scored[i])
            sampling = [seq for seq in batch.seqs if seq.samples_next_token]  # [S]; none when only mid-prompt chunks
            runs = verify(logits, [seq.params for seq in sampling], [seq.draft_ids for seq in sampling],
                          [seq.draft_probs for seq in sampling], [seq.output_ids for seq in sampling],
                          [seq.generator for seq in sampling]) if sampling else []
            logprobs = self._logprobs(logits, sampling, runs)
            accepted = {id(seq): run[:-1] for seq, run in zip(sampling, runs, strict=True)}
            for seq in batch.seqs:
                self._advance(seq, accepted.get(id(seq), []))
        except Exception as exc:  # one pass for the whole batch: all of it fails (their caches are half written)
            if isinstance(exc, RanksOutOfStep):  # stage 09: a rank died, or failed mid-step
                self.check_ranks()  # the better message, when a process is gone
                raise EngineStopped(f"the tensor-parallel ranks are out of step: {exc}") from exc
            if isinstance(exc, torch.AcceleratorError):
                # A CUDA error (a device-side assert, say) is sticky: every later kernel on this GPU fails
                # too. Failing this batch and going on would fail every batch after it, so the engine
                # stops, and the server says so (503) instead of answering each request with a 500.
                raise EngineStopped(f"the GPU failed: {exc}") from exc
            return [self._fail(seq, exc) for seq in batch.seqs]
        ended = time.perf_counter()
        for seq, kind in zip(batch.seqs, kinds, strict=True):  # the whole step: each waited for all of the batch
            seq.trace.add(kind, started, ended)
        outputs = []
        for seq, run, run_logprobs in zip(sampling, runs, logprobs, strict=True):
            try:
                with seq.trace.span("detokenize"):
                    outputs.append(self._append(seq, run, run_logprobs))
            except Exception as exc:  # this sequence's own work (its text, its stop strings): only it fails
                outputs.append(self._fail(seq, exc))
        return outputs

    def _propose(self, seqs: list[Sequence]) -> None:
        """New in stage 08: the sequences the scheduler reserved room for get up to that many guesses each."""
        if not seqs:
            return
        assert self.proposer is not None, "room for guesses, and nobody to guess"
        proposals = self.proposer.propose(seqs, [seq.num_lookahead_slots for seq in seqs])
        for seq, proposal in zip(seqs, proposals, strict=True):
            assert len(proposal.token_ids) <= seq.num_lookahead_slots
            seq.draft_ids, seq.draft_probs = proposal.token_ids, proposal.probs
            seq.num_scheduled_tokens = 1 + len(proposal.token_ids)  # fewer guesses than room: the rest goes unused
            seq.num_lookahead_slots = 0

    @staticmethod
    def _logprobs(logits: torch.Tensor, sampling: list[Sequence], runs: list[list[int]]) -> list[list]:
        """Each sampling sequence's logprobs of the tokens of its run (None where it did not ask): row i of a
        sequence scores its run's token i; the rows of rejected guesses score nothing."""
        targets, ks = [], []
        for seq, run in zip(sampling, runs, strict=True):
            rows = 1 + len(seq.draft_ids)
            targets += run + seq.draft_ids[len(run):]  # past the run: any valid id, its row is not asked for
            ks += [seq.params.logprobs] * len(run) + [None] * (rows - len(run))
        measured = compute_logprobs(logits, targets, ks) if sampling else []
        per_seq, start = [], 0
        for seq, run in zip(sampling, runs, strict=True):
            per_seq.append(measured[start : start + len(run)])
            start += 1 + len(seq.draft_ids)
        return per_seq

    def _advance(self, seq: Sequence, accepted: list[int]) -> None:
        """The step has run: this step's tokens of ``seq`` are in the cache now, but for its rejected guesses.

        ``accepted`` are the guesses verification kept (stage 08): they count as computed, and the positions
        after them hold rejected K/V that the next steps overwrite."""
        block_size, before = self.block_manager.block_size, seq.num_computed_tokens
        rejected = len(seq.draft_ids) - len(accepted)
        seq.num_computed_tokens += seq.num_scheduled_tokens - rejected
        seq.num_scheduled_tokens = 0
        if seq.draft_ids:
            self._count_speculation(seq, len(accepted))
            seq.draft_ids, seq.draft_probs = [], None
            # Neither cache may count a rejected token as computed; the next token's slot is kept.
            seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_computed_tokens)
            self.block_manager.shrink(seq.block_table, seq.num_computed_tokens + 1)
        filled = seq.num_computed_tokens // block_size > before // block_size
        if filled:  # a block is full (a chunk may fill several; a decode does once every block_size steps): index it
            # Only computed tokens are indexed, and those are the accepted ones: no block with a rejected guess.
            self.block_manager.cache_full_blocks(seq.token_ids + accepted, seq.block_table, seq.num_computed_tokens)
        if seq.forks and seq.num_computed_tokens == seq.num_tokens:  # its prompt is cached: the other samples start
            self._fork(seq)

    def _count_speculation(self, seq: Sequence, accepted: int) -> None:
        proposed = len(seq.draft_ids)
        seq.speculation.record(proposed, accepted)
        stats = self.speculation
        self.speculation = SpeculationStats(stats.proposed + proposed, stats.accepted + accepted, stats.runs + 1)
        self.accepted_lengths.append(accepted)

    def _score_prompt(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Echo: the logprobs of the prompt tokens this step's rows of ``seq`` predict, added to those of its earlier
        chunks. Its first row is at position ``num_computed_tokens`` and predicts the token after it."""
        # logits: [m, V] for positions start .. start + m - 1, which predict prompt tokens start + 1 .. start + m
        start = seq.num_computed_tokens
        if start == 0:  # its first chunk (again, if it was preempted): nothing scored yet
            seq.prompt_logprobs = []
        targets = seq.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
        seq.prompt_logprobs += compute_logprobs(logits, targets, [seq.params.prompt_logprobs] * len(targets))

    def _append(self, seq: Sequence, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> RequestOutput:
        """Add a step's tokens to their sequence one by one, deciding after each whether the sequence is done (EOS,
        a stop string, max_tokens): what follows the end of a run is dropped. Frees the sequence if it is done."""
        # The first token comes with the prompt's logprobs, if the request asked (echo), scored over its chunks.
        prompt_logprobs = seq.prompt_logprobs if seq.params.prompt_logprobs is not None and not seq.output_ids else None
        if seq.params.max_tokens == 0:  # only the prompt was to be scored (echo): the token is not used
            self._finish(seq)
            return RequestOutput(seq.request_id, [], "", "length", len(seq.prompt_ids), 0, [], prompt_logprobs,
                                 cached_tokens=seq.num_cached_tokens)
        text, finish_reason, kept = "", None, 0
        for token_id in token_ids:
            ### BEGIN SOLUTION 8.5
            seq.output_ids.append(token_id)
            kept += 1
            if token_id in self.eos_token_ids and not seq.params.ignore_eos:
                text, finish_reason = text + seq.detokenizer.flush(), "stop"
            else:
                text += seq.detokenizer.add(token_id)
                if seq.detokenizer.stopped:
                    finish_reason = "stop"
                elif len(seq.output_ids) == seq.params.max_tokens:
                    text, finish_reason = text + seq.detokenizer.flush(), "length"
            if finish_reason is not None:
                break  # the rest of the run is neither emitted nor counted
            ### END SOLUTION
        if finish_reason is not None:
            self._finish(seq)  # leaves the batch and frees its blocks at once
        return RequestOutput(seq.request_id, token_ids[:kept], text, finish_reason, len(seq.prompt_ids),
                             len(seq.output_ids), None if logprobs[0] is None else logprobs[:kept], prompt_logprobs,
                             cached_tokens=seq.num_cached_tokens, index=seq.index)

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End a sequence with an error: it leaves the batch, its blocks return, its client is told."""
        self._finish(seq)
        return RequestOutput.failed(seq.request_id, error, len(seq.prompt_ids), len(seq.output_ids), seq.index)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline use (the demo, the tests): run every prompt to the end, all batched; their output ids."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        outputs: dict[str, list[int]] = {}
        for i, (prompt_ids, p) in enumerate(zip(prompts, params, strict=True)):
            self.add_request(f"offline-{i}", prompt_ids, p)
            outputs[f"offline-{i}"] = []
        while self.has_unfinished():
            for output in self.step():
                if output.error is not None:
                    raise output.error
                outputs[output.request_id].extend(output.token_ids)
        return list(outputs.values())


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
    """

    def __init__(self, engine: Engine, metrics: Metrics | None = None) -> None:
        self._engine = engine
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
        self._preemptions_seen = engine.scheduler.num_preemptions  # the counters count from here
        # The scheduler's prefix-cache queries and hits at the last count.
        self._prefix_seen = (engine.scheduler.prefix_cache_queries, engine.scheduler.prefix_cache_hits)
        self._speculation_seen = engine.speculation  # the guesses counted so far

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
            for request_id, request in self._requests.items():
                self._engine.abort(request_id)  # its blocks go back to the pool
                self._deliver(request, RequestOutput.failed(request_id, stopped, len(request.prompt_ids)))
            self._requests.clear()
            while not self._inbox.empty():
                if isinstance(message := self._inbox.get(), AddRequest):
                    request = message.request
                    self._deliver(request, RequestOutput.failed(request.request_id, stopped, len(request.prompt_ids)))
            self._stats = self._engine.stats()
            self._engine.shutdown(graceful=not failed)  # stage 09: the other ranks stop too

    def _step_loop(self) -> None:
        while True:
            # Idle: sleep until something arrives. Busy: take what has arrived, without waiting.
            if not self._drain_inbox(block=not self._engine.has_unfinished()):
                return
            started = time.perf_counter()
            outputs = self._engine.step()
            self.metrics.engine_busy.inc(time.perf_counter() - started)  # its rate: the busy fraction
            self._stats = self._engine.stats()
            scheduler = self._engine.scheduler
            self.metrics.preemptions.inc(scheduler.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = scheduler.num_preemptions
            self._count_prefix_cache(scheduler.prefix_cache_queries, scheduler.prefix_cache_hits)
            self._count_speculation(self._engine.accepted_lengths)
            now = time.perf_counter()
            for output in outputs:
                if (request := self._requests.get(output.request_id)) is None:
                    continue  # another of its samples failed in this step: the request has ended
                request.num_finished += output.finished
                if output.error is not None:  # one sample failed: the request fails, its other samples stop
                    self._engine.abort(output.request_id)
                if request.num_finished == request.n or output.error is not None:
                    del self._requests[output.request_id]
                if output.error is None:
                    self._record(request, output, now)
                self._deliver(request, output)

    def _count_prefix_cache(self, queries: int, hits: int) -> None:
        """Move the prefix-cache counters by what the scheduler counted since the last step."""
        self.metrics.prefix_cache_queries.inc(queries - self._prefix_seen[0])
        self.metrics.prefix_cache_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)

    def _count_speculation(self, accepted_lengths: list[int]) -> None:
        """Move the speculation counters by the last step's verifications."""
        stats = self._engine.speculation
        self.metrics.spec_proposed_tokens.inc(stats.proposed - self._speculation_seen.proposed)
        self.metrics.spec_accepted_tokens.inc(stats.accepted - self._speculation_seen.accepted)
        self._speculation_seen = stats
        for length in accepted_lengths:
            self.metrics.spec_accepted_length.observe(length)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every queued add and abort; False when asked to stop. Idle, check every second that the
        other ranks are still there (stage 09): a dead one stops the engine, and /health says so."""
        while True:
            try:
                message = self._inbox.get(block=block, timeout=RANK_CHECK_S if block and self._engine.workers else None)
            except queue.Empty:
                if block:  # idle, with ranks to watch
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
            self._deliver(request, RequestOutput.failed(request.request_id, exc, len(request.prompt_ids)))
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
    def _deliver(request: Request, output: RequestOutput) -> None:
        """Hand an output to the request's asyncio queue from this (non-asyncio) thread."""
        try:
            request.loop.call_soon_threadsafe(request.outputs.put_nowait, output)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


# --- ranks 1 .. N-1 ------------------------------------------------------------------------------------


def run_worker(rank: int, init_method: str, config: EngineConfig) -> None:
    """A rank > 0 of a tensor-parallel engine, in its own process: join the group, build the same engine as
    rank 0 (the same start-up, collective for collective), then run the steps rank 0 sends until it says stop.
    Its scheduler, tokenizer and sampler are built but never used: rank 0 alone decides and samples."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process of the terminal: rank 0 decides
    exit_with_parent()  # rank 0 killed outright: leave too
    tp = join(rank, config.tensor_parallel_size, init_method, pick_device(config.device), config.dist_timeout,
              local_rank=int(os.environ.get("LOCAL_RANK", rank)))
    engine = Engine(config, tp)
    print(engine.memory_report(), flush=True)
    try:
        engine.runner.serve()
    finally:
        tp.close()
