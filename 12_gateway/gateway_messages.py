"""What a replica and the gateway say to each other, in a module that both import and that imports no engine.

The gateway's process only validates, routes and relays: it must not load PyTorch or stage 11's engine (hundreds of
megabytes, and seconds of start-up, for nothing). Whatever a replica sends it is unpickled there, and unpickling an
object imports the module that defines its class: a message class defined in ``replica.py`` would make the gateway
import ``replica.py``, and with it torch and the whole engine. So the messages live here (and the SSE framing the
gateway shares with the servers, in ``sse.py``, which imports no engine either). ``messages.py`` is stage 11's, the
same lesson one hop further in: what crosses between a replica's API process and its engine core.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.metrics_core import Metric


@dataclass(frozen=True)
class ResponseStart:
    """The first thing a replica's answer carries: the HTTP status and the headers of the stage 11 app."""

    status: int
    headers: list[tuple[str, str]]
    replica: str  # which replica answered (the gateway passes it on as the x-replica header)


@dataclass(frozen=True)
class EngineReport:
    """One replica's engine as its stage 11 server's /metrics shows it: every metric family of the server's registry,
    collected at one moment (``registry.collect()``: the same families and samples the text format is written from)."""

    replica: str
    metrics: list[Metric]
