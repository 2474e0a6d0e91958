"""What the engine reports of itself: frozen snapshots, taken on the engine thread after each step and read
by ``/health`` and ``/metrics`` from any thread (a snapshot is replaced, never modified)."""

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
