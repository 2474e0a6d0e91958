"""python -m 09_tensor_parallel [--demo] [--tensor-parallel-size N] [--process-group] [--port P]

Under torchrun every rank runs this module: rank 0 serves (or runs the demo), the others run_worker:

    torchrun --nproc-per-node 3 -m 09_tensor_parallel --tensor-parallel-size 3 --demo

One rank that still issues every collective, through a process group of one (the parallel path on one device):

    python -m 09_tensor_parallel --process-group --demo                          gloo, on a CPU
    torchrun --nproc-per-node 1 -m 09_tensor_parallel --device cuda --demo       NCCL, on one GPU
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from common.cli import DEMO_PROMPTS, config_from_args, served_name, stage_parser
from common.device import DeviceUnavailable, build_off_the_main_thread, pick_device
from common.limits import Limits, add_limit_args
from common.trace import Tracer, add_trace_args

from .async_engine import AsyncEngine
from .config import EngineConfig
from .distributed import RanksOutOfStep, under_torchrun
from .engine import Engine, token_budget
from .sampler import SamplingParams
from .worker import run_worker


def answer(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Every prompt, greedy, in one batch: the answers and the seconds they took."""
    started = time.perf_counter()
    answers = engine.generate_offline(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return answers, time.perf_counter() - started


def comparison_size(sizes: list[int], size: int, gpus: int | None) -> int | None:
    """The ranks of the engine the demo compares with: one, beside a split engine; beside an unsplit one, the
    smallest split this machine can run (on CUDA a GPU per rank, ``gpus`` of them; on a CPU, any); else None."""
    if size > 1:
        return 1
    return next((n for n in sizes if n > 1 and (gpus is None or n <= gpus)), None)


@dataclass
class DemoRun:
    """What one engine of the demo answered and held: plain numbers and text, so that the engine itself can go."""

    size: int  # its ranks
    answers: list[list[int]]
    seconds: float
    report: str  # rank 0's weights and KV cache
    comparison: int | None  # the ranks of the engine to compare it with (``comparison_size``)


def start_engine(config: EngineConfig) -> Engine:
    """The engine, or exit with a one-line error: no such device; a budget below max_num_seqs; a bad draft; a
    --tensor-parallel-size that does not split the model; a rank that exited at start-up."""
    try:
        return build_off_the_main_thread(lambda: Engine(config))
    except (DeviceUnavailable, ValueError, RanksOutOfStep) as exc:
        raise SystemExit(f"error: {exc}") from None


def demo_run(config: EngineConfig, max_tokens: int, show: Callable[[Engine], None] | None) -> DemoRun:
    """Start an engine, answer the demo prompts on it, and shut it down (every rank with it). ``show``: describe the
    engine and print its answers (the first engine of the demo)."""
    engine = start_engine(config)
    try:
        if show is not None:
            show(engine)
        prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in DEMO_PROMPTS]
        answers, seconds = answer(engine, prompts, max_tokens)
        if show is not None:
            for prompt_text, ids in zip(DEMO_PROMPTS, answers, strict=True):
                print(f"\n{prompt_text!r}\n  -> {engine.tokenizer.decode(ids, skip_special_tokens=True)!r}")
        gpus = torch.cuda.device_count() if engine.device.type == "cuda" else None
        other = comparison_size(engine.model.config.tensor_parallel_sizes(), engine.tp.size, gpus)
        return DemoRun(engine.tp.size, answers, seconds, engine.memory_report(), other)
    finally:
        engine.shutdown()


def release_memory() -> None:
    """Give back what a finished engine held: its objects (some refer to each other, so only the collector frees
    them) and, on CUDA, the cached blocks PyTorch keeps for reuse, which the next engine's pool must be able to see
    as free (``mem_get_info``)."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def demo(config: EngineConfig, max_tokens: int, show: Callable[[Engine], None] | None = None) -> None:
    """The demo prompts on this engine's ranks and on a split (or an unsplit) engine after it: the same tokens,
    each rank's memory, and what the split costs or saves in time on this machine.

    One engine at a time: on a GPU the first engine's pool takes most of what its weights left
    (``--gpu-memory-utilization``), and the second engine's rank 0 runs on the same GPU. So the first is shut down
    and its memory freed before the second starts."""
    first = demo_run(config, max_tokens, show)
    release_memory()
    if first.comparison is None or under_torchrun():  # torchrun's processes are all this engine's
        print(f"\n{sum(map(len, first.answers))} tokens in {first.seconds:.1f} s; {first.report}")
        return
    print(f"\nThe same prompts on {first.comparison} rank(s), for comparison (--tensor-parallel-size "
          f"{first.comparison}), once the first engine has stopped:")
    other = demo_run(replace(config, tensor_parallel_size=first.comparison), max_tokens, None)
    release_memory()
    for run in (first, other):
        print(f"  {run.size} rank(s): {sum(map(len, run.answers))} tokens in {run.seconds:.1f} s; {run.report}")
    print(f"The same tokens on {first.size} and on {other.size} rank(s): {first.answers == other.answers}. "
          "On one machine's CPU the ranks share its cores: the README measures what a split costs here.")


def main() -> None:
    parser = stage_parser(__package__, EngineConfig)
    add_limit_args(parser)
    add_trace_args(parser)
    args = parser.parse_args()
    config = config_from_args(EngineConfig, args)
    if under_torchrun() and int(os.environ["RANK"]) > 0:  # torchrun started this process as a worker
        run_worker(int(os.environ["RANK"]), "env://", config, token_budget(config, pick_device(config.device)))
        return
    if args.demo:  # each engine of the demo starts, answers and shuts down in turn
        demo(config, args.max_tokens, lambda engine: describe(engine, args))
        return
    engine = start_engine(config)
    try:
        describe(engine, args)
        serve(engine, args)
    finally:
        engine.shutdown()  # every other rank stops too (the server's shutdown has done it already)


def describe(engine: Engine, args) -> None:
    """What the engine holds and does: the model, the pool, the step, the caches, the ranks, graphs, speculation."""
    cache = engine.kv_cache
    print(f"Loaded {args.model} on {engine.device} ({engine.dtype}), context {engine.max_model_len} tokens")
    print(f"KV cache: {cache.num_blocks} blocks x {args.block_size} tokens = {engine.kv_capacity_tokens} tokens, "
          f"{cache.num_bytes / 2**20:.0f} MiB ({cache.shape.bytes_per_token} bytes per token)")
    print(f"Steps: up to {args.max_num_seqs} sequences, {engine.max_num_batched_tokens} tokens (decodes and their "
          "guesses first, then prompt chunks)")
    print(f"Prefix cache: {args.prefix_cache}")
    others = " (each of the others prints its own)" if engine.tp.size > 1 else ""
    group = " in a process group of one" if engine.tp.size == 1 and engine.tp.group is not None else ""
    print(f"Tensor parallel{group}: {engine.memory_report()}{others}")
    runner = engine.runner
    if runner.capture_seconds is not None:
        print(f"CUDA graphs: decode steps captured for batch sizes {runner.sizes}, steps with guesses for "
              f"{runner.verify_sizes} rows, in {runner.capture_seconds:.1f} s, holding "
              f"{runner.graph_memory_bytes / 2**20:.0f} MiB of the GPU")
    else:
        why = "--enforce-eager" if args.enforce_eager else "they need CUDA and the Triton kernels"
        print(f"CUDA graphs: off ({why}); steps run eagerly from static buffers: decodes in buckets {runner.sizes}, "
              f"steps with guesses in buckets of {runner.verify_sizes} rows")
    if args.speculative == "draft":
        draft = engine.proposer.model.config
        source = args.draft_model or f"the model's first {draft.num_layers} of {engine.model.config.num_layers} layers"
        print(f"Speculation: a draft model ({source}) guesses k = {args.num_speculative_tokens} tokens; its cache "
              f"{engine.draft_kv_cache.num_bytes / 2**20:.0f} MiB")
    elif args.speculative == "ngram":
        print(f"Speculation: n-gram prompt lookup guesses k = {args.num_speculative_tokens} tokens")
    else:
        print("Speculation: off")


def serve(engine: Engine, args) -> None:
    import uvicorn

    from .server import create_app

    tracer = Tracer.from_args(args)
    app = create_app(AsyncEngine(engine, tracer=tracer), served_name(args.model), Limits.from_args(args), tracer)
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
