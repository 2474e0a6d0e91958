"""The block manager (stage 03 on): blocks are handed out one at a time, never twice, and all come back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import stage
from .stages import graded_first, stages_with

STAGES = stages_with("block_manager")


@pytest.fixture(scope="module", params=STAGES)
def bm(request):
    return stage(request.param, "block_manager")


def graded(exercise: str) -> pytest.MarkDecorator:
    """Run on every stage; the first (03, which introduces the block manager) grades ``exercise``."""
    return pytest.mark.parametrize("bm", graded_first(STAGES, exercise), indirect=True)


@graded("3.1")
def test_grow_takes_a_block_only_when_the_last_one_is_full(bm):
    manager = bm.BlockManager(num_blocks=4, block_size=16)
    table: list[int] = []
    manager.grow(table, 1)
    assert len(table) == 1 and manager.num_free == 3
    manager.grow(table, 16)
    assert len(table) == 1  # 16 tokens still fit in one block
    manager.grow(table, 17)
    assert len(table) == 2 and manager.num_used == 2
    assert len(set(table)) == 2


@graded("3.1")
def test_grow_is_all_or_nothing(bm):
    manager = bm.BlockManager(num_blocks=3, block_size=16)
    table: list[int] = []
    manager.grow(table, 20)
    assert not manager.can_grow(table, 16 * 4)
    with pytest.raises(bm.NoFreeBlocks):
        manager.grow(table, 16 * 4)  # needs 2 more, 1 free
    assert len(table) == 2 and manager.num_free == 1  # nothing was taken
    manager.grow(table, 16 * 3)
    assert manager.num_free == 0


@graded("3.1")
def test_free_returns_every_block(bm):
    manager = bm.BlockManager(num_blocks=8, block_size=16)
    a: list[int] = []
    b: list[int] = []
    manager.grow(a, 40)
    manager.grow(b, 10)
    manager.free(a)
    assert a == [] and manager.num_free == 7
    manager.free(b)
    assert manager.num_free == 8


@graded("3.2")
def test_slot_mapping_follows_the_block_table(bm):
    manager = bm.BlockManager(num_blocks=8, block_size=4)
    table = [5, 2, 7]  # blocks need not be contiguous, or in order
    assert bm.token_slots(table, manager.block_size, 0, 4) == [20, 21, 22, 23]
    assert bm.token_slots(table, manager.block_size, 3, 6) == [23, 8, 9]  # crosses from block 5 into block 2
    assert bm.token_slots(table, manager.block_size, 9, 10) == [29]  # one decode token: block 7, offset 1
    assert bm.token_slots(table, manager.block_size, 6, 6) == []


@graded("3.2")
def test_slot_mapping_gives_each_position_its_own_slot(bm):
    manager = bm.BlockManager(num_blocks=16, block_size=16)
    a: list[int] = []
    b: list[int] = []
    manager.grow(a, 70)
    manager.grow(b, 33)
    slots = bm.token_slots(a, manager.block_size, 0, 70) + bm.token_slots(b, manager.block_size, 0, 33)
    assert len(set(slots)) == len(slots)
    assert all(slot // 16 in a for slot in slots[:70]) and all(slot // 16 in b for slot in slots[70:])


# --- property: random allocate / append / free -----------------------------------------------------

operations = st.lists(
    st.tuples(st.sampled_from(["new", "append", "free"]), st.integers(0, 7), st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 4, 16]), ops=operations)
def test_random_use_never_double_books_or_leaks(bm, num_blocks, block_size, ops):
    manager = bm.BlockManager(num_blocks, block_size)
    sequences: dict[int, tuple[list[int], int]] = {}  # id -> (block table, tokens)
    for op, seq, amount in ops:
        if op == "new" and seq not in sequences:
            table: list[int] = []
            if manager.can_grow(table, amount):
                manager.grow(table, amount)
                sequences[seq] = (table, amount)
            else:
                with pytest.raises(bm.NoFreeBlocks):
                    manager.grow(table, amount)
                assert table == []
        elif op == "append" and seq in sequences:
            table, tokens = sequences[seq]
            before = list(table)
            try:
                manager.grow(table, tokens + amount)
                sequences[seq] = (table, tokens + amount)
            except bm.NoFreeBlocks:
                assert table == before  # all or nothing
        elif op == "free" and seq in sequences:
            table, _ = sequences.pop(seq)
            manager.free(table)
        # Invariants after every operation.
        held = [block for table, _ in sequences.values() for block in table]
        assert len(held) == len(set(held)), "a block is owned twice"
        assert not set(held) & set(manager.free_blocks), "a block is both owned and free"
        assert len(held) + manager.num_free == num_blocks, "a block leaked"
        for table, tokens in sequences.values():
            assert len(table) == manager.blocks_needed(tokens)
    for table, _ in sequences.values():
        manager.free(table)
    assert sorted(manager.free_blocks) == list(range(num_blocks))
