"""What the engine reports of itself: frozen snapshots of its load and of the pool, which ``/health`` and
``/metrics`` read from any thread (the engine thread replaces the pool's after each request; none is ever
modified)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVBlockStats:
    total: int
    used: int
    free: int
    block_size: int


@dataclass(frozen=True)
class EngineStats:
    """The engine's load at one moment (``/health`` and ``/metrics`` read it)."""

    running: int
    waiting: int
    kv_blocks: KVBlockStats
