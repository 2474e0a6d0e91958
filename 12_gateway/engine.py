"""The engine: one step at a time within a token budget, every request in flight batched into each pass, each step
launched before the step before it is processed.

Each ``step`` is the same four calls: the scheduler picks the sequences that take part and how many
tokens each (``schedule``: one for every decoding sequence, then chunks of prompts, within the step's
token budget); the executor (``executor.py``) lays them out as one flat batch and runs the model
(``launch``), and the scheduler counts the step's tokens as computed; the step is read back once
(``read``: the next token of every sequence whose step reaches its last token); and the scheduler
appends the new ones, finishes the sequences that are done and frees their blocks (``postprocess``). A
request that arrives mid-way joins at the next step; a long prompt is computed a chunk per step,
alongside everyone else's decodes.

A decoding sequence may also bring guesses of its next tokens (``proposer.py``): the scheduler
reserves room for them, the proposer fills it, the model runs the last token and the guesses in one
pass, and verification (``speculative.py``) keeps the longest run the model agrees with, plus one token
of its own: 1 to k + 1 tokens per sequence and step, those it would have produced one by one (near-ties
of float32 rounding aside). The rejected guesses' blocks go back to the pool. How many guesses each
sequence gets, 0 to k, the policy (``policy.py``) decides each step, from what a step costs (measured at
start-up) and how often the sequence's guesses have been kept.

The model may be split across N processes (``--tensor-parallel-size``). This engine is rank 0: it
starts the other ranks, and every rank starts up the same way (``worker.py``: once all have loaded their
weights; the number of KV blocks is the smallest any rank can hold). Then only rank 0 schedules; the
others are model runners that run each step it sends them. A rank that dies, or a step that fails on one
or does not finish within ``--dist-timeout``, stops the engine (the ranks can no longer be in step) and
every rank.

The steps overlap. A step's work on the host (scheduling, laying out the batch, reading the sampled tokens,
finishing sequences) is time the device does nothing, unless the device has the next step to run meanwhile. A turn of
the loop makes the four calls so that step N + 1 is launched before step N is read: the device computes N + 1 while
Python processes N. Step N + 1 cannot know step N's tokens on the host yet; its decoding sequences' input ids are
placeholders, which the device fills in from step N's sampled tokens. A sequence that ends in step N (EOS) has had a
token computed in step N + 1 all the same, which is dropped unread; one that reaches ``max_tokens`` is never
scheduled past it. A step that needs a token on the host (guesses to propose, penalties to count, ranks to send it
to) waits for the step before it, says why, and runs in the next turn, once step N's news has left.

``Engine`` is the core (``add_request``, ``step``, ``abort``); a server runs its loop in a process of its own
(``core.py``), which the API process talks to through ``AsyncEngine`` (``async_engine.py``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch

from common.device import pick_device, pick_dtype
from common.trace import RequestTrace, StepClock
from common.weights import load_tokenizer, resolve_model

from .block_manager import BlockManager
from .config import CPU_TOKEN_BUDGET, CUDA_TOKEN_BUDGET, EngineConfig
from .distributed import RanksOutOfStep, TPGroup, device_of, start_ranks, under_torchrun
from .executor import Executor, InFlight, uses_device_thread
from .kv_cache import KVCache
from .messages import EngineStopped, InvalidRequest
from .model import LlamaForCausalLM, ModelConfig
from .model_runner import cost_rows, start_runner
from .policy import SpeculationCost
from .prefix_index import HashIndex, PrefixIndex
from .proposer import DraftProposer, NgramProposer, layer_skip_draft, load_draft
from .quantize import pick_quantization
from .radix_tree import RadixTree
from .sampler import SamplingParams, make_generator
from .scheduler import Batch, Scheduler
from .sequence import RequestOutput, Sequence, SequenceStatus, StepResult
from .speculative import Speculation
from .stats import EngineStats, KVBlockStats, MemoryStats, OverlapStats, PrefixCacheStats
from .text import encode, encode_chat
from .worker import memory_report, run_worker

HOST_WEIGHT = 0.1  # the weight of each turn in the running mean of the host's time per step (``measure_host``)
# Why a step ran synchronously (``Engine.sync_reason``); /metrics counts each.
SyncReason = Literal["tensor_parallel", "speculation", "penalties"]


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


def check_tensor_parallel(config: EngineConfig, model: ModelConfig, device: torch.device) -> None:
    """Refuse, before any process starts, what tensor parallelism cannot run."""
    model.check_tensor_parallel_size(config.tensor_parallel_size)
    # Spawned here, rank r runs on cuda:r: this machine needs a GPU per rank (torchrun gives each its own).
    if device.type == "cuda" and not under_torchrun() and config.tensor_parallel_size > torch.cuda.device_count():
        raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} needs a GPU per rank, and this machine "
                         f"has {torch.cuda.device_count()}")
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

    With tensor parallelism this engine is rank 0: it starts the other ranks (``worker.run_worker``), which are
    model runners only, and sends them every step it runs."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.max_num_batched_tokens = token_budget(config, self.device)  # checked before the weights are loaded
        model_dir = resolve_model(config.model)
        check_tensor_parallel(config, ModelConfig.from_pretrained(model_dir), self.device)  # before any process starts
        self.ranks = start_ranks(config.tensor_parallel_size, self.device, config.dist_timeout, run_worker,
                                 (config, self.max_num_batched_tokens), config.process_group)
        try:
            self._start_up(config, model_dir)
        except BaseException:  # a failed start leaves no worker behind, waiting for a rank 0 that gave up
            self.ranks.stop(graceful=False)
            raise

    def _start_up(self, config: EngineConfig, model_dir: Path) -> None:
        """Everything after the ranks have met: the tokenizer, this rank's weights, the runner and its pool (in step
        with every other rank's start-up, ``worker.py``), the proposer and the scheduler."""
        self.device = device_of(self.device, self.ranks.tp)  # on CUDA each rank its own GPU
        self.tokenizer = load_tokenizer(model_dir)
        self.quantization = pick_quantization(config.quantization, model_dir)  # "auto": int4 for a model in blocks
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=self.dtype, device=self.device, tp=self.ranks.tp,
                                                      quantization=self.quantization)
        self.max_model_len: int = self.model.config.max_position_embeddings
        self.eos_token_ids = set(self.model.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        draft = self.make_draft(config)  # before the pool: a separate draft's weights are not the pool's to take
        draft_shape = draft.config.cache_shape(config.block_size, self.dtype) if draft is not None else None
        self.tp.wait_for_all()  # every rank's weights loaded (worker.py waits here too): the forward passes may start
        self.runner = start_runner(config, self.model, self.device, self.max_num_batched_tokens,
                                   draft_shape.bytes_per_block if draft_shape else 0)
        self.kv_cache = self.runner.kv_cache
        # What the weights and the pool take: fixed from here on, so counted once, not at every turn's stats.
        self.memory = MemoryStats(self.quantization, self.model.num_weight_bytes, self.model.num_unquantized_bytes,
                                  self.kv_cache.num_bytes)
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size,
                                          make_index(config.prefix_cache, config.block_size))
        self.proposer: NgramProposer | DraftProposer | None = None
        if config.speculative == "ngram":
            self.proposer = NgramProposer()
        elif draft is not None:
            num_blocks = self.kv_cache.num_blocks  # the draft's K/V live in blocks of the same ids
            self.draft_kv_cache = KVCache.allocate(draft_shape, num_blocks * draft_shape.bytes_per_block, self.device)
            self.proposer = DraftProposer(draft, self.draft_kv_cache, config.block_size, self.device,
                                          config.max_num_seqs, self.max_model_len, self.max_num_batched_tokens,
                                          config.enforce_eager)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                   self.eos_token_ids, self.speculation_cost())
        self.executor = Executor(self.runner, self.scheduler, self.proposer, self.ranks, config.dist_timeout,
                                 uses_device_thread(config, self.device))
        self.in_flight: InFlight | None = None  # the step launched and not yet read (overlap)
        self.deferred: Batch | None = None  # a synchronous step scheduled behind it, run at the next turn
        self.accepted_lengths: list[int] = []  # each verification's of the last step read: the guesses it kept
        self.last_read: InFlight | None = None  # the step the last turn read
        self.sync_steps: dict[SyncReason, int] = {}  # steps that could not overlap, by reason
        self.num_overlapped = 0  # steps launched while another was in flight
        self.tp.wait_for_all()  # every rank started up (graphs captured and all): the first step may go out

    @property
    def tp(self) -> TPGroup:
        """This engine's place among the ranks (one rank: no group; once shut down: one rank again)."""
        return self.ranks.tp

    def check_ranks(self) -> None:
        """Raise EngineStopped if a rank this engine started has exited (torchrun watches its own ranks)."""
        if (why := self.ranks.exited()) is not None:
            raise EngineStopped(why)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the device thread and every other rank, and leave none behind (``Ranks.stop``)."""
        self.executor.close()
        self.ranks.stop(graceful)

    def memory_report(self) -> str:
        return memory_report(self.runner)

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

    def speculation_cost(self) -> SpeculationCost | None:
        """What the speculation policy weighs guesses against: the runner's step costs (measured at start-up, or
        read from --step-costs), and a draft model's, measured (each guess also takes a row of one of its steps).
        None without speculation, or with ``--speculative-policy always``: every sequence then guesses its k."""
        runner = self.runner
        if self.proposer is None or runner.step_cost is None or runner.decode_cost is None:
            return None
        draft = None
        if isinstance(self.proposer, DraftProposer):  # its steps run one row per sequence still guessing
            draft = self.proposer.runner.measure_cost(cost_rows(self.config.max_num_seqs))
        return SpeculationCost(runner.step_cost, runner.decode_cost, draft, runner.sequence_cost)

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
                           PrefixCacheStats(scheduler.prefix_cache_queries, scheduler.prefix_cache_hits),
                           scheduler.speculation, OverlapStats(self.num_overlapped, dict(self.sync_steps)),
                           self.memory)

    # --- text <-> token ids ---------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return encode(self.tokenizer, prompt)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

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
        k = self.config.num_speculative_tokens if self.proposer is not None else 0
        samples = [Sequence(request_id, list(prompt_ids), params, make_generator(sample_seed(params.seed, i),
                                                                                 self.device),
                            trace=trace or RequestTrace(), index=i, speculation=Speculation(k))
                   for i in range(n)]
        samples[0].forks = samples[1:]
        self.scheduler.add(samples[0])

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Drop a request wherever it is (its client left), or only its sample ``index`` (a stop string ended it);
        its blocks return to the pool now."""
        self.scheduler.abort(request_id, index)

    # --- one step -------------------------------------------------------------------------
    def step(self, clock: StepClock | None = None) -> StepResult:
        """One turn of the engine's loop; returns the output of every sequence that has news.

        Each step is the same four calls: ``schedule``, ``executor.launch``, ``InFlight.read`` (the one wait) and
        ``scheduler.postprocess``. Overlapping, a turn makes them in another order: schedule step N + 1 and launch it,
        then read and process step N, launched by the turn before, while the device computes N + 1. A step that
        cannot overlap (``sync_reason``) makes them in stage 09's order, but only once step N's news has left: that
        turn processes step N and returns, and the next turn runs the step (every step so without ``overlaps``).

        ``clock`` times each phase (the server's /metrics and --trace show them)."""
        clock = clock or StepClock()
        if self.deferred is not None:  # scheduled by the turn before, behind the step then in flight
            batch, self.deferred = self.deferred, None
            batch.seqs = [seq for seq in batch.seqs if seq.status is SequenceStatus.RUNNING]  # those ended in N leave
            clock.lap("schedule")
            return self._run(batch, clock)
        batch = self.scheduler.schedule()
        clock.lap("schedule")
        reason = self.sync_reason(batch) if batch.seqs else None
        if batch.seqs and reason is None and self.overlaps:
            self.num_overlapped += self.in_flight is not None
            ### BEGIN SOLUTION 10.1
            flight = self._launch(batch, self.in_flight, clock)  # step N + 1: on the device's queue
            outputs = self._postprocess(self.in_flight, clock)  # step N: read and processed, meanwhile
            self.in_flight = flight  # carried to the next turn
            ### END SOLUTION
            self.measure_host(clock)
            return self._result(outputs, flight)
        if reason is not None and self.overlaps:
            self.sync_steps[reason] = self.sync_steps.get(reason, 0) + 1
        if self.in_flight is not None:  # step N's news first: the new step needs its tokens on the host
            outputs = self._postprocess(self.in_flight, clock)
            self.in_flight, self.deferred = None, batch if batch.seqs else None
            return self._result(outputs, None)
        return self._run(batch, clock)

    @property
    def overlaps(self) -> bool:
        """Not with ``--disable-overlap``, nor where launch computes the step (a CPU without its device thread)."""
        return not self.config.disable_overlap and self.executor.queue.asynchronous

    def _run(self, batch: Batch, clock: StepClock) -> StepResult:
        """A synchronous step: the same calls in stage 09's order, launch, read, postprocess."""
        if not batch.seqs:
            return StepResult([])
        flight = self._launch(batch, None, clock)
        outputs = self._postprocess(flight, clock)
        self.measure_host(clock)  # what overlapping would have hidden: the price a guess pays for waiting
        return self._result(outputs, flight)

    def _result(self, outputs: list[RequestOutput], launched: InFlight | None) -> StepResult:
        """The outputs of the step a turn read, the size of the step it launched, the device's time for the one read."""
        read = self.last_read
        return StepResult(outputs, launched.num_tokens if launched else 0,
                          num_decoding=launched.kinds.count("decode") if launched else 0,
                          accepted_lengths=self.accepted_lengths, device_seconds=read.device_seconds if read else 0.0,
                          device_decoding=read.kinds.count("decode") if read else 0)

    def _launch(self, batch: Batch, previous: InFlight | None, clock: StepClock) -> InFlight:
        """Launch ``batch`` behind ``previous`` (whose tokens its placeholders are); the scheduler counts it as run."""
        flight = self.executor.launch(batch, previous, clock)
        self.scheduler.launched(batch, flight.sampling)
        return flight

    def _postprocess(self, flight: InFlight | None, clock: StepClock) -> list[RequestOutput]:
        """Step ``flight`` read and handed to the scheduler (nothing in flight: nothing). A failed step fails every
        sequence of it still here: one pass for the whole batch, their caches half written."""
        self.accepted_lengths, self.last_read = [], None
        if flight is None:
            return []
        try:
            sampled = flight.read(clock)
        except Exception as exc:
            return self._fail([seq for seq in flight.batch.seqs if seq.status is not SequenceStatus.FINISHED], exc)
        self.accepted_lengths = [len(news.token_ids) - 1 for news in sampled if news.proposed]
        self.last_read = flight
        return self.scheduler.postprocess(flight.batch, sampled, clock)

    def measure_host(self, clock: StepClock) -> None:
        """The host's share of a turn that launched a step (its phases but ``read`` and ``verify``, which wait for the
        device), a running mean: the overlap a step with guesses gives up by waiting, which the speculation policy
        charges guesses for (``SpeculationCost.sync``). Only where turns can overlap; elsewhere it stays 0."""
        cost = self.scheduler.cost
        if not self.overlaps or cost is None:
            return
        host = sum(clock.phases.values()) - clock.phases.get("read", 0.0) - clock.phases.get("verify", 0.0)
        self.scheduler.cost = replace(cost, sync=cost.sync + HOST_WEIGHT * (host - cost.sync))

    def sync_reason(self, batch: Batch) -> SyncReason | None:
        """Why ``batch`` cannot be launched before the step in flight is read (it needs, on the host, a token still on
        the device), or None. Guesses are the technique's own limit; penalties (and a logit bias) counted from the
        host's lists and ranks fed by rank 0's host are this engine's (the README says how others lift them)."""
        ### BEGIN SOLUTION 10.5
        if self.tp.size > 1:
            return "tensor_parallel"
        if any(seq.num_lookahead_slots for seq in batch.seqs):
            return "speculation"
        if any(seq.params.penalized for seq in batch.seqs):
            return "penalties"
        return None
        ### END SOLUTION

    def has_unfinished(self) -> bool:
        """Sequences to run, a step in flight to read, or one scheduled behind it."""
        return self.scheduler.has_unfinished() or self.in_flight is not None or self.deferred is not None

    def _fail(self, seqs: list[Sequence], exc: Exception) -> list[RequestOutput]:
        """A step failed: one pass for the whole batch, so all of it fails (their caches are half written). A failure
        the engine cannot go on from stops it, and drops the steps in flight with it (their work cannot be read)."""
        if isinstance(exc, RanksOutOfStep | torch.AcceleratorError):
            self.in_flight = self.deferred = None
        if isinstance(exc, RanksOutOfStep):  # a rank died, or failed mid-step
            self.check_ranks()  # the better message, when a process is gone
            raise EngineStopped(f"the tensor-parallel ranks are out of step: {exc}") from exc
        if isinstance(exc, torch.AcceleratorError):
            # A CUDA error (a device-side assert, say) is sticky: every later kernel on this GPU fails
            # too. Failing this batch and going on would fail every batch after it, so the engine
            # stops, and the server says so (503) instead of answering each request with a 500.
            raise EngineStopped(f"the GPU failed: {exc}") from exc
        return [self.scheduler.fail(seq, exc) for seq in seqs]

    def generate_offline(self, prompts: list[list[int]],
                         params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline use (the demo, the tests): run every prompt to the end, all batched; their output ids. (The
        server streams through ``AsyncEngine.generate`` instead, which also detokenizes and applies stop strings: the
        engine itself ends a sequence only at EOS or ``max_tokens``.)"""
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
