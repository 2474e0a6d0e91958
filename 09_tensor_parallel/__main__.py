"""python -m 09_tensor_parallel [--demo] [--tensor-parallel-size N] [--port P]

Under torchrun every rank runs this module: rank 0 serves (or runs the demo), the others run_worker:

    torchrun --nproc-per-node 3 -m 09_tensor_parallel --tensor-parallel-size 3 --demo
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from common.cli import DEMO_PROMPTS, config_from_args, served_name, stage_parser
from common.device import DeviceUnavailable, pick_device
from common.limits import Limits, add_limit_args
from common.trace import Tracer, add_trace_args

from .async_engine import AsyncEngine
from .config import EngineConfig
from .distributed import under_torchrun
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


def demo(engine: Engine, max_tokens: int) -> None:
    """The demo prompts on this engine's ranks and on a split (or an unsplit) engine beside it: the same tokens,
    each rank's memory, and what the split costs or saves in time on this machine."""
    prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in DEMO_PROMPTS]
    answers, seconds = answer(engine, prompts, max_tokens)
    for prompt_text, ids in zip(DEMO_PROMPTS, answers, strict=True):
        print(f"\n{prompt_text!r}\n  -> {engine.tokenizer.decode(ids, skip_special_tokens=True)!r}")
    gpus = torch.cuda.device_count() if engine.device.type == "cuda" else None
    other_size = comparison_size(engine.model.config.tensor_parallel_sizes(), engine.tp.size, gpus)
    if other_size is None or under_torchrun():  # torchrun's processes are all this engine's
        print(f"\n{sum(map(len, answers))} tokens in {seconds:.1f} s; {engine.memory_report()}")
        return
    print(f"\nThe same prompts on {other_size} rank(s), for comparison (--tensor-parallel-size {other_size}):")
    other = Engine(replace(engine.config, tensor_parallel_size=other_size))
    try:
        other_report = other.memory_report()
        other_answers, other_seconds = answer(other, prompts, max_tokens)
    finally:
        other.shutdown()
    for size, report, tokens, took in ((engine.tp.size, engine.memory_report(), answers, seconds),
                                       (other_size, other_report, other_answers, other_seconds)):
        print(f"  {size} rank(s): {sum(map(len, tokens))} tokens in {took:.1f} s; {report}")
    print(f"The same tokens on {engine.tp.size} and on {other_size} rank(s): {answers == other_answers}. "
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
    try:
        engine = Engine(config)
    except (DeviceUnavailable, ValueError) as exc:  # no such device; a budget below max_num_seqs; a bad draft;
        raise SystemExit(f"error: {exc}") from None  # a --tensor-parallel-size that does not split the model
    try:
        serve_or_demo(engine, args)
    finally:
        engine.shutdown()  # every other rank stops too (the server's shutdown has done it already)


def serve_or_demo(engine: Engine, args) -> None:
    cache = engine.kv_cache
    print(f"Loaded {args.model} on {engine.device} ({engine.dtype}), context {engine.max_model_len} tokens")
    print(f"KV cache: {cache.num_blocks} blocks x {args.block_size} tokens = {engine.kv_capacity_tokens} tokens, "
          f"{cache.num_bytes / 2**20:.0f} MiB ({cache.shape.bytes_per_token} bytes per token)")
    print(f"Steps: up to {args.max_num_seqs} sequences, {engine.max_num_batched_tokens} tokens (decodes and their "
          "guesses first, then prompt chunks)")
    print(f"Prefix cache: {args.prefix_cache}")
    others = " (each of the others prints its own)" if engine.tp.size > 1 else ""
    print(f"Tensor parallel: {engine.memory_report()}{others}")
    runner = engine.runner
    if runner.capture_seconds is not None:
        print(f"CUDA graphs: the decode step captured for batch sizes {runner.sizes} "
              f"in {runner.capture_seconds:.1f} s, holding {runner.graph_memory_bytes / 2**20:.0f} MiB of the GPU "
              "(steps with guesses run eagerly)")
    else:
        why = "--enforce-eager" if args.enforce_eager else "they need CUDA and the Triton kernels"
        print(f"CUDA graphs: off ({why}); decode steps run eagerly from static buffers, buckets {engine.runner.sizes}")
    if args.speculative == "draft":
        draft = engine.proposer.model.config
        source = args.draft_model or f"the model's first {draft.num_layers} of {engine.model.config.num_layers} layers"
        print(f"Speculation: a draft model ({source}) guesses k = {args.num_speculative_tokens} tokens; its cache "
              f"{engine.draft_kv_cache.num_bytes / 2**20:.0f} MiB")
    elif args.speculative == "ngram":
        print(f"Speculation: n-gram prompt lookup guesses k = {args.num_speculative_tokens} tokens")
    else:
        print("Speculation: off")
    if args.demo:
        demo(engine, args.max_tokens)
        return
    import uvicorn

    from .server import create_app

    app = create_app(AsyncEngine(engine), served_name(args.model), Limits.from_args(args),
                     Tracer.from_args(args))
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
