"""python -m 08_speculative [--demo] [--speculative {ngram,draft,off}] [--num-speculative-tokens K] [--port P]"""

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
from .sequence import Sequence
from .speculative import Proposal

CODE = """def area(width, height):
    return width * height

def perimeter(width, height):
    return 2 * (width + height)
"""
EXTRACTIVE = f"Rename `width` to `w` in this code and show the whole code:\n\n{CODE}"


class RecordingProposer:
    """Wraps the engine's proposer to show each step's guesses (the demo's only look inside a step)."""

    def __init__(self, proposer) -> None:
        self.proposer = proposer
        self.last: list[Proposal] = []

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        self.last = self.proposer.propose(seqs, ks)
        return self.last


def show_steps(engine: Engine, prompt_ids: list[int], max_tokens: int) -> None:
    """One request alone, step by step: its guesses, what was kept, and the model's own token."""
    recorder = RecordingProposer(engine.proposer)
    engine.proposer = recorder
    engine.add_request("steps", prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    text = engine.tokenizer.decode
    print(f"\nOne request, step by step ({engine.config.speculative}, k = {engine.config.num_speculative_tokens}): "
          "the guesses kept, the model's own token, the guesses rejected")
    step = 0
    while engine.has_unfinished():
        recorder.last = []
        for output in engine.step().outputs:
            step += 1
            guesses = recorder.last[0].token_ids if recorder.last else []
            j = len(output.token_ids) - 1  # greedy: the first j guesses were kept, then the model's own token
            kept, own, rejected = output.token_ids[:j], output.token_ids[j:], guesses[j:]
            print(f"  step {step:3d}: +{len(output.token_ids)}  " + (f"guessed {text(kept)!r} + " if kept else "")
                  + f"model {text(own)!r}" + (f"   rejected {text(rejected)!r}" if rejected else ""))
    engine.proposer = recorder.proposer


def demo(engine: Engine, max_tokens: int) -> None:
    """An extractive request step by step, then the demo chats and the extractive request with and without guesses."""
    prompt = engine.encode_chat([{"role": "user", "content": EXTRACTIVE}])
    if engine.proposer is not None:
        show_steps(engine, prompt, max_tokens=48)
    prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in DEMO_PROMPTS] + [prompt]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    proposer = engine.proposer
    results = {}
    for label, guessing in (("with guesses", proposer), ("without", None)):
        engine.proposer = guessing
        before = engine.stats().speculation
        started = time.perf_counter()
        outputs = [engine.generate_offline([ids], params)[0] for ids in prompts]  # one at a time: concurrency 1
        seconds = time.perf_counter() - started
        accepted = engine.stats().speculation.accepted - before.accepted
        results[label] = outputs
        print(f"\n{label}: {sum(map(len, outputs))} tokens in {seconds:.1f} s "
              f"({sum(map(len, outputs)) / seconds:.1f} tokens/s), {accepted} of them accepted guesses")
    engine.proposer = proposer
    for prompt_text, ids in zip([*DEMO_PROMPTS, EXTRACTIVE.splitlines()[0]], results["with guesses"], strict=True):
        print(f"\n{prompt_text!r}\n  -> {engine.tokenizer.decode(ids, skip_special_tokens=True)!r}")
    same = results["with guesses"] == results["without"]
    print(f"\nThe same tokens with guesses and without: {same}")


def main() -> None:
    parser = stage_parser(__package__, EngineConfig)
    add_limit_args(parser)
    add_trace_args(parser)
    args = parser.parse_args()
    try:
        engine = build_off_the_main_thread(lambda: Engine(config_from_args(EngineConfig, args)))
    except (DeviceUnavailable, ValueError) as exc:  # no such device; a budget below max_num_seqs; a bad draft
        raise SystemExit(f"error: {exc}") from None
    cache = engine.kv_cache
    print(f"Loaded {args.model} on {engine.device} ({engine.dtype}), context {engine.max_model_len} tokens")
    print(f"KV cache: {cache.num_blocks} blocks x {args.block_size} tokens = {engine.kv_capacity_tokens} tokens, "
          f"{cache.num_bytes / 2**20:.0f} MiB ({cache.shape.bytes_per_token} bytes per token)")
    print(f"Steps: up to {args.max_num_seqs} sequences, {engine.max_num_batched_tokens} tokens (decodes and their "
          "guesses first, then prompt chunks)")
    print(f"Prefix cache: {args.prefix_cache}")
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
