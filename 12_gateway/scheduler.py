"""The scheduler: which sequences run in the next step, and how many tokens each.

Iteration-level scheduling: the decision is taken again before *every* forward pass, so a request
that finishes leaves the batch at once and a new one joins at the next step. Two queues:

* ``waiting``: first come, first served. New requests, and preempted ones at the front.
* ``running``: sequences that hold KV blocks, in the order they were admitted.

A step mixes decodes and prompt chunks. Each step has a **token budget**
(``max_num_batched_tokens``) shared by everyone in it, spent in this order:

1. **Decodes first.** Every running sequence whose prompt is done gets its one token, so no stream
   ever stalls behind a prompt. (The budget is at least ``max_num_seqs``: they always fit.)
2. **Prompt chunks** with what is left, first come first served: the running sequences part-way
   through their prompts, then new ones from ``waiting``. A prompt longer than what is left gets a
   *chunk* of it now and comes back for more in the next steps; its blocks are taken chunk by chunk.

So a 4,000-token prompt never freezes every stream for seconds: it is computed a few hundred
tokens at a time, each chunk riding along with the decodes of the step it is in. Each sequence keeps
how many of its tokens are in the cache (``num_computed_tokens``) and how many this step adds
(``num_scheduled_tokens``); only the step that reaches a sequence's last token samples from it.

When the pool runs dry, the most recently admitted sequence is **preempted**: it gives back its
blocks and goes back to the front of the waiting queue, to be recomputed when blocks free up
(finding what is left of its own blocks in the prefix cache). The oldest requests always go on.

After the decodes, and before the prompt chunks, each decoding sequence gets room for its guesses
(``_reserve_lookahead``): as many as the speculation policy (``policy.py``) finds worth their rows, from 0 to
its k, as far as the budget and the free blocks go; the proposer's guesses arrive through ``set_guesses``.

Admission first looks the sequence up in the prefix cache: the blocks of its longest cached prefix
are shared, and its first chunk starts after them.

A step is accounted for in two halves, whichever order the engine's loop makes its calls in. When it is launched,
``launched`` counts its tokens (its guesses too) as computed and gives each sequence that samples a *pending* token, a
placeholder for the token still on the device, so that the next step can be scheduled as if it were known: one more
token, one more position, a block more if the last is full. When it is read, ``postprocess`` puts each run in its
pending token's place, takes back the guesses verification rejected, hands the run to the output processor
(``output_processor.py``: where it ends the sequence; the text is the API process's), appends what it kept, and
finishes the sequences that ended; a sequence that finished meanwhile gets nothing. A block is indexed in the prefix
cache once every token in it is known. The scheduler is the only one that changes a sequence: the engine's step is
schedule, launch, read, postprocess.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common.trace import StepClock

from .block_manager import BlockManager
from .output_processor import OutputProcessor
from .policy import SpeculationCost, plan_guesses
from .sampler import TokenLogprobs
from .sequence import RequestOutput, Sequence, SequenceStatus
from .speculative import Proposal
from .stats import SpeculationStats


@dataclass
class Batch:
    """What the next forward pass runs: each sequence's ``num_scheduled_tokens`` tokens, decodes first."""

    seqs: list[Sequence]

    @property
    def num_tokens(self) -> int:
        """Tokens in the forward pass: one per decode, plus every prompt chunk."""
        return sum(seq.num_scheduled_tokens for seq in self.seqs)


@dataclass(frozen=True)
class Sampled:
    """What a step chose for one sequence: the tokens it emits, and the logprobs its request asked for."""

    token_ids: list[int]  # its run: the accepted guesses and one token of the model's (none: a mid-prompt chunk)
    logprobs: list[TokenLogprobs | None]  # one per token: None where the request did not ask
    prompt_logprobs: list[TokenLogprobs] | None = None  # echo: those of the prompt tokens this step's chunk scored
    proposed: int = 0  # guesses the step checked for it (``token_ids`` holds those it kept, then one token)
    reserved: int = 0  # room the step reserved for its guesses (the proposer may have had none)


class Scheduler:
    """The one owner of the engine's sequences: it admits them, gives them blocks, appends what each step
    chose for them, and finishes and frees them. Everyone else only reads a ``Sequence`` (but for the proposers'
    own state on it: the draft model's progress in its own cache, the n-gram index)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: set[int], cost: SpeculationCost | None = None) -> None:
        assert max_num_seqs >= 1
        assert max_num_batched_tokens >= max_num_seqs, "every running sequence decodes in every step: the budget " \
            f"({max_num_batched_tokens} tokens) must cover max_num_seqs ({max_num_seqs})"
        self.block_manager = block_manager
        self.output_processor = OutputProcessor(eos_token_ids)  # whom each step's tokens end
        self.max_num_seqs = max_num_seqs  # the most sequences running at once
        self.max_num_batched_tokens = max_num_batched_tokens  # the step's token budget: decodes and prompt chunks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[str, list[Sequence]] = {}  # every unfinished request's samples, by request id
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_cache_hits = 0  # of those, tokens found there (not computed again)
        self.speculation = SpeculationStats(0, 0, 0)  # every verification's guesses, proposed and kept
        self.cost = cost  # what the speculation policy weighs guesses against; None: each sequence guesses its k

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue ``seq`` at the end, or ``first`` in line (the samples of a request already running)."""
        assert seq.status is SequenceStatus.WAITING
        assert seq.index > 0 or seq.request_id not in self.sequences, f"duplicate request id {seq.request_id}"
        self.sequences.setdefault(seq.request_id, []).append(seq)
        if first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        """The next step: one token for every decoding sequence, then prompt chunks, oldest first, within the budget.

        Sets each scheduled sequence's ``num_scheduled_tokens``; ``launched`` adds them to its computed tokens once
        the step is on the device."""
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
            if seq.num_output_tokens == seq.params.max_tokens:
                continue  # its last token is on the device (overlap): it ends when that token is read
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
        """Room for the decoding sequences' guesses, oldest first, as far as the budget and the free blocks go (a guess
        never preempts anyone). Returns the tokens reserved.

        A sequence's k is at most its own (``speculation.num_tokens``) and what its answer has room for (a step emits
        up to k + 1 tokens); within that, the policy gives it the guesses that pay for their rows (``plan_guesses``,
        from the step's cost and each sequence's acceptance rate), or every one without a cost to weigh."""
        reserved = 0
        ### BEGIN SOLUTION 8.4
        caps = [min(seq.speculation.num_tokens, seq.params.max_tokens - seq.num_output_tokens - 1) for seq in decodes]
        ks = caps if self.cost is None else plan_guesses([seq.speculation.acceptance for seq in decodes], caps,
                                                         len(decodes), self.cost)
        for seq, k in zip(decodes, ks, strict=True):
            k = min(k, budget - reserved)
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
        if seq.needs_prompt_logprobs:  # echo: scored from its first chunk on (after a preemption, over again)
            seq.prompt_logprobs = []
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

    # --- guesses (the proposer's) -----------------------------------------------------------
    def set_guesses(self, seqs: list[Sequence], proposals: list[Proposal]) -> None:
        """The proposer's guesses for the sequences this step reserved room for: each runs its last token and its
        guesses. Fewer guesses than room: the rest of the room goes unused (the step keeps the room it
        reserved: a sequence given room and no guess at all has its acceptance rate lowered in ``postprocess``)."""
        for seq, proposal in zip(seqs, proposals, strict=True):
            assert len(proposal.token_ids) <= seq.num_lookahead_slots, "more guesses than the room reserved"
            seq.draft_ids, seq.draft_probs = proposal.token_ids, proposal.probs
            seq.num_scheduled_tokens = 1 + len(proposal.token_ids)

    # --- after the step: launched, then read ------------------------------------------------
    def launched(self, batch: Batch, sampling: list[Sequence]) -> None:
        """``batch`` is on the device's queue. Count its tokens as computed now, its guesses too (``postprocess`` takes
        back those rejected): the next step, which may be scheduled before this one's tokens are read, must see them
        so. Index the blocks they filled whose tokens the host knows, start the other samples of a request whose
        prompt is now cached, and give each of ``sampling`` (the sequences the step samples for, in its order) a
        *pending* token: its row in the step's sampled tokens, a placeholder until the step is read."""
        for seq in batch.seqs:
            before = min(seq.num_computed_tokens, seq.num_tokens - len(seq.pending_rows))
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            seq.num_lookahead_slots, seq.draft_ids, seq.draft_probs = 0, [], None  # the step holds its own guesses
            self._index_known(seq, before, [])
            if seq.forks and seq.num_computed_tokens == seq.num_tokens:  # its prompt is cached: the other samples start
                self._fork(seq)
        for row, seq in enumerate(sampling):
            seq.pending_rows.append(row)

    def postprocess(self, batch: Batch, sampled: list[Sampled], clock: StepClock | None = None) -> list[RequestOutput]:
        """The step has been read: ``sampled[i]`` is what it chose for ``batch.seqs[i]``: the run verification kept
        (its accepted guesses and one token of the model's own), nothing for a chunk that ends part-way through its
        prompt. Each sequence still here takes its run in place of its pending token: the rejected guesses are no
        longer computed, the blocks it completes are indexed, the output processor reads it (where the sequence
        ends), what it kept is appended, and a sequence that ended is finished (its blocks freed). A sequence that
        finished meanwhile (it ended in the step before, or its client left) gets nothing: its token was computed for
        a sequence that no longer exists, and is dropped with it. A failure in one sequence's own work fails that
        sequence alone. ``clock`` times it all as ``update`` (detokenizing is the API process's, off this loop)."""
        clock = clock or StepClock()
        outputs = []
        for seq, news in zip(batch.seqs, sampled, strict=True):
            ### BEGIN SOLUTION 10.3
            if seq.status is SequenceStatus.FINISHED:
                continue  # never streamed: it ended before this step's news
            if news.prompt_logprobs is not None:  # echo: this chunk's part of the prompt's logprobs
                seq.prompt_logprobs += news.prompt_logprobs
            if not news.token_ids:
                continue  # a mid-prompt chunk: nothing to say yet
            seq.pending_rows.pop(0)
            self._settle(seq, news)
            ### END SOLUTION
            try:
                outputs.append(self._append(seq, news))
            except Exception as exc:
                outputs.append(self.fail(seq, exc))
        clock.lap("update")
        return outputs

    def _settle(self, seq: Sequence, news: Sampled) -> None:
        """``news`` is the run ``seq`` takes in place of its pending token: take back its rejected guesses (counted as
        computed at launch; the positions after the run hold K/V that the next steps overwrite), record how its
        guesses did, and index the blocks its known, computed tokens now fill."""
        accepted = len(news.token_ids) - 1
        if news.proposed:
            seq.num_computed_tokens = max(0, seq.num_computed_tokens - (news.proposed - accepted))
            self._record_verification(seq, news.proposed, accepted)
            # Neither cache may count a rejected token as computed; the next token's slot is kept.
            seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_computed_tokens)
            self.block_manager.shrink(seq.block_table, seq.num_computed_tokens + 1)
        elif news.reserved:
            # Room was reserved and the proposer had nothing (its text does not recur): as good as a first guess
            # rejected. Counted so, its rate falls and the policy stops reserving room (and calling the proposer)
            # for it, until the drift brings it back; left out, the rate would drift *up* at every such step.
            seq.speculation.record(1, 0)
        else:
            seq.speculation.record(0, 0)  # a step without guesses: its acceptance rate drifts back to the prior
        known = len(seq.prompt_ids) + len(seq.output_ids)  # before the run is appended
        self._index_known(seq, min(seq.num_computed_tokens, known), news.token_ids)

    def _record_verification(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Count a verification: the sequence's own acceptance (what its next guesses are worth), and the engine's."""
        seq.speculation.record(proposed, accepted)
        stats = self.speculation
        self.speculation = SpeculationStats(stats.proposed + proposed, stats.accepted + accepted, stats.runs + 1)

    def _fork(self, seq: Sequence) -> None:
        """Its prefill is done: queue the request's other samples, first in line, to share its prompt blocks."""
        for fork in reversed(seq.forks):
            self.add(fork, first=True)
        seq.forks = []

    def _index_known(self, seq: Sequence, before: int, news: list[int]) -> None:
        """Index the blocks that are full of tokens both computed and known to the host (its prompt, its output and
        ``news``, about to be appended) and were not at ``before`` such tokens. A block whose last token is still on
        the device waits for it: a block is found by its tokens."""
        known = len(seq.prompt_ids) + len(seq.output_ids) + len(news)
        now = min(seq.num_computed_tokens, known)
        block_size = self.block_manager.block_size
        if now // block_size > before // block_size:
            self.block_manager.cache_full_blocks(seq.token_ids + news, seq.block_table, now)

    def _append(self, seq: Sequence, news: Sampled) -> RequestOutput:
        """Add a step's run of tokens to its sequence, as far as the output processor kept it (a run is cut where
        its sequence ends: EOS, max_tokens), and finish the sequence (freeing its blocks) if its
        output says it ended."""
        # The first token comes with the prompt's logprobs, if the request asked (echo), scored over its chunks.
        prompt_logprobs = seq.prompt_logprobs if seq.params.prompt_logprobs is not None and not seq.output_ids else None
        output = self.output_processor.process(seq, news.token_ids, news.logprobs, prompt_logprobs)
        seq.output_ids += output.token_ids
        if output.finished:
            self._finish(seq)  # leaves the batch and frees its blocks at once
        return output

    # --- leaving ----------------------------------------------------------------------------
    def fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End a sequence with an error: it leaves the batch, its blocks return, its client is told."""
        self._finish(seq)
        return RequestOutput.failed(seq.request_id, error, len(seq.prompt_ids), len(seq.output_ids), seq.index)

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Drop a request wherever it is (its client left), or only its sample ``index``; blocks return now."""
        for seq in list(self.sequences.get(request_id, [])):
            if index is None or seq.index == index:
                self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        """A sequence is done (finished, failed, or its client left): it leaves its queue and frees its blocks."""
        samples = self.sequences[seq.request_id]
        samples.remove(seq)
        if not samples:
            del self.sequences[seq.request_id]
        seq.forks = []  # samples never started (it failed or was aborted before its prefill) go with it
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.pending_rows = []  # a token still on the device is dropped when it is read
        seq.status = SequenceStatus.FINISHED
