"""Every distinct scheduler of the course, driven the way its engine drives it (``schedule``, the proposer's
guesses where the stage has them, then ``launched`` and ``postprocess`` with what was sampled), against random
arrivals and a small pool, with the promises checked after every step:

* first come, first served: a waiting sequence is admitted only after every one queued before it;
* the token budget holds (stages without chunking: a prefill may overrun it only alone, to make progress),
  and with chunking, every prompt but the last in a step gets all it has left (or the pool is dry);
* no block is booked twice: each block is held by as many sequences as its count says (one, before the
  prefix cache), and the pool's books balance;
* preemption takes the newest first: no sequence that ran is preempted while a newer one keeps running;
* every token scheduled, guesses included, has its slot in the sequence's blocks;
* in the end everyone finishes and every block is back: nobody starves.

A stage whose scheduler is a byte-identical copy of the previous stage's is the same code, so the test runs
once per version (``changed_stages_with``)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import stage
from .scheduling import finish_step, no_text, reaches_its_last_token
from .stages import changed_stages_with, has

BLOCK_SIZE = 16
K = 3  # guesses per step, where the stage guesses


class Driver:
    """One stage's scheduler, with the engine's side played by hand."""

    def __init__(self, folder: str, num_blocks: int, budget: int, seed: int) -> None:
        self.folder = folder
        self.sequence = stage(folder, "sequence")
        self.sampler = stage(folder, "sampler")
        self.scheduler_module = stage(folder, "scheduler")
        self.blocks = stage(folder, "block_manager").BlockManager(num_blocks, block_size=BLOCK_SIZE)
        self.scheduler = self.scheduler_module.Scheduler(self.blocks, 4, budget, eos_token_ids=set())
        self.budget = budget
        self.random = random.Random(seed)
        self.arrivals = 0
        self.guessed = 0  # guesses checked, where the stage guesses: the test must reach that path

    def add(self, prompt_len: int, max_tokens: int) -> None:
        params = self.sampler.SamplingParams(max_tokens=max_tokens)
        speculates = has(self.folder, "speculation")
        extra = {"speculation": stage(self.folder, "speculative").Speculation(K)} if speculates else {}
        seq = self.sequence.Sequence(f"r{self.arrivals}", list(range(1, prompt_len + 1)), params, generator=None,
                                     **no_text(self.folder), **extra)
        self.scheduler.add(seq)
        self.arrivals += 1

    def step(self) -> None:
        s = self.scheduler
        running_before, waiting_before = list(s.running), list(s.waiting)
        preemptions = s.num_preemptions
        batch = s.schedule()
        self.check_budget(batch)
        self.check_books()
        admitted = [q for q in batch.seqs if q in waiting_before]
        assert admitted == waiting_before[: len(admitted)], "first come, first served"
        if has(self.folder, "chunking"):
            prompts = [q for q in batch.seqs if q.num_scheduled_tokens > 1 or q.num_new_tokens > 1]
            for q in prompts[:-1]:  # every prompt but the last to get tokens got all it had left, or the pool ran dry
                assert q.num_scheduled_tokens >= q.num_new_tokens or self.blocks.num_available == 0
        preempted = [q for q in running_before if q.status is self.sequence.SequenceStatus.WAITING]
        if s.num_preemptions > preemptions:
            for q in batch.seqs:
                if q in running_before:  # the newest give their blocks up, never one older than a sequence that runs
                    assert all(running_before.index(p) > running_before.index(q) for p in preempted), \
                        "an older sequence was preempted while a newer one runs"
        if has(self.folder, "speculation"):
            self.guess(batch)
        for q in batch.seqs:  # every scheduled token (a guess too) has its slot
            scheduled = q.num_scheduled_tokens if has(self.folder, "chunking") else q.num_new_tokens
            assert len(q.block_table) * BLOCK_SIZE >= q.num_computed_tokens + scheduled, "a token without a slot"
        finish_step(s, batch, [self.sampled(q) for q in batch.seqs])
        self.check_books()

    def check_budget(self, batch) -> None:
        if has(self.folder, "chunking"):
            assert batch.num_tokens <= self.budget, "the budget was exceeded"
        elif batch.is_prefill:
            assert batch.num_tokens <= self.budget or len(batch.seqs) == 1, "the budget was exceeded"

    def check_books(self) -> None:
        """Each block is held by as many tables as its count says; the pool's used blocks are exactly those."""
        held: dict[int, int] = {}
        for q in [*self.scheduler.running, *self.scheduler.waiting]:
            for block in q.block_table:
                held[block] = held.get(block, 0) + 1
        if has(self.folder, "prefix_cache"):
            assert all(self.blocks.ref_counts[block] == count for block, count in held.items()), "a miscounted block"
        else:
            assert all(count == 1 for count in held.values()), "a block booked twice"
        assert len(held) == self.blocks.num_used, "the pool's books do not balance"

    def guess(self, batch) -> None:
        """The proposer's part: up to the room reserved, random guesses."""
        seqs = [q for q in batch.seqs if q.num_lookahead_slots]
        proposal = stage(self.folder, "speculative").Proposal
        guesses = [proposal([self.random.randrange(1, 50) for _ in range(self.random.randint(1, room))])
                   for room in (q.num_lookahead_slots for q in seqs)]
        self.guessed += sum(len(g.token_ids) for g in guesses)
        self.scheduler.set_guesses(seqs, guesses)

    def sampled(self, q):
        """What the step chose for ``q``: nothing for a mid-prompt chunk; else a random prefix of its guesses
        (verification's run) and one token of the model's."""
        if not reaches_its_last_token(q):
            return self.scheduler_module.Sampled([], [])
        guesses = list(getattr(q, "draft_ids", []))
        run = guesses[: self.random.randint(0, len(guesses))] + [self.random.randrange(1, 50)]
        return self.scheduler_module.Sampled(run, [None] * len(run))


@pytest.mark.parametrize("folder", changed_stages_with("scheduler"))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(requests=st.lists(st.tuples(st.integers(1, 100), st.integers(1, 12), st.integers(0, 3)), min_size=1,
                         max_size=10),
       budget=st.sampled_from([8, 16, 33]), num_blocks=st.integers(10, 40), seed=st.integers(0, 2**16))
def test_every_scheduler_keeps_its_promises_and_everyone_finishes(folder, requests, budget, num_blocks, seed):
    driver = Driver(folder, num_blocks, budget, seed)
    for prompt_len, max_tokens, gap in requests:
        if prompt_len + max_tokens + K > num_blocks * BLOCK_SIZE:
            continue  # the engine refuses a request that could never fit the pool
        driver.add(prompt_len, max_tokens)
        for _ in range(gap):
            driver.step()
    for _ in range(5000):
        if not driver.scheduler.has_unfinished():
            break
        driver.step()
    assert not driver.scheduler.has_unfinished(), "somebody starved"
    assert driver.blocks.num_used == 0 and driver.scheduler.sequences == {}


@pytest.mark.parametrize("folder", [f for f in changed_stages_with("scheduler") if has(f, "speculation")])
def test_the_driver_reaches_the_guesses(folder):
    """The property test above means something for a speculative scheduler only if its steps carry guesses."""
    driver = Driver(folder, num_blocks=20, budget=16, seed=0)
    driver.add(prompt_len=20, max_tokens=10)
    while driver.scheduler.has_unfinished():
        driver.step()
    assert driver.guessed > 0
