"""python -m 01_naive [--demo] [--model M] [--host H] [--port P]"""

from __future__ import annotations

from common.cli import DEMO_PROMPTS, config_from_args, served_name, stage_parser
from common.device import DeviceUnavailable

from .config import EngineConfig
from .engine import Engine
from .sampler import SamplingParams


def demo(engine: Engine, max_tokens: int) -> None:
    for prompt in DEMO_PROMPTS:
        prompt_ids = engine.encode_chat([{"role": "user", "content": prompt}])
        result = engine.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        print(f"\nPrompt:  {prompt!r}")
        print(f"Output:  {result.text!r}")
        print(f"Prefill: {result.prefill_ms:.1f} ms ({result.prompt_tokens} tokens)")
        print(f"Decode:  {result.decode_ms_per_token:.1f} ms/token ({result.completion_tokens} tokens, "
              f"finish_reason={result.finish_reason})")
        cached = result.prompt_tokens + result.completion_tokens - 1  # the last token is never fed back
        print(f"KV cache: {result.kv_cache_bytes / 2**20:.2f} MiB for {cached} tokens "
              f"({result.kv_cache_bytes // cached} bytes/token)")


def main() -> None:
    args = stage_parser(__package__, EngineConfig).parse_args()
    try:
        engine = Engine(config_from_args(EngineConfig, args))
    except DeviceUnavailable as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"Loaded {args.model} on {engine.device} ({engine.dtype}), context {engine.max_model_len} tokens")
    if args.demo:
        demo(engine, args.max_tokens)
        return
    from .server import create_app

    # threaded=False: one request at a time, the others wait their turn (the point of this stage).
    create_app(engine, served_name(args.model)).run(host=args.host, port=args.port, threaded=False)


if __name__ == "__main__":
    main()
