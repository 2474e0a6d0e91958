"""What the engine reports of itself: frozen snapshots, taken on the engine thread after each step and read
by ``/health`` and ``/metrics`` from any thread (a snapshot is replaced, never modified)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVBlockStats:
    total: int
    used: int  # held by at least one sequence
    evictable: int  # held by none, still findable in the prefix cache
    free: int
    cached: int  # in the prefix cache: shared, or evictable
    block_size: int


@dataclass(frozen=True)
class PrefixCacheStats:
    queries: int  # prompt tokens looked up at admission
    hits: int  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class EngineStats:
    """The engine's load at one moment, taken on the engine thread (``/health`` and ``/metrics`` read it)."""

    running: int
    waiting: int
    kv_blocks: KVBlockStats
    preemptions: int  # since start-up: sequences that gave their blocks back, to be recomputed
    prefix_cache: PrefixCacheStats
