"""What the engine reports of itself: a frozen snapshot of its load, which ``/health`` reads from any
thread (the async engine builds a new one from its gauges; none is ever modified)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """The engine's load at one moment (``/health`` reads it)."""

    running: int
    waiting: int
