"""The scheduler: which sequences run in the next step.

Iteration-level scheduling: the decision is taken again before *every* forward pass, so a request
that finishes leaves the batch at once and a new one joins at the next step. Two queues:

* ``waiting``: first come, first served. New requests, and preempted ones at the front.
* ``running``: sequences that hold KV blocks, in the order they were admitted.

Each step is either a **prefill** of newly admitted sequences (as many as fit the limits and the
pool, their prompts laid end to end) or a **decode** of every running sequence, one token each.
Prefill comes first: a waiting request is admitted as soon as there is room, which keeps the
decode batch as full as the pool allows.

When the pool runs dry in the middle of decoding, the most recently admitted sequence is
**preempted**: it gives back all its blocks and goes back to the front of the waiting queue, to be
recomputed (its prompt plus what it generated so far, prefilled again) when blocks free up. The
oldest requests always keep going, so every request finishes.

A step is accounted for in two halves. When it is launched, ``launched`` counts its tokens as
computed. When it is read, ``postprocess`` hands each sequence's new token to the output processor
(``output_processor.py``: its text, and whether it ends the sequence), appends it, and finishes the
sequences that ended. The scheduler is the only one that changes a sequence: the engine's step is
schedule, launch, read, postprocess.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common.trace import StepClock

from .block_manager import BlockManager
from .output_processor import OutputProcessor
from .sampler import TokenLogprobs
from .sequence import RequestOutput, Sequence, SequenceStatus


@dataclass
class Batch:
    """What the next forward pass runs."""

    seqs: list[Sequence]
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        """Tokens in the forward pass: whole prompts when prefilling, one per sequence when decoding."""
        return sum(seq.num_new_tokens for seq in self.seqs)


@dataclass(frozen=True)
class Sampled:
    """What a step chose for one sequence: its next token, and the logprobs its request asked for."""

    token_ids: list[int]  # one token
    logprobs: list[TokenLogprobs | None]  # one per token: None where the request did not ask
    prompt_logprobs: list[TokenLogprobs] | None = None  # echo: the prompt's, scored by its prefill


class Scheduler:
    """The one owner of the engine's sequences: it admits them, gives them blocks, appends what each step
    chose for them, and finishes and frees them. Everyone else only reads a ``Sequence``."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: set[int]) -> None:
        assert max_num_seqs >= 1 and max_num_batched_tokens >= 1
        self.block_manager = block_manager
        self.output_processor = OutputProcessor(eos_token_ids)  # each step's text, and who it ends
        self.max_num_seqs = max_num_seqs  # the largest decode batch
        self.max_num_batched_tokens = max_num_batched_tokens  # the most prompt tokens one prefill step runs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}  # every unfinished request, by id
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING
        assert seq.request_id not in self.sequences, f"duplicate request id {seq.request_id}"
        self.sequences[seq.request_id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        """The next step: a prefill if anyone can be admitted, else a decode of everyone running."""
        admitted = self._admit()
        if admitted:
            return Batch(admitted, is_prefill=True)
        return Batch(self._reserve_decode_slots(), is_prefill=False)

    # --- admission ------------------------------------------------------------------------
    def _admit(self) -> list[Sequence]:
        """Move sequences from the front of ``waiting`` to ``running``, as many as the limits allow.

        First come, first served: admission stops at the first sequence that does not fit, so a
        long prompt is never overtaken forever by short ones. A prompt longer than the token budget
        is still admitted when it is the only one in the step (else it could never run).
        """
        batch: list[Sequence] = []
        num_tokens = 0
        ### BEGIN SOLUTION 4.1
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if batch and num_tokens + seq.num_tokens > self.max_num_batched_tokens:
                break
            if not self.block_manager.can_grow(seq.block_table, seq.num_tokens):
                break
            self.waiting.popleft()
            self.block_manager.grow(seq.block_table, seq.num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
            num_tokens += seq.num_tokens
        ### END SOLUTION
        return batch

    # --- decoding, and preemption -----------------------------------------------------------
    def _reserve_decode_slots(self) -> list[Sequence]:
        """Give every running sequence room for one more token, oldest first, preempting the newest
        while the pool is short. Returns the sequences that decode in this step."""
        ### BEGIN SOLUTION 4.2
        scheduled: list[Sequence] = []
        queue = list(self.running)  # admission order: the newest is last
        while queue:
            seq = queue.pop(0)
            while queue and not self.block_manager.can_grow(seq.block_table, seq.num_tokens):
                self.preempt(queue.pop())  # the newest sequence not served yet gives its blocks back
            if self.block_manager.can_grow(seq.block_table, seq.num_tokens):
                self.block_manager.grow(seq.block_table, seq.num_tokens)
                scheduled.append(seq)
            else:
                self.preempt(seq)  # nobody newer is left: this one waits itself
        return scheduled
        ### END SOLUTION

    def preempt(self, seq: Sequence) -> None:
        """Take every block back from a running sequence and queue it, first in line, to be recomputed."""
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0  # its cache is gone: prompt and output will be prefilled again
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # --- after the step: launched, then read ------------------------------------------------
    def launched(self, batch: Batch) -> None:
        """``batch`` is launched: every sequence of it has all its tokens in the cache (once the pass has run)."""
        for seq in batch.seqs:
            seq.num_computed_tokens = seq.num_tokens

    def postprocess(self, batch: Batch, sampled: list[Sampled], clock: StepClock | None = None) -> list[RequestOutput]:
        """The step has been read: ``sampled[i]`` is what it chose for ``batch.seqs[i]``. The output processor reads it
        (its text, whether the sequence ends); append it, finish the sequences that ended (freeing their blocks), and
        return every sequence's output. A failure in one sequence's own work (its text, its stop strings) fails that
        sequence alone. ``clock`` times the bookkeeping (``update``) apart from ``_append``, which is mostly the output
        processor's (``detokenize``)."""
        clock = clock or StepClock()
        outputs = []
        for seq, news in zip(batch.seqs, sampled, strict=True):
            clock.lap("update")
            try:
                with seq.trace.span("detokenize"):
                    outputs.append(self._append(seq, news))
            except Exception as exc:
                outputs.append(self.fail(seq, exc))
            clock.lap("detokenize")
        clock.lap("update")
        return outputs

    def _append(self, seq: Sequence, news: Sampled) -> RequestOutput:
        """Add a sampled token to its sequence, and finish the sequence (freeing its blocks) if its output says it
        ended. The output processor reads the token first: a stop string in its text ends the sequence as EOS does."""
        output = self.output_processor.process(seq, news.token_ids, news.logprobs, news.prompt_logprobs)
        seq.output_ids += output.token_ids
        if output.finished:
            self._finish(seq)  # leaves the batch and frees its blocks at once
        return output

    # --- leaving ----------------------------------------------------------------------------
    def fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End a sequence with an error: it leaves the batch, its blocks return, its client is told."""
        self._finish(seq)
        return RequestOutput.failed(seq.request_id, error, len(seq.prompt_ids), len(seq.output_ids))

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is (its client left); its blocks return to the pool now."""
        if (seq := self.sequences.get(request_id)) is not None:
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        """A sequence is done (finished, failed, or its client left): it leaves its queue and frees its blocks."""
        del self.sequences[seq.request_id]
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED
