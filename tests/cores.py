"""The engine core (stage 10 on) on a thread of the test process, for the tests that reach into the engine it serves.

A server's core is a child process that builds its own engine: ``AsyncEngine(config)``. A test that monkeypatches
the engine, or reads its scheduler and its pool while a server runs, needs that engine in its own process. So here
the same loop (``EngineCore.run``, after the same ``Ready``) runs on a thread, on an engine the test built, at the
other end of the same kind of pipe, and ``AsyncEngine.attach`` is its client: the messages, the reader thread and
stop() are the server's; only the core's start differs. The stage's own code knows no thread of the core.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

from .conftest import stage


class CoreThread(threading.Thread):
    """The core's loop on a thread: what ``AsyncEngine`` holds of a core (``async_engine.Core``), as a process is."""

    exitcode: int | None = None  # a thread has none: the API process reports "exit code None"

    def kill(self) -> None:
        """A thread cannot be killed. It is a daemon, and ends with the test process at the latest."""


def core_on_a_thread(folder: str, engine, **client: Any):
    """An ``AsyncEngine`` of stage ``folder`` (``client``: its metrics and tracer) whose core runs ``engine``, an
    engine already built, on a thread started now: as a server's child process, it says Ready, then serves until
    Shutdown or the end of its pipe."""
    core, messages = stage(folder, "core"), stage(folder, "messages")
    conn, core_end = mp.Pipe()

    def serve() -> None:
        core_end.send(messages.Ready(engine.max_model_len, engine.kv_capacity_tokens, engine.stats()))
        core.EngineCore(engine, core_end).run()

    thread = CoreThread(target=serve, name="engine-core", daemon=True)
    thread.start()
    return stage(folder, "async_engine").AsyncEngine.attach(conn, thread, engine.tokenizer, **client)
