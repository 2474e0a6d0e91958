"""The prefix index as a radix tree of token blocks (SGLang's RadixCache, simplified).

A *radix tree* (a prefix tree, or trie, whose edges carry several symbols) stores strings so that
strings with a common beginning share the path that spells it: the root is the empty string, each
edge adds a few symbols, and a node stands for the string spelled on the way down to it. Here the strings are
sequences of token ids and every edge is exactly one KV block of ``block_size`` token ids, so a
node at depth ``i`` stands for a whole prefix of ``i`` blocks, and it records the block that holds
the K/V of its edge's tokens (computed after everything above it)::

    root ─(1,2,3,4)─► block 7 ─(5,6,7,8)─► block 2      prompts [1..8, ...] and [1..4, 9..12, ...]
                         └─────(9,10,11,12)─► block 5    share block 7

SGLang keeps its prefix cache this way. A lookup walks down the tree one block of tokens at a
time, one dict lookup per edge, with no cryptographic hash: two prefixes are the same exactly when
their paths are. The sharing is explicit, so eviction takes leaves only: a block whose prefix
runs on into other cached blocks stays until they are gone. (SGLang's edges hold any number of
tokens and split when a new prompt diverges mid-edge; whole-block edges never split.)

It answers exactly like ``prefix_index.HashIndex``: the chained hash of block ``i`` names the
same thing as the path to a node at depth ``i``, the whole prefix. The cost differs: the hash
chain runs SHA-256 over every block of the prompt, the tree builds a tuple per block and looks it
up in a small dict (Python hashes the tuple, but a collision there only costs time, it cannot make
two prefixes equal: the dict compares the tokens).

Eviction. Every table that holds a cached block holds its parent just before it, and
``BlockManager.free`` releases a table from its end: a block's count reaches 0 no later than its
parent's, and first when both do. So in the least-recently-used order a cached block always comes
before its parent, and a node is only ever evicted as a leaf. ``evict`` still forgets the node's
whole subtree, should it have one, since no lookup could reach it any more.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Node:
    """One cached block: the edge from ``parent`` (``block_size`` token ids) and the block holding it."""

    block: int  # the block id in the KV pool; -1 for the root, which holds nothing
    key: tuple[int, ...]  # this edge's token ids, (block_size,); () for the root
    parent: Node | None  # None for the root
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)  # next block's token ids -> node


class RadixTree:
    """Full blocks as a tree with one block of tokens per edge, and each indexed block's node."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = Node(block=-1, key=(), parent=None)
        self.node_of: dict[int, Node] = {}  # block id -> its node, for O(1) eviction

    def edges(self, token_ids: Sequence[int]) -> Iterator[tuple[int, ...]]:
        """The token ids of each full block of ``token_ids``, in order, as tuples of ``block_size``."""
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            yield tuple(token_ids[start:start + self.block_size])

    def match(self, token_ids: Sequence[int]) -> list[int]:
        blocks = []
        node = self.root
        for key in self.edges(token_ids):
            if (child := node.children.get(key)) is None:
                break  # no cached prefix goes this way
            blocks.append(child.block)
            node = child
        return blocks

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> list[int]:
        held, node = [], self.root
        keys = self.edges(token_ids[:len(block_ids) * self.block_size])
        for key, block in zip(keys, block_ids, strict=True):
            if (child := node.children.get(key)) is None:
                child = node.children[key] = Node(block, key, node)
                self.node_of[block] = child
            held.append(child.block)  # ``block``, or the block that already holds this prefix
            node = child
        return held

    def evict(self, block_id: int) -> None:
        node = self.node_of.pop(block_id)
        assert node.parent is not None  # only the root has no parent, and the root holds no block
        del node.parent.children[node.key]
        stack = list(node.children.values())  # empty under the block manager: see the module docstring
        while stack:
            descendant = stack.pop()
            del self.node_of[descendant.block]
            stack.extend(descendant.children.values())

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.node_of

    def __len__(self) -> int:
        return len(self.node_of)
