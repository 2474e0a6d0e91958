"""python -m 02_streaming [--demo] [--model M] [--host H] [--port P]"""

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
    """Print each token the moment it is generated, then when the first one came and how fast."""
    for i, prompt in enumerate(DEMO_PROMPTS):
        prompt_ids = engine.encode_chat([{"role": "user", "content": prompt}])
        print(f"\nPrompt: {prompt!r}\nOutput: ", end="", flush=True)
        start = time.perf_counter()
        times = []
        for output in engine.generate(f"demo-{i}", prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)):
            times.append(time.perf_counter())
            print(output.text, end="", flush=True)
        gaps = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
        itl = f"{1000 * sum(gaps) / len(gaps):.1f} ms" if gaps else "n/a"
        print(f"\nTime to first token: {1000 * (times[0] - start):.1f} ms ({len(prompt_ids)} prompt tokens); "
              f"inter-token latency: {itl} ({len(times)} tokens, finish_reason={output.finish_reason})")


def main() -> None:
    parser = stage_parser(__package__, EngineConfig)
    add_limit_args(parser)
    add_trace_args(parser)
    args = parser.parse_args()
    try:
        engine = build_off_the_main_thread(lambda: Engine(config_from_args(EngineConfig, args)))
    except DeviceUnavailable as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"Loaded {args.model} on {engine.device} ({engine.dtype}), context {engine.max_model_len} tokens")
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
