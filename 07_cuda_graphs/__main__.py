"""python -m 07_cuda_graphs [--demo] [--enforce-eager] [--max-num-seqs N] [--kv-cache-mb MB] [--host H] [--port P]"""

from __future__ import annotations

import torch

from common.cli import DEMO_PROMPTS, config_from_args, served_name, stage_parser
from common.device import DeviceUnavailable, build_off_the_main_thread
from common.limits import Limits, add_limit_args
from common.trace import Tracer, add_trace_args

from .async_engine import AsyncEngine
from .config import EngineConfig
from .engine import Engine
from .model_runner import StepInput
from .sampler import SamplingParams
from .step_bench import decode_step, time_ms


def demo(engine: Engine, max_tokens: int) -> None:
    """Three chats decode in one batch (bucket 4, one row of padding); then one decode step timed at several
    batch sizes: eager (stage 06's path) against the static buffers (a replayed graph on CUDA)."""
    runner = engine.runner
    how = "replays a CUDA graph" if runner.graphs else "runs eagerly (no CUDA graphs on this device)"
    print(f"\nBuckets: {runner.sizes}. A decode step of n sequences pads to the smallest bucket >= n and {how}.")
    prompts = DEMO_PROMPTS  # three: bucket 4, one row of padding
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompt_ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    outputs = engine.generate_offline(prompt_ids, params)
    for prompt, ids in zip(prompts, outputs, strict=True):
        print(f"\n{prompt!r}\n  -> {engine.tokenizer.decode(ids, skip_special_tokens=True)!r}")
    print("\nOne decode step (context 256), the median of several runs:")
    print(f"{'batch':>6} {'bucket':>7} {'eager':>10} {'static':>10}")
    block_size = engine.kv_cache.shape.block_size
    for batch_size in [b for b in (1, 5, 16, 64) if b <= runner.sizes[-1]]:
        step = decode_step(StepInput, batch_size, 256, block_size)
        bucket = runner.bucket(step)
        with torch.inference_mode():
            eager = time_ms(lambda: runner.run_eager(step), engine.device, repeats=5)  # noqa: B023 (called at once)
            static = time_ms(lambda: runner.execute(step), engine.device, repeats=5)  # noqa: B023
        print(f"{batch_size:6d} {bucket:7d} {eager:8.1f}ms {static:8.1f}ms")


def main() -> None:
    parser = stage_parser(__package__, EngineConfig)
    add_limit_args(parser)
    add_trace_args(parser)
    args = parser.parse_args()
    try:
        engine = build_off_the_main_thread(lambda: Engine(config_from_args(EngineConfig, args)))
    except (DeviceUnavailable, ValueError) as exc:  # no such device; a budget below max_num_seqs
        raise SystemExit(f"error: {exc}") from None
    cache = engine.kv_cache
    print(f"Loaded {args.model} on {engine.device} ({engine.dtype}), context {engine.max_model_len} tokens")
    print(f"KV cache: {cache.num_blocks} blocks x {args.block_size} tokens = {engine.kv_capacity_tokens} tokens, "
          f"{cache.num_bytes / 2**20:.0f} MiB ({cache.shape.bytes_per_token} bytes per token)")
    print(f"Steps: up to {args.max_num_seqs} sequences, {engine.max_num_batched_tokens} tokens (decodes first, "
          "then prompt chunks)")
    print(f"Prefix cache: {args.prefix_cache}")
    runner = engine.runner
    if runner.capture_seconds is not None:
        print(f"CUDA graphs: the decode step captured for batch sizes {runner.sizes} "
              f"in {runner.capture_seconds:.1f} s, holding {runner.graph_memory_bytes / 2**20:.0f} MiB of the GPU")
    else:
        why = "--enforce-eager" if args.enforce_eager else "they need CUDA and the Triton kernels"
        print(f"CUDA graphs: off ({why}); decode steps run eagerly from static buffers, buckets {engine.runner.sizes}")
    if args.demo:
        demo(engine, args.max_tokens)
        return
    import uvicorn

    from .server import create_app

    tracer = Tracer.from_args(args)
    app = create_app(AsyncEngine(engine, tracer=tracer), served_name(args.model), Limits.from_args(args), tracer)
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
