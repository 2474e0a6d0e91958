"""python -m 04_continuous_batching [--demo] [--model M] [--max-num-seqs N] [--kv-cache-mb MB] [--host H] [--port P]"""

from __future__ import annotations

import time

from common.cli import DEMO_PROMPTS, model_dir_or_exit, served_name, stage_parser
from common.limits import Limits, add_limit_args

from .engine import AsyncEngine, Engine
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
        step_outputs = engine.step()
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
    parser = stage_parser("04_continuous_batching",
                          "Stage 04: continuous batching, every running request in every forward pass.",
                          default_port=8004)
    parser.add_argument("--kv-cache-mb", type=int, default=512, help="KV-cache pool size on CPU (default: 512)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="on CUDA, the share of free memory (after the weights) the pool takes (default: 0.9)")
    parser.add_argument("--block-size", type=int, default=16, choices=[16, 32, 64, 128], help="tokens per block")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the largest decode batch (default: 64)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096,
                        help="the most prompt tokens one prefill step runs (default: 4096)")
    add_limit_args(parser)
    args = parser.parse_args()
    engine = Engine(model_dir_or_exit(args.model), device=args.device, dtype=args.dtype, kv_cache_mb=args.kv_cache_mb,
                    block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
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

    app = create_app(AsyncEngine(engine), served_name(args.model), Limits.from_args(args))
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
