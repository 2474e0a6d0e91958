"""What crosses the pipe between the API process and the engine core: the typed messages each side sends, and the
two errors the API process must recognise (a request refused, an engine gone).

They live in a module of their own because of how pickling works. A pickle names an object's class by its module
and its name, and unpickling it imports that module. A ``StepNews`` defined in ``core.py`` would make the API
process import ``core.py`` the first time it read the core's news, and with it ``engine.py``, the scheduler and the
model runner: the code the core process exists to keep out of the API process, which would pay for its imports and
could reach into an engine that is not there. So every class pickled through the pipe, and the errors the server
tells apart, are defined here, in a module that imports neither the engine nor the core nor what only they use.
The core's entry point crosses too, to the child process, pickled the same way: ``async_engine.run_core`` imports
``core.py`` inside its body, so only the child, which calls it, loads the engine.

    API process                                     core process
    AddRequest, AbortRequest, Shutdown  ----------> EngineCore.run
    AsyncEngine's reader  <----------  Ready or StartFailed, then a StepNews a turn
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.trace import Span, StepClock

from .sampler import SamplingParams
from .sequence import RequestOutput
from .stats import EngineStats


class InvalidRequest(ValueError):
    """The engine cannot take this request (token ids outside the vocabulary, too long): a 400."""


class EngineStopped(RuntimeError):
    """The engine core has exited: nothing it held or was sent will ever be served."""


# --- what the API process sends the core ----------------------------------------------------------


@dataclass
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    traced: bool = False  # send its engine spans back with each turn's news (--trace)


@dataclass
class AbortRequest:
    request_id: str  # its client left
    index: int | None = None  # only this sample: a stop string ended it (the API process found it in the text)


@dataclass
class Shutdown:
    pass


CoreInput = AddRequest | AbortRequest | Shutdown


# --- what the core sends the API process ----------------------------------------------------------


@dataclass
class Ready:
    """The engine is built: what the API process must know before it takes a request."""

    max_model_len: int
    kv_capacity_tokens: int
    stats: EngineStats


@dataclass
class StartFailed:
    reason: str  # no such device, a budget too small, a rank that exited: the server exits with it


@dataclass
class StepNews:
    """One turn of the core's loop: its outputs and the engine as it stands after it."""

    outputs: list[RequestOutput]  # every request with news, including those refused at admission
    stats: EngineStats  # the snapshot /health and /metrics read until the next news
    prompt_tokens: int = 0  # prompt tokens of the requests admitted since the last news (a counter)
    clock: StepClock | None = None  # the turn's phases; None when it launched and processed nothing
    num_tokens: int = 0  # tokens the launched step runs
    num_decoding: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # each verification's kept guesses
    spans: dict[str, list[Span]] = field(default_factory=dict)  # traced requests' new engine spans
    device_seconds: float = 0.0  # the device's time for the step this turn read (not the host's launch)
    device_decoding: int = 0  # the sequences that decoded in that step


CoreOutput = Ready | StartFailed | StepNews
