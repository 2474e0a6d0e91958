"""The prefix index: which cached block holds which whole prefix of tokens.

A block of the KV cache holds the keys and values of ``block_size`` tokens, and those depend on
every token before them, not only on its own. So a block can be reused by another sequence only
if that sequence starts with *exactly the same tokens up to the end of the block*. The index maps
such whole prefixes (cut at block boundaries) to the block that holds their last ``block_size``
tokens. Only full blocks are indexed: a half-filled block still changes.

``HashIndex`` (the default, as in vLLM and nano-vllm) names each full block by a chained hash::

    hash(block i) = sha256(hash(block i - 1) || token ids of block i)

so equal hashes mean equal whole prefixes, and a lookup hashes the prompt block by block and
stops at the first hash it does not know. The digest must be collision resistant: with a weak
one (Python's ``hash()``, or a truncated 64-bit digest) an attacker can craft a prompt whose block
hashes like another user's, and the server would hand them that user's cached keys and values
(vLLM advisory GHSA-rm76-4mrf-v9r8; vLLM has hashed with SHA-256 by default since v0.10.2).

``radix_tree.RadixTree`` (SGLang's design) implements the same interface as a tree of token blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from typing import Protocol

ROOT = b""  # the "parent hash" of a sequence's first block


class PrefixIndex(Protocol):
    """What the block manager asks of an index. Blocks are ids in the KV pool; ``token_ids`` always start
    at a sequence's first token, and block ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)``."""

    block_size: int

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """The blocks of the longest indexed prefix of ``token_ids`` (whole blocks only), in order."""
        ...

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> list[int]:
        """Index the full blocks ``block_ids`` holding ``token_ids[:len(block_ids) * block_size]``, and return
        the block the index holds for each of those prefixes.

        That is the given block, unless the same prefix was already indexed in *another* block (two
        sequences computed it at once): then the index keeps that one, returns it, and the caller
        should share it and give its own copy back. Either way the blocks after it are indexed under it.
        """
        ...

    def evict(self, block_id: int) -> None:
        """Forget ``block_id``: the block manager is handing it out for new content."""
        ...

    def __contains__(self, block_id: int) -> bool:
        """Whether ``block_id`` is indexed (findable by ``match``)."""
        ...

    def __len__(self) -> int:
        """How many blocks are indexed."""
        ...


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """SHA-256 of the parent block's digest and this block's token ids (4 bytes each, little-endian)."""
    ### BEGIN SOLUTION 5.1
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()
    ### END SOLUTION


class HashIndex:
    """Full blocks by chained hash: ``{digest: block id}``, and each indexed block's digest."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}

    def hashes(self, token_ids: Sequence[int]) -> Iterator[bytes]:
        """The chained hash of each full block of ``token_ids``, in order (computed as they are asked for)."""
        parent = ROOT
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = block_hash(parent, token_ids[start:start + self.block_size])
            yield parent

    def match(self, token_ids: Sequence[int]) -> list[int]:
        ### BEGIN SOLUTION 5.2
        blocks = []
        for digest in self.hashes(token_ids):
            if (block := self.block_of.get(digest)) is None:
                break  # a later block cannot match: its hash chains through this one
            blocks.append(block)
        return blocks
        ### END SOLUTION

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> list[int]:
        held = []
        digests = self.hashes(token_ids[:len(block_ids) * self.block_size])
        for digest, block in zip(digests, block_ids, strict=True):
            if (indexed := self.block_of.setdefault(digest, block)) == block:
                self.hash_of[block] = digest
            held.append(indexed)  # ``block``, or the block that already holds this prefix
        return held

    def evict(self, block_id: int) -> None:
        del self.block_of[self.hash_of.pop(block_id)]

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.hash_of

    def __len__(self) -> int:
        return len(self.hash_of)
