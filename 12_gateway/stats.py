"""What the engine reports of itself: frozen snapshots, taken in the engine core after each step, sent with its news,
and read by ``/health`` and ``/metrics`` from any thread (a snapshot is replaced, never modified)."""

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
class SpeculationStats:
    proposed: int  # guesses checked
    accepted: int  # of those, kept
    runs: int  # verifications: (sequence, step) pairs that brought at least one guess

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Guesses kept per verification; each also emits one token of the model's own."""
        return self.accepted / self.runs if self.runs else 0.0


@dataclass(frozen=True)
class OverlapStats:
    overlapped: int  # steps launched while the step before was in flight
    synchronous: dict[str, int]  # steps that could not overlap, by reason (a copy of the engine's counts)


@dataclass(frozen=True)
class MemoryStats:
    """What rank 0 holds: its weights, in the bytes of ``quantization``, and its KV-cache pool."""

    quantization: str  # none, int8 or int4
    weight_bytes: int
    unquantized_weight_bytes: int  # the same weights in float: quantizing saved the difference (the pool's on a CPU)
    kv_cache_bytes: int


@dataclass(frozen=True)
class EngineStats:
    """The engine's load at one moment, taken in the engine core (``/health`` and ``/metrics`` read it)."""

    running: int
    waiting: int
    kv_blocks: KVBlockStats
    preemptions: int  # since start-up: sequences that gave their blocks back, to be recomputed
    prefix_cache: PrefixCacheStats
    speculation: SpeculationStats
    overlap: OverlapStats
    memory: MemoryStats
