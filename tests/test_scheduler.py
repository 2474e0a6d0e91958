"""The stage 04 scheduler, without a model: admission within the limits, first come first served,
preemption of the newest when the pool runs dry, and the ragged batch tensors of a prefill."""

from __future__ import annotations

import pytest
import torch

from .conftest import stage

scheduler_mod = stage("04_continuous_batching", "scheduler")
sequence_mod = stage("04_continuous_batching", "sequence")
block_manager_mod = stage("04_continuous_batching", "block_manager")
Status = sequence_mod.SequenceStatus


def seq(name: str, prompt_len: int, outputs: int = 0):
    """A sequence the scheduler can handle; it never samples or detokenizes, so those are left out."""
    params = stage("04_continuous_batching", "sampler").SamplingParams(max_tokens=1000)
    s = sequence_mod.Sequence(name, list(range(prompt_len)), params, generator=None, detokenizer=None)
    s.output_ids = list(range(outputs))
    return s


def make(num_blocks: int = 100, max_num_seqs: int = 8, max_num_batched_tokens: int = 256):
    blocks = block_manager_mod.BlockManager(num_blocks, block_size=16)
    return scheduler_mod.Scheduler(blocks, max_num_seqs, max_num_batched_tokens), blocks


def names(batch) -> list[str]:
    return [s.request_id for s in batch.seqs]


@pytest.mark.exercise("4.1")
def test_a_prefill_admits_what_fits_the_token_budget():
    scheduler, blocks = make(max_num_batched_tokens=250)
    for name in "abc":
        scheduler.add(seq(name, 100))
    batch = scheduler.schedule()
    assert batch.is_prefill and names(batch) == ["a", "b"] and batch.num_tokens == 200
    assert blocks.num_used == 2 * 7  # 100 tokens = 7 blocks each
    assert [s.request_id for s in scheduler.waiting] == ["c"]
    assert names(scheduler.schedule()) == ["c"]  # the next step admits the rest


@pytest.mark.exercise("4.1")
def test_admission_stops_at_max_num_seqs_then_everyone_decodes():
    scheduler, _ = make(max_num_seqs=3)
    for i in range(5):
        scheduler.add(seq(f"r{i}", 10))
    assert names(scheduler.schedule()) == ["r0", "r1", "r2"]
    batch = scheduler.schedule()
    assert not batch.is_prefill and names(batch) == ["r0", "r1", "r2"] and batch.num_tokens == 3
    assert len(scheduler.waiting) == 2


@pytest.mark.exercise("4.1")
def test_first_come_first_served_nobody_overtakes_a_request_that_does_not_fit():
    scheduler, blocks = make(num_blocks=10)
    scheduler.add(seq("old", 100))  # 7 blocks
    assert names(scheduler.schedule()) == ["old"]
    scheduler.add(seq("long", 100))  # needs 7, only 3 free
    scheduler.add(seq("short", 10))  # would fit, but arrived later
    batch = scheduler.schedule()
    assert not batch.is_prefill and names(batch) == ["old"]
    assert [s.request_id for s in scheduler.waiting] == ["long", "short"]


@pytest.mark.exercise("4.1")
def test_a_prompt_longer_than_the_budget_runs_alone():
    scheduler, _ = make(max_num_batched_tokens=64)
    scheduler.add(seq("huge", 200))
    scheduler.add(seq("next", 10))
    assert names(scheduler.schedule()) == ["huge"]
    assert names(scheduler.schedule()) == ["next"]


@pytest.mark.exercise("4.1")
def test_no_starvation_under_a_stream_of_short_requests():
    """A long request waiting for blocks gets them once the earlier ones finish, though short ones keep arriving."""
    scheduler, blocks = make(num_blocks=12, max_num_seqs=4)
    for i in range(3):
        scheduler.add(seq(f"short{i}", 40))  # 3 blocks each
    scheduler.schedule()
    scheduler.add(seq("long", 150))  # 10 blocks: must wait for all three
    for step in range(20):
        scheduler.add(seq(f"late{step}", 8))
        batch = scheduler.schedule()
        if "long" in names(batch):
            break
        for s in list(scheduler.running):  # every running request finishes after one step
            scheduler.finish(s)
    else:
        pytest.fail("the long request never ran")
    assert names(batch)[0] == "long"  # first in its step: every later arrival queued behind it


@pytest.mark.exercise("4.2")
def test_the_newest_sequence_is_preempted_when_the_pool_runs_dry():
    scheduler, blocks = make(num_blocks=4)
    for name in "ab":
        scheduler.add(seq(name, 32))  # 2 full blocks each: the pool is full
    assert names(scheduler.schedule()) == ["a", "b"]
    for s in scheduler.running:
        s.output_ids.append(0)  # each sampled a token: the next decode needs a third block each
    batch = scheduler.schedule()
    assert names(batch) == ["a"]  # the oldest goes on, with the blocks the newest gave back
    b = scheduler.waiting[0]
    assert b.request_id == "b" and b.status is Status.WAITING and b.block_table == [] and b.num_preemptions == 1
    assert scheduler.num_preemptions == 1
    assert blocks.num_used == 3 and len(scheduler.running) == 1


@pytest.mark.exercise("4.2")
def test_preempted_sequences_queue_in_their_old_order_ahead_of_new_ones():
    scheduler, blocks = make(num_blocks=6)
    for name in "abc":
        scheduler.add(seq(name, 32))  # 2 blocks each: the pool is full
    scheduler.schedule()
    scheduler.add(seq("new", 4))
    scheduler.running[0].output_ids.extend(range(33))  # a now needs 5 blocks: 3 more than it holds
    assert names(scheduler.schedule()) == ["a"]  # c, then b, gave their blocks back
    assert [s.request_id for s in scheduler.waiting] == ["b", "c", "new"]
    assert scheduler.num_preemptions == 2 and blocks.num_used == 5


@pytest.mark.exercise("4.2")
def test_a_lone_sequence_that_cannot_grow_waits_instead_of_failing():
    scheduler, blocks = make(num_blocks=2)
    scheduler.add(seq("a", 32))
    scheduler.schedule()
    scheduler.running[0].output_ids.append(0)
    batch = scheduler.schedule()
    assert names(batch) == [] and [s.request_id for s in scheduler.waiting] == ["a"] and blocks.num_used == 0


def test_finish_frees_the_blocks_from_either_queue():
    scheduler, blocks = make(num_blocks=8, max_num_seqs=1)
    a, b = seq("a", 20), seq("b", 20)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    scheduler.finish(b)  # still waiting
    scheduler.finish(a)  # running
    assert not scheduler.has_unfinished() and blocks.num_used == 0
    assert a.status is Status.FINISHED and b.status is Status.FINISHED


@pytest.mark.exercise("4.3")
def test_prepare_prefill_lays_prompts_end_to_end():
    runner_mod = stage("04_continuous_batching", "model_runner")
    blocks = block_manager_mod.BlockManager(10, block_size=16)
    runner = runner_mod.ModelRunner(model=None, kv_cache=None, block_manager=blocks, device=torch.device("cpu"))
    a, b = seq("a", 3), seq("b", 18, outputs=2)  # b was preempted after two tokens: it recomputes 20
    blocks.grow(a.block_table, 3)
    blocks.grow(b.block_table, 20)
    input_ids, positions, meta = runner.prepare_prefill([a, b])
    assert input_ids.tolist() == a.token_ids + b.token_ids
    assert positions.tolist() == [0, 1, 2, *range(20)]
    assert meta.cu_seqlens.tolist() == [0, 3, 23] and meta.max_seqlen == 20 and meta.is_prefill
    assert meta.context_lens.tolist() == [3, 20]
    assert meta.slot_mapping.tolist() == blocks.slot_mapping(a.block_table, 0, 3) + blocks.slot_mapping(
        b.block_table, 0, 20)
    assert meta.block_tables.tolist() == [a.block_table + [0], b.block_table]
