"""python -m 11_quantization [--demo] [--quantization auto|none|int8|int4] [--port P]

The demo answers its prompts with the weights in float and in the chosen bytes, one engine each, and compares
their bytes, their speed and their answers. Under torchrun every rank runs this module, as in stage 09: rank 0
serves (or runs the demo), the others run_worker.
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
    """The demo prompts on this engine (its weights in the chosen bytes), then on one in float (stage 10's): each
    one's weights, its time, and where their greedy answers part."""
    prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in DEMO_PROMPTS]
    chosen = engine.quantization
    answers, seconds = answer(engine, prompts, max_tokens)
    for prompt_text, ids in zip(DEMO_PROMPTS, answers, strict=True):
        print(f"\n{prompt_text!r}\n  -> {engine.tokenizer.decode(ids, skip_special_tokens=True)!r}")
    memory = engine.stats().memory
    print(f"\n{chosen}: weights {memory.weight_bytes / 2**20:.0f} MiB (float32: "
          f"{memory.unquantized_weight_bytes / 2**20:.0f} MiB), {sum(map(len, answers))} tokens in {seconds:.1f} s")
    if chosen == "none":
        print("The weights are float: --quantization int4 or int8 keeps them in fewer bytes.")
        return
    float_engine = start_engine(replace(engine.config, quantization="none"))
    try:
        float_answers, float_seconds = answer(float_engine, prompts, max_tokens)
    finally:
        float_engine.shutdown()
    same = sum(a == b for a, b in zip(answers, float_answers, strict=True))
    print(f"none (float32): {sum(map(len, float_answers))} tokens in {float_seconds:.1f} s. The same greedy answer "
          f"for {same} of {len(prompts)} prompts: the quantized weights are other numbers, so a near-tie may go the "
          "other way and the answer part from there (the tests hold each mode to Hugging Face on its own weights).")


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
