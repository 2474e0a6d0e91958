"""python -m 04_continuous_batching [--demo] [--model M] [--max-num-seqs N] [--kv-cache-mb MB] [--host H] [--port P]"""

from __future__ import annotations

import time

from common.cli import DEMO_PROMPTS, config_from_args, served_name, stage_parser
from common.device import DeviceUnavailable, build_off_the_main_thread
from common.limits import Limits, add_limit_args
from common.trace import Tracer, add_trace_args

from .async_engine import AsyncEngine
from .config import EngineConfig
from .engine import Engine
from .sampler import SamplingParams


def demo(engine: Engine, max_tokens: int) -> None:
    """Submit every demo prompt at once and print, step by step, who is in the batch; then the answers."""
    lengths = [max_tokens // 4, max_tokens, max_tokens // 2, max_tokens]  # finish at different steps
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(DEMO_PROMPTS):
        prompt_ids = engine.encode_chat([{"role": "user", "content": prompt}])
        engine.add_request(f"demo-{i}", prompt_ids, SamplingParams(max_tokens=lengths[i % 4], temperature=0.0))
        outputs[f"demo-{i}"] = []
    print(f"\n{len(outputs)} requests submitted together. Each step is one forward pass:")
    start = time.perf_counter()
    step = 0
    while engine.has_unfinished():
        step_start = time.perf_counter()
        step_outputs = engine.step().outputs
        step += 1
        for output in step_outputs:
            outputs[output.request_id].extend(output.token_ids)
        if step <= 3 or any(output.finished for output in step_outputs):
            kind = "prefill" if any(output.completion_tokens == 1 for output in step_outputs) else "decode "
            done = [output.request_id for output in step_outputs if output.finished]
            print(f"  step {step:3d} {kind} batch {len(step_outputs)} "
                  f"({1000 * (time.perf_counter() - step_start):6.1f} ms)" + (f"  finished: {', '.join(done)}"
                                                                               if done else ""))
    elapsed = time.perf_counter() - start
    total = sum(len(ids) for ids in outputs.values())
    print(f"{total} tokens in {step} steps, {elapsed:.2f} s: {total / elapsed:.1f} tokens/s")
    for (request_id, ids), prompt in zip(outputs.items(), DEMO_PROMPTS, strict=True):
        print(f"\n{request_id} {prompt!r}\n  -> {engine.tokenizer.decode(ids, skip_special_tokens=True)!r}")


def main() -> None:
    parser = stage_parser(__package__, EngineConfig)
    add_limit_args(parser)
    add_trace_args(parser)
    args = parser.parse_args()
    try:
        engine = build_off_the_main_thread(lambda: Engine(config_from_args(EngineConfig, args)))
    except DeviceUnavailable as exc:
        raise SystemExit(f"error: {exc}") from None
    cache = engine.kv_cache
    print(f"Loaded {args.model} on {engine.device} ({engine.dtype}), context {engine.max_model_len} tokens")
    print(f"KV cache: {cache.num_blocks} blocks x {args.block_size} tokens = {engine.kv_capacity_tokens} tokens, "
          f"{cache.num_bytes / 2**20:.0f} MiB ({cache.shape.bytes_per_token} bytes per token)")
    print(f"Batches: up to {args.max_num_seqs} sequences, {args.max_num_batched_tokens} prompt tokens per prefill")
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
