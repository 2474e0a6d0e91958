"""The block manager: which KV-cache blocks are free, and which belong to which sequence.

The pool is a fixed number of blocks of ``block_size`` token slots. A sequence owns a *block table*,
the list of its block ids in token order; its token at position p lives in block
``block_table[p // block_size]`` at offset ``p % block_size``. A sequence asks for one more block
only when its last one is full, so at most ``block_size - 1`` slots per sequence sit reserved but
unused, whatever its final length. When it ends, all of its blocks go back on the free list.

This is the operating system's page table, applied to the KV cache.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    """The pool has no block left to give."""


def token_slots(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The cache slot of each token position in ``[start, end)``: block id * block_size + offset. (A function,
    not a method: the model runner needs only the block size to place tokens, never the pool itself.)"""
    ### BEGIN SOLUTION 3.2
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    ### END SOLUTION


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: the ceiling of num_tokens / block_size."""
        return -(-num_tokens // self.block_size)

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Whether a sequence holding ``block_table`` can grow to ``num_tokens`` tokens right now."""
        return self.blocks_needed(num_tokens) - len(block_table) <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append free blocks to ``block_table`` until it holds ``num_tokens`` tokens.

        All or nothing: if the pool cannot cover the growth, raise NoFreeBlocks and take no block.
        """
        ### BEGIN SOLUTION 3.1
        missing = self.blocks_needed(num_tokens) - len(block_table)
        if missing > self.num_free:
            raise NoFreeBlocks(f"{missing} more blocks needed, {self.num_free} free")
        for _ in range(missing):
            block_table.append(self.free_blocks.popleft())
        ### END SOLUTION

    def free(self, block_table: list[int]) -> None:
        """Give every block of a finished (or aborted) sequence back to the pool."""
        self.free_blocks.extend(block_table)
        block_table.clear()
        assert self.num_free <= self.num_blocks, "a block was freed twice"

