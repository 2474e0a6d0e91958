"""The stage 04 scheduler, without a model: admission within the limits, first come first served,
preemption of the newest when the pool runs dry, and the ragged batch tensors of a prefill. (Stage 06
replaces the step that is a prefill or a decode by a token budget: tests/test_06_chunked_prefill.py.)"""

from __future__ import annotations

import pytest
import torch

from . import scheduling
from .conftest import stage
from .scheduling import no_text
from .stages import graded_first, has, stages_with

STAGES = [folder for folder in stages_with("scheduler") if not has(folder, "chunking")]  # a step: prefill or decode


@pytest.fixture(params=STAGES)
def folder(request) -> str:
    return request.param


def graded(exercise: str) -> pytest.MarkDecorator:
    """Run on every stage; the first (04, which introduces the scheduler) grades ``exercise``."""
    return pytest.mark.parametrize("folder", graded_first(STAGES, exercise), indirect=True)


class Stage:
    """The modules of one stage that these tests use."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.scheduler = stage(folder, "scheduler")
        self.sequence = stage(folder, "sequence")
        self.block_manager = stage(folder, "block_manager")
        self.sampler = stage(folder, "sampler")
        self.model_runner = stage(folder, "model_runner")


@pytest.fixture
def mods(folder) -> Stage:
    return Stage(folder)


def seq(mods: Stage, name: str, prompt_len: int, outputs: int = 0):
    """A sequence the scheduler can handle; it never samples or detokenizes, so those are left out."""
    params = mods.sampler.SamplingParams(max_tokens=1000)
    s = mods.sequence.Sequence(name, list(range(prompt_len)), params, generator=None, **no_text(mods.folder))
    s.output_ids = list(range(outputs))
    return s


def make(mods: Stage, num_blocks: int = 100, max_num_seqs: int = 8, max_num_batched_tokens: int = 256):
    blocks = mods.block_manager.BlockManager(num_blocks, block_size=16)
    return mods.scheduler.Scheduler(blocks, max_num_seqs, max_num_batched_tokens, eos_token_ids=set()), blocks


def names(batch) -> list[str]:
    return [s.request_id for s in batch.seqs]


def run(mods: Stage, scheduler, batch) -> None:
    """The step has run: ``launched`` and ``postprocess`` give every sequence of the batch one more token (0)."""
    scheduling.run(scheduler, mods.scheduler, batch)


@graded("4.1")
def test_a_prefill_admits_what_fits_the_token_budget(mods):
    scheduler, blocks = make(mods, max_num_batched_tokens=250)
    for name in "abc":
        scheduler.add(seq(mods, name, 100))
    batch = scheduler.schedule()
    assert batch.is_prefill and names(batch) == ["a", "b"] and batch.num_tokens == 200
    assert blocks.num_used == 2 * 7  # 100 tokens = 7 blocks each
    assert [s.request_id for s in scheduler.waiting] == ["c"]
    assert names(scheduler.schedule()) == ["c"]  # the next step admits the rest


@graded("4.1")
def test_admission_stops_at_max_num_seqs_then_everyone_decodes(mods):
    scheduler, _ = make(mods, max_num_seqs=3)
    for i in range(5):
        scheduler.add(seq(mods, f"r{i}", 10))
    prefill = scheduler.schedule()
    assert names(prefill) == ["r0", "r1", "r2"] and prefill.num_tokens == 30
    run(mods, scheduler, prefill)
    batch = scheduler.schedule()
    assert not batch.is_prefill and names(batch) == ["r0", "r1", "r2"] and batch.num_tokens == 3
    assert len(scheduler.waiting) == 2


@graded("4.1")
def test_first_come_first_served_nobody_overtakes_a_request_that_does_not_fit(mods):
    scheduler, blocks = make(mods, num_blocks=10)
    scheduler.add(seq(mods, "old", 100))  # 7 blocks
    assert names(scheduler.schedule()) == ["old"]
    scheduler.add(seq(mods, "long", 100))  # needs 7, only 3 free
    scheduler.add(seq(mods, "short", 10))  # would fit, but arrived later
    batch = scheduler.schedule()
    assert not batch.is_prefill and names(batch) == ["old"]
    assert [s.request_id for s in scheduler.waiting] == ["long", "short"]


@graded("4.1")
def test_a_prompt_longer_than_the_budget_runs_alone(mods):
    scheduler, _ = make(mods, max_num_batched_tokens=64)
    scheduler.add(seq(mods, "huge", 200))
    scheduler.add(seq(mods, "next", 10))
    assert names(scheduler.schedule()) == ["huge"]
    assert names(scheduler.schedule()) == ["next"]


@graded("4.1")
def test_no_starvation_under_a_stream_of_short_requests(mods):
    """A long request waiting for blocks gets them once the earlier ones finish, though short ones keep arriving."""
    scheduler, blocks = make(mods, num_blocks=12, max_num_seqs=4)
    for i in range(3):
        scheduler.add(seq(mods, f"short{i}", 40))  # 3 blocks each
    scheduler.schedule()
    scheduler.add(seq(mods, "long", 150))  # 10 blocks: must wait for all three
    for step in range(20):
        scheduler.add(seq(mods, f"late{step}", 8))
        batch = scheduler.schedule()
        if "long" in names(batch):
            break
        for s in list(scheduler.running):  # every running request finishes after one step
            scheduler.abort(s.request_id)
    else:
        pytest.fail("the long request never ran")
    assert names(batch)[0] == "long"  # first in its step: every later arrival queued behind it


@graded("4.2")
def test_the_newest_sequence_is_preempted_when_the_pool_runs_dry(mods):
    scheduler, blocks = make(mods, num_blocks=4)
    for name in "ab":
        scheduler.add(seq(mods, name, 32))  # 2 full blocks each: the pool is full
    assert names(scheduler.schedule()) == ["a", "b"]
    for s in scheduler.running:
        s.output_ids.append(0)  # each sampled a token: the next decode needs a third block each
    batch = scheduler.schedule()
    assert names(batch) == ["a"]  # the oldest goes on, with the blocks the newest gave back
    b = scheduler.waiting[0]
    assert b.request_id == "b" and b.status is mods.sequence.SequenceStatus.WAITING
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1
    assert blocks.num_used == 3 and len(scheduler.running) == 1


@graded("4.2")
def test_preempted_sequences_queue_in_their_old_order_ahead_of_new_ones(mods):
    scheduler, blocks = make(mods, num_blocks=6)
    for name in "abc":
        scheduler.add(seq(mods, name, 32))  # 2 blocks each: the pool is full
    scheduler.schedule()
    scheduler.add(seq(mods, "new", 4))
    scheduler.running[0].output_ids.extend(range(33))  # a now needs 5 blocks: 3 more than it holds
    assert names(scheduler.schedule()) == ["a"]  # c, then b, gave their blocks back
    assert [s.request_id for s in scheduler.waiting] == ["b", "c", "new"]
    assert scheduler.num_preemptions == 2 and blocks.num_used == 5


@graded("4.2")
def test_a_lone_sequence_that_cannot_grow_waits_instead_of_failing(mods):
    scheduler, blocks = make(mods, num_blocks=2)
    scheduler.add(seq(mods, "a", 32))
    scheduler.schedule()
    scheduler.running[0].output_ids.append(0)
    batch = scheduler.schedule()
    assert names(batch) == [] and [s.request_id for s in scheduler.waiting] == ["a"] and blocks.num_used == 0


def test_finish_frees_the_blocks_from_either_queue(mods):
    scheduler, blocks = make(mods, num_blocks=8, max_num_seqs=1)
    a, b = seq(mods, "a", 20), seq(mods, "b", 20)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    scheduler.abort(b.request_id)  # still waiting
    scheduler.abort(a.request_id)  # running
    assert not scheduler.has_unfinished() and blocks.num_used == 0
    assert a.status is mods.sequence.SequenceStatus.FINISHED and b.status is mods.sequence.SequenceStatus.FINISHED


@graded("4.3")
def test_prepare_lays_each_sequences_new_tokens_end_to_end(mods):
    runner_mod = mods.model_runner
    blocks = mods.block_manager.BlockManager(10, block_size=16)
    runner = runner_mod.ModelRunner(model=None, kv_cache=None, block_size=blocks.block_size, device=torch.device("cpu"))
    a, b = seq(mods, "a", 3), seq(mods, "b", 18, outputs=2)  # b was preempted after two tokens: it recomputes 20
    blocks.grow(a.block_table, 3)
    blocks.grow(b.block_table, 20)
    step = runner.prepare(mods.scheduler.Batch([a, b], is_prefill=True))
    assert step.input_ids == a.token_ids + b.token_ids
    assert step.positions == [0, 1, 2, *range(20)]
    assert step.query_start_loc == [0, 3, 23] and step.seq_lens == [3, 20]
    slots = mods.block_manager.token_slots
    assert step.slot_mapping == slots(a.block_table, 16, 0, 3) + slots(b.block_table, 16, 0, 20)
    assert step.block_tables == [a.block_table + [0], b.block_table]
    assert step.logits_indices == [2, 22]  # each sequence's last token predicts its next one
    assert step.prompt_logits_indices == [] and step.num_prompt_logits == [0, 0]


@graded("4.3")
def test_prepare_starts_each_sequence_after_its_cached_tokens(mods):
    """A decode is the same step with one new token; a sequence with cached tokens adds only the rest."""
    runner_mod = mods.model_runner
    blocks = mods.block_manager.BlockManager(10, block_size=16)
    runner = runner_mod.ModelRunner(model=None, kv_cache=None, block_size=blocks.block_size, device=torch.device("cpu"))
    a, b = seq(mods, "a", 17, outputs=1), seq(mods, "b", 40)
    a.num_computed_tokens, b.num_computed_tokens = 17, 32  # a decodes its 18th token; b extends 32 cached by 8
    blocks.grow(a.block_table, 18)
    blocks.grow(b.block_table, 40)
    step = runner.prepare(mods.scheduler.Batch([a, b], is_prefill=False))
    assert step.input_ids == [a.output_ids[-1], *b.prompt_ids[32:]]
    assert step.positions == [17, *range(32, 40)]
    assert step.query_start_loc == [0, 1, 9] and step.seq_lens == [18, 40] and step.logits_indices == [0, 8]
    slots = mods.block_manager.token_slots
    assert step.slot_mapping == slots(a.block_table, 16, 17, 18) + slots(b.block_table, 16, 32, 40)


def test_a_prompt_that_asks_for_prompt_logprobs_gets_its_rows_scored(mods):
    runner_mod = mods.model_runner
    blocks = mods.block_manager.BlockManager(10, block_size=16)
    runner = runner_mod.ModelRunner(model=None, kv_cache=None, block_size=blocks.block_size, device=torch.device("cpu"))
    a, b = seq(mods, "a", 3), seq(mods, "b", 5)
    b.params.prompt_logprobs = 2
    for s in (a, b):
        blocks.grow(s.block_table, s.num_tokens)
    step = runner.prepare(mods.scheduler.Batch([a, b], is_prefill=True))
    assert step.prompt_logits_indices == [3, 4, 5, 6] and step.num_prompt_logits == [0, 4]  # rows 0..3 of b


@pytest.mark.parametrize("folder", stages_with("scheduler"))
def test_the_output_processor_decides_the_end_and_leaves_the_sequence_to_the_scheduler(folder):
    """The output processor reads a sequence's new tokens and says where it ends (EOS, ``max_tokens``; a run is
    cut at its end from stage 08 on) without changing the sequence: appending is the scheduler's alone."""
    mods = Stage(folder)
    processor = stage(folder, "output_processor").OutputProcessor(eos_token_ids={7})
    s = mods.sequence.Sequence("a", [1, 2, 3], mods.sampler.SamplingParams(max_tokens=4), generator=None,
                               **no_text(folder))
    s.output_ids = [4, 5]
    going = processor.process(s, [6], [None], None)
    assert (going.token_ids, going.finish_reason, going.completion_tokens) == ([6], None, 3)
    assert (processor.process(s, [7], [None], None).finish_reason, s.output_ids) == ("stop", [4, 5])
    s.output_ids = [4, 5, 6]
    assert processor.process(s, [8], [None], None).finish_reason == "length"
    if has(folder, "speculation"):  # a run: what follows its end is neither kept nor counted
        s.output_ids = [4]
        cut = processor.process(s, [6, 7, 8], [None] * 3, None)
        assert (cut.token_ids, cut.finish_reason, cut.completion_tokens, s.output_ids) == ([6, 7], "stop", 3, [4])
