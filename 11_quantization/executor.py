"""The executor: rank 0's side of one step, in two calls. ``launch`` puts the step on the device's queue and returns at
once; ``InFlight.read`` is the one wait, for that step's own tokens.

    batch   = scheduler.schedule()              # who runs, and how many tokens each
    flight  = executor.launch(batch, previous)  # propose, prepare, send to the ranks, queue the device's work
    sampled = flight.read()                     # wait for this step's tokens (and logprobs), nothing more
    outputs = scheduler.postprocess(batch, sampled)

The device's work of a step (copy its inputs in, run the model, sample) is one function queued on a ``DeviceQueue``,
which runs the steps in the order they were launched. On CUDA that queue is the GPU's stream: the host queues the
kernels and runs ahead, and the step's sampled tokens come back by a copy that does not block, with an event recorded
behind it; ``read`` waits on that event alone, never on a step launched after it. A CPU has no stream, so the stand-in
is one thread of its own that runs the queued steps in order, each handing back its tokens by a future.

A step that samples on the device can be launched before the step before it is read: its placeholders (tokens the
host has not read yet) are resolved on the queue, in order, from that step's tokens. A step that verifies guesses or
applies penalties needs tokens on the host; it is launched only once the step before it is read, and its ``read``
verifies, after the device's work (``verify`` waits for the logits).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from common.trace import StepClock

from .config import EngineConfig
from .distributed import STEP_POLL_S, Ranks, wait_until
from .model_runner import ModelRunner, StepInput
from .proposer import DraftProposer, NgramProposer
from .sampler import TokenLogprobs, compute_logprobs, logprob_tensors, to_device, unpack_logprobs
from .scheduler import Batch, Sampled, Scheduler
from .sequence import Sequence, StepKind
from .speculative import next_tokens, verify

CLOSE_S = 10.0  # how long ``DeviceQueue.close`` waits for the device thread to finish its queue


@dataclass
class DeviceOutput:
    """What a step's device work leaves: the logits, and, when it sampled on the device, its tokens (and the logprobs
    it was asked for) on the device and on their way to the host."""

    logits: torch.Tensor | None  # [R, V]: one row per sampling sequence and guess
    prompt_logits: torch.Tensor | None  # [M, V]: the prompt rows that score their prompt (echo)
    tokens: torch.Tensor | None = None  # [S] int64 on the device: the next step's placeholders point here
    host: list[torch.Tensor] = field(default_factory=list)  # tokens, logprob values and ids, copied to the host
    seconds: float = 0.0  # the device's time for the step (CUDA: between two events; a thread: its clock)


class DeviceWork:
    """One step's work on a ``DeviceQueue``: ``value`` for the steps queued after it (they run after it, so it is
    there), ``wait`` for the host (the one wait: until this step's own tokens are on the host)."""

    def __init__(self, future: Future[DeviceOutput], done: torch.cuda.Event | None = None,
                 timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None) -> None:
        self._future = future
        self._done = done  # CUDA: recorded behind the copy of the tokens to the host
        self._timing = timing  # CUDA: events before and after the step's kernels

    def value(self) -> DeviceOutput:
        """The output, from a step queued after this one: on CUDA at once (the tensors exist, their numbers come in
        order); on the device thread this step has already run."""
        return self._future.result()

    def wait(self) -> DeviceOutput:
        """The host waits until this step's tokens are on the host: on CUDA for its event, not for the stream."""
        ### BEGIN SOLUTION 10.4
        output = self._future.result()  # the device thread: this step's own future, not the queue behind it
        if self._done is not None:
            self._done.synchronize()  # CUDA: this step's copy to the host, not every kernel queued after it
        ### END SOLUTION
        if self._timing is not None:
            output.seconds = self._timing[0].elapsed_time(self._timing[1]) / 1000
        return output


def uses_device_thread(config: EngineConfig, device: torch.device) -> bool:
    """``--device-thread``: on a CPU, whether each step's device work runs on a thread of its own. auto: no. What it
    hides on a CPU is the host's millisecond or two a turn, and on this course's 2-core CPU it was not reliably
    faster than the loop whose launch computes the step (the stage README)."""
    return device.type != "cuda" and config.device_thread == "on"


class DeviceQueue:
    """Where each step's device work runs, in launch order.

    CUDA: on the host, now: every kernel is queued on the stream, and the work returns before the GPU has run it.
    A CPU with ``thread``: on one thread of its own, the stand-in for a stream (one thread computes, so the two never
    fight over the cores; the host's work meanwhile is Python that waits on nothing). A CPU without: on the host, now,
    and done when it returns: the synchronous loop, where nothing overlaps."""

    def __init__(self, device: torch.device, thread: bool) -> None:
        self.device = device
        self.thread = thread and device.type != "cuda"
        self._work: queue.SimpleQueue[tuple[Callable[[], DeviceOutput], Future] | None] | None = None
        self._thread: threading.Thread | None = None
        if self.thread:
            atexit.register(self.close)  # the interpreter must not exit under a step still inside PyTorch

    @property
    def asynchronous(self) -> bool:
        """Whether a launched step can still be running when ``launch`` returns (so that overlapping hides the host)."""
        return self.device.type == "cuda" or self.thread

    def submit(self, work: Callable[[], DeviceOutput]) -> DeviceWork:
        future: Future[DeviceOutput] = Future()
        if self.thread:
            if self._work is None:  # the first step (or the first since ``close``) starts the device thread
                self._work = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, args=(self._work, torch.get_num_threads()),
                                                name="device", daemon=True)
                self._thread.start()
            self._work.put((work, future))
            return DeviceWork(future)
        if self.device.type != "cuda":
            run(work, future)
            return DeviceWork(future)
        start, end, done = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event())
        start.record()
        run(work, future)  # queues the kernels, and the copy of the tokens to the host behind them
        end.record()
        done.record()
        return DeviceWork(future, done, (start, end))

    def close(self) -> None:
        """End the device thread once the work queued so far has run (a later step starts a new one)."""
        if self._work is not None and self._thread is not None:
            self._work.put(None)
            self._thread.join(CLOSE_S)  # a process must not exit under a thread still inside PyTorch
            self._work = self._thread = None

    @staticmethod
    def _run(work_queue: queue.SimpleQueue, threads: int) -> None:
        """The device thread: each step's work in turn, its result (or its error) on its future."""
        torch.set_num_threads(threads)  # a new thread's OpenMP team is sized by its own setting: the process's count
        while (item := work_queue.get()) is not None:
            run(*item)


def run(work: Callable[[], DeviceOutput], future: Future[DeviceOutput]) -> None:
    """Run ``work`` under inference mode (a thread's own setting), its result (timed: on a CPU the device's time for
    the step; CUDA's events replace it when read) or its error on ``future``."""
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            output = work()
    except BaseException as exc:  # noqa: BLE001 - the host sees it when it reads the step
        future.set_exception(exc)
        return
    output.seconds = time.perf_counter() - started
    future.set_result(output)


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies on the host of device tensors, started without blocking (into pinned memory, so the copy runs on the
    stream behind the step's kernels); on a CPU the tensors themselves."""
    if tensors and tensors[0].is_cuda:
        copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for copy, tensor in zip(copies, tensors, strict=True):
            copy.copy_(tensor, non_blocking=True)
        return copies
    return tensors


@dataclass
class InFlight:
    """A launched step: what it ran, and its device work. Each field is the step's own, taken at launch: by the time it
    is read, the next step may have been scheduled and launched over the same sequences."""

    batch: Batch
    sampling: list[Sequence]  # the sequences it samples for, in the order of its tokens
    guesses: list[list[int]]  # each sampling sequence's guesses (verification)
    guess_probs: list[torch.Tensor | None]  # and what a draft model drew them from
    reserved: list[int]  # each sampling sequence's room reserved for guesses
    kinds: list[StepKind]  # what the step did for each sequence of the batch
    num_tokens: int  # tokens its forward pass ran
    scoring: PromptScoring  # the prompt rows it scores (echo)
    verifies: bool  # read on the host: guesses to check, or penalties to apply
    work: DeviceWork | None  # None: it failed before reaching the device
    failed: Exception | None = None
    ranks: Ranks | None = None  # with a process group on a GPU: whose GPU work ``read`` waits for too
    dist_timeout: float = 0.0
    device_seconds: float = 0.0  # once read: the device's time for the step

    def read(self, clock: StepClock | None = None) -> list[Sampled]:
        """The step's news for each sequence of its batch, in order: the one wait for the device. A failure of the step
        (at launch or on the device) is raised here."""
        clock = clock or StepClock()
        if self.work is None:
            assert self.failed is not None
            raise self.failed
        output = self.work.wait()  # this step's tokens on the host; a step launched after it may still be running
        self.device_seconds = output.seconds
        self._wait_for_ranks()
        clock.lap("read")
        if self.verifies:
            runs, logprobs = self._verify(output.logits)
            clock.lap("verify")
        else:
            runs, logprobs = sampled_runs(self.sampling, output)
        scored = self.scoring.unpack(output)
        chosen = {id(seq): (run, lp, len(guesses), room) for seq, run, lp, guesses, room
                  in zip(self.sampling, runs, logprobs, self.guesses, self.reserved, strict=True)}
        news = []
        for seq, prompt_logprobs in zip(self.batch.seqs, scored, strict=True):
            run, run_logprobs, proposed, room = chosen.get(id(seq), ([], [], 0, 0))
            news.append(Sampled(run, run_logprobs, prompt_logprobs, proposed, room))
        return news

    def _verify(self, logits: torch.Tensor | None) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """The run of every sampling sequence: the longest run of its guesses the model agrees with, plus one token of
        its own, from its 1 + k rows of ``logits``; with the logprobs its request asked for."""
        if not self.sampling:
            return [], []
        assert logits is not None
        runs = verify(logits, [seq.params for seq in self.sampling], self.guesses, self.guess_probs,
                      [seq.output_ids for seq in self.sampling], [seq.generator for seq in self.sampling])
        return runs, self._run_logprobs(logits, runs)

    def _run_logprobs(self, logits: torch.Tensor, runs: list[list[int]]) -> list[list[TokenLogprobs | None]]:
        """Each sampling sequence's logprobs of the tokens of its run (None where it did not ask): row i of a
        sequence scores its run's token i; the rows of rejected guesses score nothing."""
        targets, ks = [], []
        for seq, guesses, run in zip(self.sampling, self.guesses, runs, strict=True):
            targets += run + guesses[len(run):]  # past the run: any valid id, its row is not asked for
            ks += [seq.params.logprobs] * len(run) + [None] * (1 + len(guesses) - len(run))
        measured = compute_logprobs(logits, targets, ks)
        per_seq, start = [], 0
        for guesses, run in zip(self.guesses, runs, strict=True):
            per_seq.append(measured[start : start + len(run)])
            start += 1 + len(guesses)
        return per_seq

    def _wait_for_ranks(self) -> None:
        """On a GPU with a process group: wait until the step's GPU work, its collectives too, is done, within
        ``--dist-timeout`` and only while every worker runs (RanksOutOfStep otherwise). Blocking on the logits
        instead would wait forever for a dead peer: a collective replayed in a CUDA graph has no timeout. (On a
        CPU each gloo collective returns when done, or fails after its timeout.)"""
        if self.ranks is None:
            return
        done = torch.cuda.Event()
        done.record()  # after every kernel of the step on this stream
        wait_until(done.query, self.dist_timeout, self.ranks.exited, "the step's GPU work", STEP_POLL_S)


def sampled_runs(sampling: list[Sequence], output: DeviceOutput) -> tuple[list[list[int]], list[list]]:
    """Tokens sampled on the device, one per sequence, with their logprobs, from their host copies: ``output.host`` is
    [tokens, then the logprob values and ids if any row asked]."""
    if not sampling:
        return [], []
    tokens = output.host[0].tolist()
    ks = [seq.params.logprobs for seq in sampling]
    logprobs = [None] * len(tokens)
    if any(k is not None for k in ks):
        logprobs = unpack_logprobs(tokens, ks, output.host[1].tolist(), output.host[2].tolist())
    return [[token] for token in tokens], [[lp] for lp in logprobs]


@dataclass(frozen=True)
class PromptScoring:
    """Echo: which rows of the step's prompt logits score which prompt tokens. Every target is a prompt token, known at
    launch, so the device scores them in the step's own work and the host only unpacks them."""

    counts: list[int]  # each sequence of the batch: its prompt rows scored (0: none)
    targets: list[int]  # every row's target, end to end: the prompt token after that row's position
    ks: list[int | None]  # each row's top-k

    @classmethod
    def of(cls, batch: Batch, inputs: StepInput) -> PromptScoring:
        targets: list[int] = []
        ks: list[int | None] = []
        for seq, count in zip(batch.seqs, inputs.num_prompt_logits, strict=True):
            start = seq.num_computed_tokens  # the row at position p predicts prompt token p + 1
            targets += seq.prompt_ids[start + 1 : start + 1 + count]
            ks += [seq.params.prompt_logprobs] * count
        return cls(list(inputs.num_prompt_logits), targets, ks)

    def on_device(self, prompt_logits: torch.Tensor | None) -> list[torch.Tensor]:
        """The device's half: the logprob values and ids of every scored row ([M, 1 + k] and [M, k]), unread."""
        if prompt_logits is None or not self.targets:
            return []
        ids = to_device(self.targets, torch.int64, prompt_logits.device)  # [M]
        return list(logprob_tensors(prompt_logits, list(range(len(self.targets))), ids, max(self.ks)))

    def unpack(self, output: DeviceOutput) -> list[list[TokenLogprobs] | None]:
        """The host's half: each sequence's prompt logprobs, None where it scored nothing."""
        scored: list[list[TokenLogprobs] | None] = [None] * len(self.counts)
        if not self.targets:
            return scored
        values, ids = (tensor.tolist() for tensor in output.host[-2:])
        rows = unpack_logprobs(self.targets, self.ks, values, ids)
        start = 0
        for i, count in enumerate(self.counts):
            if count:
                scored[i] = rows[start : start + count]
                start += count
        return scored


class Executor:
    """Rank 0's side of a step: the proposer, the model runner, the other ranks and the device's queue.

    ``launch`` returns an ``InFlight`` at once, whatever happens: a step that fails to launch carries its error, raised
    when it is read, so that the step before it is still read and processed first."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, proposer: NgramProposer | DraftProposer | None,
                 ranks: Ranks, dist_timeout: float, device_thread: bool) -> None:
        self.runner = runner
        self.scheduler = scheduler  # it alone writes a sequence: the proposer's guesses go through it
        self.proposer = proposer
        self.ranks = ranks
        self.dist_timeout = dist_timeout
        self.queue = DeviceQueue(runner.device, device_thread)

    def launch(self, batch: Batch, previous: InFlight | None, clock: StepClock) -> InFlight:
        """Propose (a step with room for guesses), prepare, send the step to the other ranks and queue its device work:
        copy in (the placeholders resolved from ``previous``'s tokens, on the queue), run the model, and sample on the
        device, unless the step has guesses to check or penalties to apply: its ``read`` then chooses on the host."""
        verifies = any(seq.num_lookahead_slots or seq.params.penalized for seq in batch.seqs)
        kinds: list[StepKind] = ["decode" if seq.num_output_tokens and seq.num_new_tokens == 1 else "prefill"
                                 for seq in batch.seqs]
        num_tokens = batch.num_tokens
        work, failed, scoring = None, None, PromptScoring([0] * len(batch.seqs), [], [])
        try:
            self._propose(batch)
            clock.lap("propose")
            inputs = self.runner.prepare(batch)
            scoring = PromptScoring.of(batch, inputs)
            clock.lap("prepare")
            self.ranks.send(inputs)  # every other rank runs the same step on its slices
        except Exception as exc:  # noqa: BLE001 - raised by ``read``, after the step before is processed
            failed = exc
        sampling = [seq for seq in batch.seqs if seq.samples_next_token]  # [S]; none when only mid-prompt chunks
        if failed is None:
            before = previous.work if previous is not None else None
            work = self.queue.submit(lambda: self._device_step(inputs, before, sampling, scoring, verifies))
            clock.lap("launch")
        for seq, kind in zip(batch.seqs, kinds, strict=True):
            seq.trace.add(kind, clock.started, clock.last)
        ranks = self.ranks if self.runner.device.type == "cuda" and self.ranks.tp.group is not None else None
        return InFlight(batch, sampling, [seq.draft_ids for seq in sampling], [seq.draft_probs for seq in sampling],
                        [seq.num_lookahead_slots for seq in sampling], kinds, num_tokens, scoring, verifies, work,
                        failed, ranks, self.dist_timeout)

    def _propose(self, batch: Batch) -> None:
        """The sequences the scheduler reserved room for get up to that many guesses each."""
        seqs = [seq for seq in batch.seqs if seq.num_lookahead_slots]
        if not seqs:
            return
        assert self.proposer is not None, "room for guesses, and nobody to guess"
        self.scheduler.set_guesses(seqs, self.proposer.propose(seqs, [seq.num_lookahead_slots for seq in seqs]))

    def _device_step(self, inputs: StepInput, previous: DeviceWork | None, sampling: list[Sequence],
                     scoring: PromptScoring, verifies: bool) -> DeviceOutput:
        """One step's device work, in the queue's order: its input ids (placeholders resolved from the step before,
        which has run by now on this queue), the forward pass, and unless it ``verifies``, its tokens sampled and
        copied to the host with the logprobs asked for (the prompt's too), without waiting."""
        sampled = None  # [S'] the step before's tokens, where this step's input ids are placeholders for them
        if min(inputs.input_ids) < 0:
            sampled = previous.value().tokens if previous is not None else None
            if sampled is None:
                raise RuntimeError("its input ids are the tokens of a step that failed")
        input_ids = self.runner.device_input_ids(inputs, sampled)
        logits, prompt_logits = self.runner.execute(inputs, input_ids)  # [S, V] (with guesses: [R, V]); [M, V]
        if verifies or not sampling:
            return DeviceOutput(logits, prompt_logits, host=to_host(scoring.on_device(prompt_logits)))
        assert logits is not None
        tokens = next_tokens(logits, [seq.params for seq in sampling], [seq.generator for seq in sampling])  # [S]
        host = [tokens]
        ks = [seq.params.logprobs for seq in sampling]
        if rows := [i for i, k in enumerate(ks) if k is not None]:
            chosen = tokens.index_select(0, to_device(rows, torch.int64, tokens.device))  # [b]
            host += logprob_tensors(logits, rows, chosen, max(ks[i] for i in rows))
        return DeviceOutput(logits, prompt_logits, tokens, to_host(host + scoring.on_device(prompt_logits)))

    def close(self) -> None:
        self.queue.close()
