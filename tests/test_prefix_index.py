"""The prefix cache (stage 05): the two prefix indexes, and the block manager that shares, counts and evicts.

``HashIndex`` (a chain of SHA-256 digests) and ``RadixTree`` (a tree of token blocks) must give the
same answers, so one workload drives a block manager on each and their states are compared after
every step. A state machine then checks the pool's bookkeeping against a model of what each block
holds, and a few examples pin down the rules that are easy to get wrong."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from .conftest import stage

block_manager = stage("05_prefix_cache", "block_manager")
prefix_index = stage("05_prefix_cache", "prefix_index")
radix_tree = stage("05_prefix_cache", "radix_tree")

BLOCK_SIZE = 4
INDEXES = {"hash": prefix_index.HashIndex, "radix": radix_tree.RadixTree}
# Beginnings that prompts share, so that lookups hit: whole blocks, and one that ends mid-block.
STEMS = [(), (1, 1, 1, 1), (1, 1, 1, 1, 2, 2, 2, 2), (1, 1, 1, 1, 3, 3), (2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2)]
tokens = st.lists(st.integers(0, 2), max_size=10)  # a small alphabet: tails collide too
prompts = st.builds(lambda stem, tail: [*stem, *tail], st.sampled_from(STEMS), tokens).filter(bool)


def manager(kind: str, num_blocks: int):
    return block_manager.BlockManager(num_blocks, BLOCK_SIZE, INDEXES[kind](BLOCK_SIZE))


def computed(manager, table: list[int], token_ids: list[int]) -> None:
    """The step has run: every token of the sequence is in the cache, and its full blocks are indexed."""
    manager.cache_full_blocks(token_ids, table, len(token_ids))


def admit(manager, token_ids: list[int]) -> list[int] | None:
    """The scheduler's admission: share the cached prefix, take the rest; None when the pool is short."""
    cached = manager.match(token_ids)
    if not manager.can_allocate(cached, len(token_ids)):
        return None
    table: list[int] = []
    manager.allocate(table, cached, len(token_ids))
    return table


# --- a. both indexes, one workload -------------------------------------------------------------------

operations = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 5), prompts),
        st.tuples(st.just("compute"), st.integers(0, 5)),
        st.tuples(st.just("grow"), st.integers(0, 5), st.lists(st.integers(0, 2), min_size=1, max_size=6)),
        st.tuples(st.just("free"), st.integers(0, 5)),
    ),
    min_size=20,
    max_size=80,
)


def state(manager) -> tuple:
    return list(manager.free_blocks), list(manager.evictable), list(manager.ref_counts), len(manager.index)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(3, 12), ops=operations)
def test_hash_index_and_radix_tree_give_the_same_answers(num_blocks, ops):
    """The managers decide only from what their index answers (``match``, ``in``), and both start with
    the same free list, so as long as the indexes agree the managers make the same choices: the same
    block ids, not only the same lengths. A small pool makes evictions frequent."""
    managers = [manager("hash", num_blocks), manager("radix", num_blocks)]
    sequences: dict[int, tuple[list[int], list[list[int]]]] = {}  # slot -> (tokens, [hash table, radix table])
    probes = [list(stem) + [0] for stem in STEMS]  # + [0]: BlockManager.match leaves the last token out
    for op, slot, *args in ops:
        if op == "admit":
            if slot in sequences:  # the slot's sequence finishes, a new request takes its place
                for m, table in zip(managers, sequences.pop(slot)[1], strict=True):
                    m.free(table)
            token_ids = args[0]
            tables = [admit(m, token_ids) for m in managers]
            assert tables[0] == tables[1]
            if tables[0] is not None:
                sequences[slot] = (token_ids, tables)
            probes.append(token_ids)
        elif op == "compute" and slot in sequences:
            token_ids, tables = sequences[slot]
            for m, table in zip(managers, tables, strict=True):
                computed(m, table, token_ids)
        elif op == "grow" and slot in sequences:
            token_ids, tables = sequences[slot]
            longer = token_ids + args[0]
            if all(m.can_grow(table, len(longer)) for m, table in zip(managers, tables, strict=True)):
                for m, table in zip(managers, tables, strict=True):
                    m.grow(table, len(longer))
                sequences[slot] = (longer, tables)
                probes.append(longer)
        elif op == "free" and slot in sequences:
            for m, table in zip(managers, sequences.pop(slot)[1], strict=True):
                m.free(table)
        hashed, radix = managers
        assert state(hashed) == state(radix)
        for _, (hash_table, radix_table) in sequences.values():
            assert hash_table == radix_table
        for probe in probes:
            assert hashed.index.match(probe) == radix.index.match(probe)
            assert hashed.match(probe) == radix.match(probe)
        assert [b in hashed.index for b in range(num_blocks)] == [b in radix.index for b in range(num_blocks)]


# --- b. the block manager's bookkeeping, against a model of the blocks' contents ---------------------


@dataclass
class Live:
    """A sequence the machine is running."""

    token_ids: list[int]
    table: list[int]  # its block table
    num_computed: int  # tokens whose K/V are in its blocks


class PrefixCacheMachine(RuleBasedStateMachine):
    """Sequences come, share cached prefixes, grow and go, on a small pool. The model: ``contents[block]``,
    the whole prefix of tokens up to the end of ``block``, recorded when the block is computed full."""

    index_kind = "hash"

    def __init__(self) -> None:
        super().__init__()
        self.live: list[Live] = []
        self.contents: dict[int, tuple[int, ...]] = {}
        self.fresh_token = 100  # pressure sequences' tokens: never seen before, never shared

    @initialize(num_blocks=st.integers(2, 12))
    def start(self, num_blocks: int) -> None:
        self.manager = manager(self.index_kind, num_blocks)

    def _taken(self, table: list[int], start: int) -> None:
        """``table[start:]`` are new blocks: whatever they held is about to be overwritten."""
        for block in table[start:]:
            self.contents.pop(block, None)

    def _admit(self, token_ids: list[int]) -> None:
        cached = self.manager.match(token_ids)
        if self.manager.can_allocate(cached, len(token_ids)):
            table: list[int] = []
            self.manager.allocate(table, cached, len(token_ids))
            self._taken(table, len(cached))
            self.live.append(Live(token_ids, table, len(cached) * BLOCK_SIZE))

    @rule(token_ids=prompts)
    def allocate(self, token_ids: list[int]) -> None:
        self._admit(token_ids)

    @precondition(lambda self: self.contents)
    @rule(pick=st.integers(0, 1 << 16), tail=tokens)
    def share(self, pick: int, tail: list[int]) -> None:
        """A prompt that starts with a prefix some block holds or held (cached or not)."""
        prefixes = sorted(self.contents.values())
        self._admit([*prefixes[pick % len(prefixes)], *tail, 0])

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1 << 16))
    def compute(self, pick: int) -> None:
        seq = self.live[pick % len(self.live)]
        computed(self.manager, seq.table, seq.token_ids)
        seq.num_computed = len(seq.token_ids)
        for i in range(len(seq.token_ids) // BLOCK_SIZE):  # a shared block keeps its record: an invariant checks it
            self.contents.setdefault(seq.table[i], tuple(seq.token_ids[:(i + 1) * BLOCK_SIZE]))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1 << 16), more=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, pick: int, more: list[int]) -> None:
        """The sequence samples tokens: room for them now, computed (and cached) by a later step."""
        seq = self.live[pick % len(self.live)]
        if self.manager.can_grow(seq.table, len(seq.token_ids) + len(more)):
            before = len(seq.table)
            self.manager.grow(seq.table, len(seq.token_ids) + len(more))
            self._taken(seq.table, before)
            seq.token_ids.extend(more)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1 << 16))
    def free(self, pick: int) -> None:
        self.manager.free(self.live.pop(pick % len(self.live)).table)

    @precondition(lambda self: self.manager.num_available)
    @rule(fraction=st.floats(0, 1), compute=st.booleans())
    def pressure(self, fraction: float, compute: bool) -> None:
        """A sequence of new tokens takes some of what is available (evicting the least recently used
        cached blocks once the free ones are gone), is computed or not, and leaves."""
        num_tokens = max(1, round(fraction * self.manager.num_available)) * BLOCK_SIZE
        token_ids = list(range(self.fresh_token, self.fresh_token + num_tokens))
        self.fresh_token += num_tokens
        table: list[int] = []
        self.manager.allocate(table, [], num_tokens)
        self._taken(table, 0)
        if compute:
            computed(self.manager, table, token_ids)
            for i, block in enumerate(table):
                self.contents[block] = tuple(token_ids[:(i + 1) * BLOCK_SIZE])
        self.manager.free(table)

    # --- invariants ---------------------------------------------------------------------------
    def indexed(self) -> set[int]:
        return {block for block in range(self.manager.num_blocks) if block in self.manager.index}

    def by_prefix(self) -> dict[tuple[int, ...], int]:
        """The indexed blocks by the prefix they hold (a KeyError: an indexed block was never computed)."""
        return {self.contents[block]: block for block in self.indexed()}

    @invariant()
    def counts_match_the_tables(self) -> None:
        m = self.manager
        holders = [0] * m.num_blocks
        for seq in self.live:
            assert len(seq.table) == len(set(seq.table)), "a table holds a block twice"
            for block in seq.table:
                holders[block] += 1
        assert m.ref_counts == holders, "a count is not the number of tables holding the block"
        shared = {block for block, n in enumerate(holders) if n > 1}
        assert shared <= self.indexed(), "a block was handed out twice without being a cached, shared block"

    @invariant()
    def the_pool_adds_up(self) -> None:
        m = self.manager
        used = {block for block, count in enumerate(m.ref_counts) if count > 0}
        free, evictable = list(m.free_blocks), list(m.evictable)
        assert len(free) == len(set(free)), "a block is free twice"
        assert not used & set(free) and not used & set(evictable) and not set(free) & set(evictable)
        assert m.num_used + m.num_evictable + m.num_free == m.num_blocks
        assert used | set(free) | set(evictable) == set(range(m.num_blocks)), "a block leaked"
        indexed = self.indexed()
        assert set(evictable) <= indexed and not set(free) & indexed
        assert len(m.index) == len(indexed)

    @invariant()
    def the_index_finds_what_the_blocks_hold(self) -> None:
        """Every indexed block holds its prefix, its parent's prefix is indexed too (so ``match`` reaches
        it), and ``match`` returns the longest indexed prefix, block by block."""
        indexed = self.by_prefix()
        assert len(indexed) == len(self.indexed()), "two indexed blocks hold the same prefix"
        for prefix in indexed:
            assert len(prefix) == BLOCK_SIZE or prefix[:-BLOCK_SIZE] in indexed, "an indexed block is unreachable"
        probes = [list(prefix) for prefix in indexed] + [seq.token_ids for seq in self.live]
        for probe in probes:
            expected = []
            for end in range(BLOCK_SIZE, len(probe) + 1, BLOCK_SIZE):
                if (block := indexed.get(tuple(probe[:end]))) is None:
                    break
                expected.append(block)
            assert self.manager.index.match(probe) == expected

    @invariant()
    def live_sequences_hold_their_own_prefixes(self) -> None:
        """What a sequence has computed (its own blocks, or the cached ones it shares) is its own tokens."""
        for seq in self.live:
            assert len(seq.table) == self.manager.blocks_needed(len(seq.token_ids))
            for i in range(seq.num_computed // BLOCK_SIZE):
                assert self.contents[seq.table[i]] == tuple(seq.token_ids[:(i + 1) * BLOCK_SIZE])

    @invariant()
    def children_are_evicted_before_their_parents(self) -> None:
        """The release order keeps a cached block's extensions ahead of it in the LRU order, so an evicted
        block never strands cached blocks below it (``RadixTree.evict`` relies on this)."""
        order = {block: i for i, block in enumerate(self.manager.evictable)}
        indexed = self.by_prefix()
        for prefix, block in indexed.items():
            if (parent := indexed.get(prefix[:-BLOCK_SIZE])) in order:
                assert block in order and order[block] < order[parent]


class RadixTreeMachine(PrefixCacheMachine):
    index_kind = "radix"


MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestHashIndexBookkeeping = PrefixCacheMachine.TestCase
TestHashIndexBookkeeping.settings = MACHINE_SETTINGS
TestRadixTreeBookkeeping = RadixTreeMachine.TestCase
TestRadixTreeBookkeeping.settings = MACHINE_SETTINGS


# --- c. examples -----------------------------------------------------------------------------------

both = pytest.mark.parametrize("kind", INDEXES)


@pytest.mark.exercise("5.1")
def test_a_block_is_named_by_sha256_of_its_parents_digest_and_its_token_ids():
    tokens = [1, 2, 3, 70_000]
    first = prefix_index.block_hash(prefix_index.ROOT, tokens)
    assert first == hashlib.sha256(struct.pack("<4I", *tokens)).digest()
    second = prefix_index.block_hash(first, [5, 6, 7, 8])
    assert second == hashlib.sha256(first + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert prefix_index.block_hash(second, tokens) != first  # the same tokens after another prefix: another name


@pytest.mark.exercise("5.2")
@both
def test_a_fully_cached_prompt_still_computes_its_last_token(kind):
    m = manager(kind, 8)
    prompt = list(range(2 * BLOCK_SIZE))
    table = admit(m, prompt)
    computed(m, table, prompt)
    assert m.index.match(prompt) == table  # both blocks are cached...
    assert m.match(prompt) == table[:1]  # ...but the second is recomputed: its last token gives the logits


@pytest.mark.exercise("5.2")
@both
def test_a_prompt_shorter_than_a_block_matches_nothing(kind):
    m = manager(kind, 8)
    prompt = list(range(2 * BLOCK_SIZE))
    computed(m, admit(m, prompt), prompt)
    short = prompt[:BLOCK_SIZE - 1]
    assert m.index.match(short) == [] and m.match(short) == []
    assert m.match(prompt[:BLOCK_SIZE]) == []  # one whole block, but its last token must run
    assert m.index.match(prompt[:BLOCK_SIZE]) == [m.index.match(prompt)[0]]


@pytest.mark.exercise("5.3")
@both
def test_the_least_recently_freed_block_is_evicted_first_and_a_shared_one_is_not(kind):
    m = manager(kind, 4)
    a, b = [1] * 8, [2] * 8
    table_a, table_b = admit(m, a), admit(m, b)
    assert (table_a, table_b) == ([0, 1], [2, 3])
    computed(m, table_a, a)
    computed(m, table_b, b)
    m.free(table_a)
    m.free(table_b)
    assert list(m.evictable) == [1, 0, 3, 2]  # each table from its end: a block before its prefix
    assert admit(m, [9] * 4) == [1]  # a new block: the least recently freed one, forgotten
    assert 1 not in m.index and m.index.match(a) == [0]
    revived = admit(m, b + [9])  # shares 2 and 3 again: they leave the evictable set
    assert revived == [2, 3, 0] and list(m.evictable) == [] and m.ref_counts == [1, 1, 1, 1]
    assert not m.can_allocate([], 1)


@pytest.mark.exercise("5.4")
@both
def test_a_prefix_computed_twice_at_once_is_kept_once_and_the_copy_given_back(kind):
    m = manager(kind, 8)
    prompt = [5] * (2 * BLOCK_SIZE) + [6]
    first, second = admit(m, prompt), admit(m, prompt)  # both admitted before either is computed
    assert first == [0, 1, 2] and second == [3, 4, 5]
    computed(m, first, prompt)
    computed(m, second, prompt)  # the prefix is indexed in 0 and 1 already: the second shares them
    assert second == [0, 1, 5] and m.ref_counts[:2] == [2, 2]
    assert len(m.index) == 2 and sorted(m.free_blocks) == [3, 4, 6, 7]  # its copies are free again
    assert m.match(prompt) == [0, 1]
    m.free(second)
    assert list(m.evictable) == [] and sorted(m.free_blocks) == [3, 4, 5, 6, 7]
    m.free(first)
    assert list(m.evictable) == [1, 0] and 2 in m.free_blocks


@pytest.mark.exercise("5.5")
@both
def test_reviving_evictable_blocks_takes_them_from_the_pool(kind):
    """The only blocks left are evictable, and they hold the request's own prefix: sharing them takes them out
    of the pool, so they cannot also be its new blocks."""
    m = manager(kind, 4)
    a, b = [1] * 8, [2] * 8
    table_a, table_b = admit(m, a), admit(m, b)
    computed(m, table_a, a)
    m.free(table_a)  # 0 and 1: evictable and still found; b holds 2 and 3
    assert list(m.evictable) == [1, 0] and m.num_free == 0 and table_b == [2, 3]
    longer = a + [3]  # three blocks: shares 0 and 1, and needs one more
    assert m.match(longer) == [0, 1]
    before = state(m)
    assert not m.can_allocate([0, 1], len(longer))  # 1 new + 2 revived, and 2 available
    assert state(m) == before, "can_allocate only counts: it takes nothing"
    assert m.match(a) == [0]  # the last block of a is computed again
    assert m.can_allocate([0], len(a))  # 1 new + 1 revived: exactly the 2 available
    table: list[int] = []
    m.allocate(table, [0], len(a))
    assert table == [0, 1] and m.num_available == 0  # the new block: 1, evicted


@pytest.mark.exercise("5.5")
@both
def test_a_cached_block_in_use_costs_nothing_new(kind):
    """Sharing a block that another sequence holds takes nothing from the pool."""
    m = manager(kind, 4)
    a = [1] * 8
    computed(m, admit(m, a), a)  # a holds 0 and 1, both indexed
    longer = a + [4] * 8  # four blocks: shares 0 and 1, and needs 2 more
    assert m.match(longer) == [0, 1] and m.num_available == 2
    assert m.can_allocate([0, 1], len(longer))  # 2 new: exactly the 2 available
    assert not m.can_allocate([0, 1], len(longer) + 1)  # one token more: a third new block
    table: list[int] = []
    m.allocate(table, [0, 1], len(longer))
    assert table == [0, 1, 2, 3] and m.ref_counts == [2, 2, 1, 1] and m.num_available == 0


@pytest.mark.exercise("5.5")
@both
def test_a_prefix_half_in_use_half_evictable_is_counted_block_by_block(kind):
    """A cached prefix whose first blocks another sequence holds (free to share) and whose last is evictable
    (it costs one block of the pool), with one block free."""
    m = manager(kind, 5)
    a = [1] * 4 + [2] * 4 + [3] * 4
    table_a = admit(m, a)
    computed(m, table_a, a)  # 0, 1, 2
    other = admit(m, a[:8] + [7])  # shares 0 and 1, takes 3
    m.free(table_a)  # 2 is evictable, 0 and 1 are still held by the other
    assert other == [0, 1, 3] and list(m.evictable) == [2] and list(m.free_blocks) == [4]
    five_blocks, four_blocks = a + [5] * 4 + [6], a + [6]
    assert m.match(five_blocks) == m.match(four_blocks) == [0, 1, 2]
    assert not m.can_allocate([0, 1, 2], len(five_blocks))  # 2 new + 1 revived, and 2 available
    assert m.can_allocate([0, 1, 2], len(four_blocks))  # 1 new + 1 revived: exactly the 2 available
    table: list[int] = []
    m.allocate(table, [0, 1, 2], len(four_blocks))
    assert table == [0, 1, 2, 4] and m.ref_counts == [2, 2, 1, 1, 1] and m.num_available == 0


@both
def test_the_blocks_after_a_shared_copy_are_indexed_under_it(kind):
    m = manager(kind, 12)
    prompt = list(range(2 * BLOCK_SIZE))
    one, two = prompt + [50] * BLOCK_SIZE + [1], prompt + [60] * BLOCK_SIZE + [1]
    first, second = admit(m, one), admit(m, two)
    computed(m, first, one)
    computed(m, second, two)
    assert second[:2] == first[:2]  # one copy of the common prefix
    assert m.index.match(two) == second[:3]  # and the second's own block, indexed after it


def test_a_radix_tree_shares_the_path_of_a_common_prefix():
    tree = radix_tree.RadixTree(BLOCK_SIZE)
    tree.insert([1, 1, 1, 1, 2, 2, 2, 2], [7, 2])
    tree.insert([1, 1, 1, 1, 3, 3, 3, 3, 4], [7, 5])
    assert len(tree) == 3 and len(tree.root.children) == 1 and len(tree.node_of[7].children) == 2
    assert tree.match([1, 1, 1, 1, 3, 3, 3, 3, 4, 4, 4, 4]) == [7, 5]
    tree.evict(7)  # never an inner node under the block manager; if it were, its subtree goes with it
    assert len(tree) == 0 and tree.match([1, 1, 1, 1, 2, 2, 2, 2]) == [] and tree.root.children == {}
