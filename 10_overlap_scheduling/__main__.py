"""python -m 10_overlap_scheduling [--demo] [--disable-overlap] [--tensor-parallel-size N] [--port P]

The demo answers its prompts twice on one engine, overlapping and synchronous, and compares. Under torchrun every
rank runs this module, as in stage 09: rank 0 serves (or runs the demo), the others run_worker.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from common.cli import DEMO_PROMPTS, config_from_args, served_name, stage_parser
from common.device import DeviceUnavailable, build_off_the_main_thread, pick_device
from common.limits import Limits, add_limit_args
from common.trace import Tracer, add_trace_args

from .async_engine import AsyncEngine, CoreFailedToStart
from .config import EngineConfig
from .distributed import RanksOutOfStep, under_torchrun
from .sampler import SamplingParams

if TYPE_CHECKING:  # the server's process imports no engine (its core process does): the demo and a worker import it
    from .engine import Engine


def answer(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Every prompt, greedy, in one batch: the answers and the seconds they took."""
    started = time.perf_counter()
    answers = engine.generate_offline(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return answers, time.perf_counter() - started


def start_engine(config: EngineConfig) -> Engine:
    """The engine, or exit with a one-line error: no such device; a budget below max_num_seqs; a bad draft; a
    --tensor-parallel-size that does not split the model; a rank that exited at start-up."""
    from .engine import Engine

    try:
        return build_off_the_main_thread(lambda: Engine(config))
    except (DeviceUnavailable, ValueError, RanksOutOfStep) as exc:
        raise SystemExit(f"error: {exc}") from None


def demo(engine: Engine, max_tokens: int) -> None:
    """The demo prompts twice on one engine: its steps overlapping, then every step synchronous (stage 09's loop):
    the same tokens, each run's time, and how many steps overlapped or waited for the step before, and why."""
    prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in DEMO_PROMPTS]
    runs = {}
    for overlap in (True, False):
        engine.config = replace(engine.config, disable_overlap=not overlap)  # read by each step: no restart needed
        before = engine.stats().overlap
        answers, seconds = answer(engine, prompts, max_tokens)
        after = engine.stats().overlap
        waited = {reason: steps - before.synchronous.get(reason, 0) for reason, steps in after.synchronous.items()}
        runs[overlap] = answers
        if overlap:
            for prompt_text, ids in zip(DEMO_PROMPTS, answers, strict=True):
                print(f"\n{prompt_text!r}\n  -> {engine.tokenizer.decode(ids, skip_special_tokens=True)!r}")
            print(f"\nOverlapping: {sum(map(len, answers))} tokens in {seconds:.1f} s; "
                  f"{after.overlapped - before.overlapped} steps launched while the step before was in flight, "
                  f"synchronous ones by reason: {waited or 'none'}")
        else:
            print(f"Synchronous (--disable-overlap): {sum(map(len, answers))} tokens in {seconds:.1f} s")
    print(f"The same tokens both ways: {runs[True] == runs[False]}. On a CPU the device thread hides the host's "
          "millisecond or two a turn behind a forward pass a hundred times longer; on a GPU the step is as short as "
          "the host's work, and that is where overlapping pays.")


def main() -> None:
    parser = stage_parser(__package__, EngineConfig)
    add_limit_args(parser)
    add_trace_args(parser)
    args = parser.parse_args()
    config = config_from_args(EngineConfig, args)
    if under_torchrun() and int(os.environ["RANK"]) > 0:  # torchrun started this process as a worker
        from .engine import token_budget
        from .worker import run_worker

        run_worker(int(os.environ["RANK"]), "env://", config, token_budget(config, pick_device(config.device)))
        return
    if not args.demo:
        serve(config, args)  # the engine is built in the core's own process
        return
    from .core import describe

    if config.device_thread == "auto":  # the demo shows the overlap: on a CPU that takes the device thread
        config = replace(config, device_thread="on")
    engine = start_engine(config)
    try:
        describe(engine)
        demo(engine, args.max_tokens)
    finally:
        engine.shutdown()  # every other rank stops too


def serve(config: EngineConfig, args) -> None:
    """The engine core in a process of its own (it builds the engine and describes it), this one the API server."""
    import uvicorn

    from .server import create_app

    tracer = Tracer.from_args(args)
    try:
        engine = AsyncEngine(config, tracer=tracer)
    except CoreFailedToStart as exc:  # no such device, a bad budget or draft, a rank that exited at start-up
        raise SystemExit(f"error: {exc}") from None
    app = create_app(engine, served_name(args.model), Limits.from_args(args), tracer)
    uvicorn.run(app, host=args.host, port=args.port)  # its lifespan stops the core (and the other ranks)


if __name__ == "__main__":
    main()
