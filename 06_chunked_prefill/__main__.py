"""python -m 06_chunked_prefill [--demo] [--max-num-batched-tokens N] [--kv-cache-mb MB] [--host H] [--port P]"""

from __future__ import annotations

import time

from common.cli import DEMO_PROMPTS, config_from_args, served_name, stage_parser
from common.device import DeviceUnavailable, build_off_the_main_thread
from common.limits import Limits, add_limit_args
from common.loadgen import shared_prefix
from common.trace import Tracer, add_trace_args

from .async_engine import AsyncEngine
from .config import EngineConfig
from .engine import Engine
from .model_runner import run_dummy_step
from .sampler import SamplingParams

LONG_PROMPT_TOKENS = 1500  # the demo's long prompt: about 5 s of prefill on a laptop CPU


def demo(engine: Engine, max_tokens: int) -> None:
    """Chats decode; a long prompt arrives; print what each step holds. The chats never wait for the whole prompt."""
    chats = {}
    for i, prompt in enumerate(DEMO_PROMPTS[:3]):
        prompt_ids = engine.encode_chat([{"role": "user", "content": prompt}])
        engine.add_request(f"chat-{i}", prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                    ignore_eos=True))
        chats[f"chat-{i}"] = prompt
    long_ids = engine.encode_chat([{"role": "system", "content": shared_prefix(LONG_PROMPT_TOKENS)},
                                   {"role": "user", "content": "Summarize the policy in one sentence."}])
    budget = engine.max_num_batched_tokens
    print(f"\n3 chats start; at step 4 a {len(long_ids)}-token prompt arrives. Budget: {budget} tokens a step, "
          "decodes first, then prompt chunks:")
    last_token: dict[str, float] = {}
    answers: dict[str, list[int]] = {request_id: [] for request_id in chats}
    longest_gap, step, long_arrived, long_first_token = 0.0, 0, 0.0, 0.0
    while engine.has_unfinished():
        step += 1
        if step == 4:
            engine.add_request("long", long_ids, SamplingParams(max_tokens=8, temperature=0.0))
            long_arrived = time.perf_counter()
        seqs = [seq for samples in engine.scheduler.sequences.values() for seq in samples]
        before = {seq.request_id: seq.num_computed_tokens for seq in seqs}
        step_start = time.perf_counter()
        outputs = engine.step().outputs
        now = time.perf_counter()
        for output in outputs:
            if output.request_id in chats:
                answers[output.request_id] += output.token_ids
                if output.request_id in last_token:
                    longest_gap = max(longest_gap, now - last_token[output.request_id])
                last_token[output.request_id] = now
            elif output.completion_tokens == 1:
                long_first_token = now
        long_seq = next((seq for seq in seqs if seq.request_id == "long"), None)
        prefilling = long_seq is not None and before["long"] < len(long_ids)  # this step ran a chunk of it
        if prefilling or step <= 4 or step % 16 == 0:
            chat_tokens = sum(1 for output in outputs if output.request_id in chats)
            chunk = "" if not prefilling else (
                f" + {min(long_seq.num_computed_tokens, len(long_ids)) - before['long']} tokens of the long prompt "
                f"({min(long_seq.num_computed_tokens, len(long_ids))}/{len(long_ids)})")
            print(f"  step {step:3d}: {chat_tokens} chat tokens{chunk}  {1000 * (now - step_start):6.1f} ms")
    print(f"\nThe long prompt's first token came {long_first_token - long_arrived:.2f} s after it arrived. The chats' "
          f"longest wait between two tokens: {1000 * longest_gap:.0f} ms.")
    start = time.perf_counter()
    run_dummy_step(engine.model, engine.kv_cache, engine.device, len(long_ids))  # the whole prompt in one step
    print(f"The whole prompt in one step (stage 05's way) takes {1000 * (time.perf_counter() - start):.0f} ms: "
          "every chat would have waited that long for its next token.")
    for request_id, prompt in chats.items():
        ids = answers[request_id]  # they ran on past their end (ignore_eos, so that they decode throughout): cut it
        ids = ids[: next((i for i, t in enumerate(ids) if t in engine.eos_token_ids), len(ids))]
        answer = engine.tokenizer.decode(ids, skip_special_tokens=True)
        print(f"\n{request_id} {prompt!r}\n  -> {answer!r}")


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
