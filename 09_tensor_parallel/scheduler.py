"""The scheduler: which sequences run in the next step, and how many tokens each.

Iteration-level scheduling: the decision is taken again before *every* forward pass, so a request
that finishes leaves the batch at once and a new one joins at the next step. Two queues:

* ``waiting``: first come, first served. New requests, and preempted ones at the front.
* ``running``: sequences that hold KV blocks, in the order they were admitted.

New in stage 06: a step is no longer a prefill *or* a decode. Each step has a **token budget**
(``max_num_batched_tokens``) shared by everyone in it, spent in this order:

1. **Decodes first.** Every running sequence whose prompt is done gets its one token, so no stream
   ever stalls behind a prompt. (The budget is at least ``max_num_seqs``: they always fit.)
2. **Prompt chunks** with what is left, first come first served: the running sequences part-way
   through their prompts, then new ones from ``waiting``. A prompt longer than what is left gets a
   *chunk* of it now and comes back for more in the next steps; its blocks are taken chunk by chunk.

So a 4,000-token prompt no longer freezes every stream for seconds: it is computed a few hundred
tokens at a time, each chunk riding along with the decodes of the step it is in. Each sequence keeps
how many of its tokens are in the cache (``num_computed_tokens``) and how many this step adds
(``num_scheduled_tokens``); only the step that reaches a sequence's last token samples from it.

When the pool runs dry, the most recently admitted sequence is **preempted**: it gives back its
blocks and goes back to the front of the waiting queue, to be recomputed when blocks free up
(finding what is left of its own blocks in the prefix cache). The oldest requests always go on.

New in stage 08: after the decodes, and before the prompt chunks, each decoding sequence gets room for
its k guesses (``_reserve_lookahead``), as far as the budget and the free blocks go.

From stage 05, admission first looks the sequence up in the prefix cache: the blocks of its longest
cached prefix are shared, and its first chunk starts after them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class Batch:
    """What the next forward pass runs: each sequence's ``num_scheduled_tokens`` tokens, decodes first."""

    seqs: list[Sequence]

    @property
    def num_tokens(self) -> int:
        """Tokens in the forward pass: one per decode, plus every prompt chunk."""
        return sum(seq.num_scheduled_tokens for seq in self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        assert max_num_seqs >= 1
        assert max_num_batched_tokens >= max_num_seqs, "every running sequence decodes in every step: the budget " \
            f"({max_num_batched_tokens} tokens) must cover max_num_seqs ({max_num_seqs})"
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs  # the most sequences running at once
        self.max_num_batched_tokens = max_num_batched_tokens  # the step's token budget: decodes and prompt chunks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_cache_hits = 0  # of those, tokens found there (not computed again)

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue ``seq`` at the end, or ``first`` in line (the samples of a request already running)."""
        assert seq.status is SequenceStatus.WAITING
        if first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        """The next step: one token for every decoding sequence, then prompt chunks, oldest first, within the budget.

        Sets each scheduled sequence's ``num_scheduled_tokens``; the engine adds them to its computed tokens
        once the step has run."""
        assert all(seq.num_scheduled_tokens == 0 for seq in self.running), "the last step was not accounted for"
        preemptions = self.num_preemptions
        ### BEGIN SOLUTION 6.1
        scheduled = self._schedule_decodes()
        budget = self.max_num_batched_tokens - len(scheduled)
        budget -= self._reserve_lookahead(scheduled, budget)
        for seq in [seq for seq in self.running if seq.num_new_tokens > 1]:  # part-way through a prompt
            if budget == 0:
                break
            if seq.status is SequenceStatus.RUNNING and self._schedule_chunk(seq, budget):  # not preempted meanwhile
                scheduled.append(seq)
                budget -= seq.num_scheduled_tokens
        if self.num_preemptions == preemptions:  # after a preemption, admitting would take the blocks just freed
            scheduled += self._admit(budget)
        ### END SOLUTION
        return Batch(scheduled)

    # --- decodes, and preemption ---------------------------------------------------------------
    def _schedule_decodes(self) -> list[Sequence]:
        """Give every running sequence whose prompt is done room for one more token, oldest first, preempting the
        newest while the pool is short. Returns the sequences that decode in this step."""
        ### BEGIN SOLUTION 4.2
        scheduled: list[Sequence] = []
        queue = list(self.running)  # admission order: the newest is last
        while queue:
            seq = queue.pop(0)
            if seq.num_new_tokens > 1:
                continue  # part-way through its prompt: it gets a chunk after the decodes, or gives its blocks up
            while queue and not self.block_manager.can_grow(seq.block_table, seq.num_tokens):
                self.preempt(queue.pop())  # the newest sequence not served yet gives its blocks back
            if self.block_manager.can_grow(seq.block_table, seq.num_tokens):
                self.block_manager.grow(seq.block_table, seq.num_tokens)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
            else:
                self.preempt(seq)  # nobody newer is left: this one waits itself
        return scheduled
        ### END SOLUTION

    def _reserve_lookahead(self, decodes: list[Sequence], budget: int) -> int:
        """New in stage 08: room for each decoding sequence's guesses, k more tokens in this step, oldest first, as
        far as the budget and the free blocks go (a guess never preempts anyone). Returns the tokens reserved.

        k is the sequence's own (0 while its guesses are not paying), and never more than its answer has room
        for: a step emits up to k + 1 tokens."""
        reserved = 0
        for seq in decodes:
            ### BEGIN SOLUTION 8.4
            k = min(seq.speculation.lookahead(), budget - reserved, seq.params.max_tokens - len(seq.output_ids) - 1)
            if k <= 0 or not self.block_manager.can_grow(seq.block_table, seq.num_tokens + k):
                continue
            self.block_manager.grow(seq.block_table, seq.num_tokens + k)  # positions L .. L + k - 1: the guesses
            seq.num_lookahead_slots = k
            seq.num_scheduled_tokens = 1 + k
            reserved += k
            ### END SOLUTION
        return reserved

    # --- prompt chunks -------------------------------------------------------------------------
    def _schedule_chunk(self, seq: Sequence, budget: int) -> bool:
        """The next chunk of a running sequence's prompt: as much of the rest as ``budget`` allows, and the pool.

        If the pool is short, the sequences admitted after it and not scheduled in this step give their blocks
        back, newest first (first come, first served among prompts, and two half-computed prompts can never hold
        each other up); if none is left, the chunk shrinks to what the pool holds. False if not even one token
        fits."""
        chunk = min(seq.num_new_tokens, budget)
        while not self.block_manager.can_grow(seq.block_table, seq.num_computed_tokens + chunk):
            newer = self.running[self.running.index(seq) + 1 :]
            unscheduled = [s for s in newer if s.num_scheduled_tokens == 0]
            if not unscheduled:
                chunk = min(chunk, self._room(seq))
                break
            self.preempt(unscheduled[-1])
        if chunk <= 0:
            return False
        self.block_manager.grow(seq.block_table, seq.num_computed_tokens + chunk)
        seq.num_scheduled_tokens = chunk
        return True

    def _room(self, seq: Sequence) -> int:
        """How many more tokens ``seq`` could compute with the blocks it holds and every available one."""
        num_blocks = len(seq.block_table) + self.block_manager.num_available
        return num_blocks * self.block_manager.block_size - seq.num_computed_tokens

    # --- admission ------------------------------------------------------------------------
    def _admit(self, budget: int) -> list[Sequence]:
        """Move sequences from the front of ``waiting`` to ``running`` while the budget, ``max_num_seqs`` and the
        pool allow, each with the first chunk of its prompt (all of it, if it fits in the budget).

        First come, first served: admission stops at the first sequence whose chunk's blocks are not there, so a
        long prompt is never overtaken forever by short ones. Its blocks are taken for this chunk only: the
        later chunks take theirs as they come."""
        batch: list[Sequence] = []
        ### BEGIN SOLUTION 4.1
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.cached_prefix(seq)
            num_cached = len(cached) * self.block_manager.block_size
            chunk = min(seq.num_tokens - num_cached, budget)  # what this step computes of it
            if not self.block_manager.can_allocate(cached, num_cached + chunk):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq.block_table, cached, num_cached + chunk)
            self._count_hit(seq, num_cached)
            seq.num_scheduled_tokens = chunk
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
            budget -= chunk
        ### END SOLUTION
        return batch

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The blocks of ``seq``'s longest cached prefix, to share instead of computing them again.

        A sequence that asked for prompt logprobs (echo) shares nothing: scoring its prompt needs the
        logits of every prompt position, so every one is computed. A preempted sequence is matched on
        its prompt and output: it finds its own blocks again, unless they were evicted meanwhile."""
        return [] if seq.needs_prompt_logprobs else self.block_manager.match(seq.token_ids)

    def _count_hit(self, seq: Sequence, num_cached_tokens: int) -> None:
        """Start the admitted ``seq`` after its cached tokens, and count the lookup (in tokens, as vLLM does)."""
        seq.num_computed_tokens = num_cached_tokens  # the step computes only the rest
        if not seq.output_ids:  # its first admission: what usage reports as cached prompt tokens
            seq.num_cached_tokens = num_cached_tokens
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += num_cached_tokens

    # --- preemption, and leaving ------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Take every block back from a running sequence and queue it, first in line, to be recomputed."""
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0  # its cache is given back: prefilled again, but for what is still cached
        seq.num_draft_computed_tokens = 0  # and the draft model's, which lives in the same blocks
        seq.num_scheduled_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """A sequence is done (finished, failed, or its client left): it leaves its queue and frees its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED
