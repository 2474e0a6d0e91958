"""The block manager with a prefix cache: blocks are shared, counted, and kept after use.

The pool is a fixed number of blocks of ``block_size`` token slots. A sequence owns a *block table*,
the list of its block ids in token order; its token at position p lives in block
``block_table[p // block_size]`` at offset ``p % block_size``. A sequence asks for one more block
only when its last one is full.

Three things make a block's contents outlive the sequence that computed them:

* **Sharing.** Each full block that a sequence has computed is entered in a prefix index (see
  ``prefix_index.py``). A new sequence whose tokens start the same way *shares* those blocks: its
  block table points at them, and it computes only the rest.
* **Reference counts.** A block counts the sequences whose tables hold it. Freeing a sequence
  lowers the counts; a block is only reusable when its count is 0.
* **Eviction.** A block whose count drops to 0 keeps its contents. If it is indexed it joins the
  *evictable* set, least recently used first, and can still be found and shared. A new allocation
  takes a truly free block first, and only then evicts the least recently used evictable one
  (which leaves the index: its contents are about to be overwritten).

So the pool is always ``used (count > 0) + evictable (count 0, indexed) + free (count 0, not)``.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from .prefix_index import PrefixIndex


class NoFreeBlocks(RuntimeError):
    """The pool has no block left to give."""


def token_slots(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The cache slot of each token position in ``[start, end)``: block id * block_size + offset. (A function,
    not a method: the model runner needs only the block size to place tokens, never the pool itself.)"""
    ### BEGIN SOLUTION 3.2
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    ### END SOLUTION


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, index: PrefixIndex | None = None) -> None:
        assert num_blocks > 0 and block_size > 0
        assert index is None or index.block_size == block_size
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.index = index  # None: the prefix cache is off, and freed blocks are simply free
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # count 0, holding nothing findable
        self.evictable: OrderedDict[int, None] = OrderedDict()  # count 0, indexed: least recently used first

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_evictable(self) -> int:
        return len(self.evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: the free ones, then the evictable ones."""
        return self.num_free + self.num_evictable

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    @property
    def num_cached(self) -> int:
        """Blocks in the prefix index, shared or evictable."""
        return 0 if self.index is None else len(self.index)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: the ceiling of num_tokens / block_size."""
        return -(-num_tokens // self.block_size)

    # --- the prefix cache --------------------------------------------------------------------
    def match(self, token_ids: list[int]) -> list[int]:
        """The cached blocks of the longest known prefix of ``token_ids``, leaving at least its last token
        to compute: the step must run that token to get the logits that sample the next one."""
        if self.index is None:
            return []
        return self.index.match(token_ids[:len(token_ids) - 1])

    def cache_full_blocks(self, token_ids: list[int], block_table: list[int], num_computed_tokens: int) -> None:
        """Index the blocks whose every token is now computed (in the cache): others may share them.

        Sequences admitted in the same step all miss, and may compute the same prefix (a system prompt)
        side by side. The first to be indexed keeps it; each later one swaps its copy for the indexed
        block and gives the copy back, so that one block holds the prefix and what follows is indexed
        under it."""
        if self.index is None:
            return
        num_full = num_computed_tokens // self.block_size
        held = self.index.insert(token_ids[:num_full * self.block_size], block_table[:num_full])
        for i, block in enumerate(held):
            if block != block_table[i]:
                self._share(block)
                self._release(block_table[i])
                block_table[i] = block

    # --- taking and giving back blocks ---------------------------------------------------------
    def can_allocate(self, cached: list[int], num_tokens: int) -> bool:
        """Whether a sequence that shares ``cached`` can be given room for ``num_tokens`` tokens now.

        Only the blocks it must really allocate count, plus the shared ones that are evictable now:
        sharing takes those out of the evictable set, so they can no longer be given to others."""
        ### BEGIN SOLUTION 5.5
        revived = sum(1 for block in cached if self.ref_counts[block] == 0)
        return self.blocks_needed(num_tokens) - len(cached) + revived <= self.num_available
        ### END SOLUTION

    def allocate(self, block_table: list[int], cached: list[int], num_tokens: int) -> None:
        """Share ``cached`` (each count + 1), then add new blocks up to ``num_tokens`` tokens."""
        assert not block_table, "a sequence is allocated once, when it is admitted"
        assert self.can_allocate(cached, num_tokens), "check can_allocate first"
        for block in cached:
            self._share(block)
            block_table.append(block)
        self.grow(block_table, num_tokens)

    def _share(self, block: int) -> None:
        """One more table holds the indexed ``block``; if nobody did, it is no longer evictable."""
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Whether a sequence holding ``block_table`` can grow to ``num_tokens`` tokens right now."""
        return self.blocks_needed(num_tokens) - len(block_table) <= self.num_available

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append new blocks to ``block_table`` until it holds ``num_tokens`` tokens.

        All or nothing: if the pool cannot cover the growth, raise NoFreeBlocks and take no block.
        """
        ### BEGIN SOLUTION 3.1
        missing = self.blocks_needed(num_tokens) - len(block_table)
        if missing > self.num_available:
            raise NoFreeBlocks(f"{missing} more blocks needed, {self.num_available} available")
        for _ in range(missing):
            block_table.append(self._new_block())
        ### END SOLUTION

    def shrink(self, block_table: list[int], num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens, newest first (the blocks that only
        rejected guesses were written to). They were never indexed: only full, computed blocks are."""
        while len(block_table) > self.blocks_needed(num_tokens):
            self._release(block_table.pop())

    def _new_block(self) -> int:
        """A block for new contents, its count 1: a free one if any, else the least recently used evictable one."""
        ### BEGIN SOLUTION 5.3
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            assert self.index is not None
            self.index.evict(block)  # its contents are about to change: nobody may find it any more
        assert self.ref_counts[block] == 0, f"block {block} is in use"
        self.ref_counts[block] = 1
        return block
        ### END SOLUTION

    def free(self, block_table: list[int]) -> None:
        """A sequence is done with its blocks (finished, aborted or preempted): each count - 1.

        A block nobody holds any more stays findable (evictable) if it is indexed, else it is free.
        The table is released from its end, so that a sequence's last blocks are the first evicted:
        a block is then always evicted before the blocks its prefix runs through."""
        for block in reversed(block_table):
            self._release(block)
        block_table.clear()

    def _release(self, block: int) -> None:
        """One table fewer holds ``block``. At 0 it stays findable (evictable) if it is indexed, else it is free."""
        ### BEGIN SOLUTION 5.4
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} was freed twice"
        if self.ref_counts[block] == 0:
            if self.index is not None and block in self.index:
                self.evictable[block] = None  # the most recently used end
            else:
                self.free_blocks.append(block)
        ### END SOLUTION

