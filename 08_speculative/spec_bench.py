"""Speculative decoding's benchmark: stage 08 against stage 07, per proposer, k and concurrency, on two workloads.

    python -m 08_speculative.spec_bench                 # the full run: results/<device>/08_speculative.json + .png
    python -m 08_speculative.spec_bench --quick         # a short check: results/quick/

``--stage NN`` measures a later stage against stage 07 instead, into ``NN_speculative.json``: the benchmark
lives here only, beside the lesson it measures.

Two workloads of chat requests (greedy, up to 128 tokens, ending at EOS: every configuration produces the
same tokens, so the same work):

* **extractive**: the answer repeats much of the prompt (rename a variable in this code, fix one bug,
  repeat a list with one change), what n-gram prompt lookup is for;
* **chat**: open questions, whose answers repeat little.

Each configuration (stage 07; stage 08 with each proposer and k) gets one server, and all of them run
from the start (an idle server costs memory, not time). The measurements are interleaved: for each
workload and concurrency, every server in turn runs the workload's requests, so that all the numbers
of one comparison are taken within a few minutes of each other. (A shared virtual machine's speed
drifts by 20% and more over the half hour the whole run takes: measured one configuration after the
other, that drift would show up as speed-ups.) /health's speculation counters before and after give
the acceptance rate and the accepted length of each level alone. The speed-up is each level's output
tokens/s over stage 07's at the same level and workload.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from common.bench import RESULTS, git_state, machine_info, stage_command, stage_folder, stage_server
from common.loadgen import Workload, run_level, warm_up
from common.net import free_port
from common.weights import DEFAULT_MODEL, load_tokenizer, resolve_model

STAGE = __package__  # 08_speculative: the stage measured against stage 07 unless --stage names a later one

CODE_AREA = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The length of a rectangle's border."""
    return 2 * (width + height)


def describe(width, height):
    return f"{width} by {height}: area {area(width, height)}, perimeter {perimeter(width, height)}"
'''
CODE_BUG = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values) + 1


def variance(values):
    m = mean(values)
    return sum((value - m) ** 2 for value in values) / len(values)
'''
SHOPPING = "\n".join(f"{i}. {item}" for i, item in enumerate(
    ["two litres of milk", "a loaf of brown bread", "six eggs", "a kilo of apples", "olive oil", "black pepper",
     "three lemons", "a bag of rice", "tomato sauce", "a block of cheddar cheese"], start=1))
EXTRACTIVE = [
    f"Rename the parameter `width` to `w` everywhere in this code, and show the whole code:\n\n{CODE_AREA}",
    f"This code has one bug: `mean` adds 1 to the result. Fix it and show the whole corrected code:\n\n{CODE_BUG}",
    f"Repeat this shopping list exactly, but replace the olive oil with butter:\n\n{SHOPPING}",
    f"Copy this code and add a docstring to `describe`:\n\n{CODE_AREA}",
]
CHAT = [
    "What is the capital of France, and what is it known for?",
    "Write a short poem about the sea.",
    "Explain in a few sentences why the sky is blue.",
    "Give me three tips for sleeping better.",
]
WORKLOADS = {"extractive": EXTRACTIVE, "chat": CHAT}
MAX_TOKENS = 128
LEVELS = [1, 4, 16]
KS = [2, 4, 8]


def configurations(number: str, ks: list[int], proposers: list[str]) -> list[tuple[str, str, list[str]]]:
    """(label, stage, its extra server flags): stage 07, then stage ``number`` ("08") with each proposer and k."""
    configs = [("07", "07", [])]
    for proposer in proposers:
        configs += [(f"{number} {proposer} k={k}", number,
                     ["--speculative", proposer, "--num-speculative-tokens", str(k)]) for k in ks]
    return configs


def chat_prompts(model: str, questions: list[str]) -> list[str]:
    """Each question as the model's chat template renders it, for the completions endpoint."""
    tokenizer = load_tokenizer(resolve_model(model))
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=False) for q in questions]


def speculation(url: str) -> dict[str, int]:
    """The speculation counters since start-up (zeros for a stage without speculation)."""
    health = httpx.get(f"{url}/health", timeout=10).json()
    return health.get("speculation", {"proposed": 0, "accepted": 0, "runs": 0})


def workload_of(url: str, model: str, prompts: list[str]) -> Workload:
    # ignore_eos None removes the standard workload's ignore_eos: answers end where the model ends them.
    return Workload(url, model, MAX_TOKENS, prompts=prompts, extra_body={"ignore_eos": None})


async def measure(url: str, model: str, prompts: list[str], concurrency: int, requests: int) -> dict[str, Any]:
    """One level of one workload on one server: throughput, latencies, and the level's own acceptance."""
    before = speculation(url)
    level = await run_level(workload_of(url, model, prompts), concurrency, max(requests, concurrency),
                            desc=f"c={concurrency}")
    after = speculation(url)
    counts = {key: after[key] - before[key] for key in ("proposed", "accepted", "runs")}
    summary = level.summary()
    return {**{key: summary[key] for key in ("concurrency", "requests", "errors", "wall_s", "output_tokens",
                                             "output_tokens_per_s", "ttft_s", "itl_s")}, **counts,
            "acceptance_rate": counts["accepted"] / counts["proposed"] if counts["proposed"] else None,
            "mean_accepted_length": counts["accepted"] / counts["runs"] if counts["runs"] else None}


def speed_ups(runs: list[dict[str, Any]]) -> None:
    """Each run's tokens/s over stage 07's at the same workload and concurrency, in place."""
    base = {(r["workload"], r["concurrency"]): r["output_tokens_per_s"] for r in runs if r["config"] == "07"}
    for run in runs:
        run["speed_up"] = run["output_tokens_per_s"] / base[(run["workload"], run["concurrency"])]


def plot(result: dict[str, Any], out: Path) -> None:
    """Speed-up over stage 07 against concurrency, one panel per workload, one line per configuration."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(result["workloads"]), sharey=True)
    for ax, workload in zip(axes, result["workloads"], strict=True):
        for config in dict.fromkeys(r["config"] for r in result["runs"]):
            rows = [r for r in result["runs"] if r["config"] == config and r["workload"] == workload]
            style = "k--" if config == "07" else ("-o" if "ngram" in config else "-s")
            ax.plot([r["concurrency"] for r in rows], [r["speed_up"] for r in rows], style, label=config)
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["levels"], [str(c) for c in result["levels"]])
        ax.set_title(f"{workload}: output tokens/s over stage 07's")
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speed-up")
    axes[-1].legend(fontsize=8)
    fig.savefig(out, dpi=110)


def alternating_rounds(folder: str, model: str, rounds: int, k: int = 4) -> dict[str, Any]:
    """Concurrency 1 without the server, in one process: stage ``folder``'s engine with guesses off (stage 07's
    decoding) and on (n-gram, k), alternating ``rounds`` times per workload, so that a drift of the machine's speed
    hits both alike. Each round generates every prompt of the workload once, one at a time."""
    import time

    EngineConfig = importlib.import_module(f"{folder}.config").EngineConfig  # noqa: N806 (classes)
    Engine = importlib.import_module(f"{folder}.engine").Engine  # noqa: N806
    SamplingParams = importlib.import_module(f"{folder}.sampler").SamplingParams  # noqa: N806

    engine = Engine(EngineConfig(model=model, device="cpu", dtype="float32", speculative="ngram",
                                 num_speculative_tokens=k))
    generate = getattr(engine, "generate_offline", None) or engine.generate
    ngram, params = engine.proposer, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    rates: dict[str, dict[str, list[float]]] = {}
    for workload, questions in WORKLOADS.items():
        prompts = [engine.encode_chat([{"role": "user", "content": q}]) for q in questions]
        generate(prompts[:1], params)  # warm-up
        for _ in range(rounds):
            for label, proposer in (("off", None), (f"ngram k={k}", ngram)):
                engine.proposer = proposer
                started = time.perf_counter()
                tokens = sum(len(generate([prompt], params)[0]) for prompt in prompts)
                rates.setdefault(workload, {}).setdefault(label, []).append(tokens / (time.perf_counter() - started))
                print(f"{workload} {label}: {rates[workload][label][-1]:.1f} tokens/s", flush=True)
    return rates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {STAGE}.spec_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", help=f"the stage measured against 07, 08 or later (default: {STAGE[:2]}, this one)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="levels 1 and 4, k = 4, n-gram only")
    parser.add_argument("--requests", type=int, default=4, help="requests per level, at least the concurrency")
    parser.add_argument("--out", type=Path, help="folder for the JSON and PNG (default: results/<device>/)")
    parser.add_argument("--alternating-rounds", type=int, metavar="N",
                        help="instead: concurrency 1 in one process, guesses off and on alternating N times per "
                             "workload -> NN_speculative_alternating.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    folder = stage_folder(args.stage) if args.stage else STAGE
    number = folder[:2]  # "08": the stage measured against stage 07, its label and its result files' prefix
    levels, ks, proposers = ([1, 4], [4], ["ngram"]) if args.quick else (LEVELS, KS, ["ngram", "draft"])
    out = args.out or RESULTS / ("quick" if args.quick else args.device)
    out.mkdir(parents=True, exist_ok=True)
    if args.alternating_rounds:
        rates = alternating_rounds(folder, args.model, args.alternating_rounds)
        path = out / f"{number}_speculative_alternating.json"
        path.write_text(json.dumps({"date": datetime.now(UTC).isoformat(timespec="seconds"),
                                    "machine": machine_info("cpu"), "git": git_state(), "max_tokens": MAX_TOKENS,
                                    "workloads": WORKLOADS, "output_tokens_per_s": rates}, indent=1) + "\n")
        for workload, by_label in rates.items():
            off, on = (sorted(values)[len(values) // 2] for values in by_label.values())
            print(f"{workload}: median {off:.1f} tokens/s off, {on:.1f} on: {on / off:.2f}x")
        print(f"wrote {path}")
        return
    prompts = {name: chat_prompts(args.model, questions) for name, questions in WORKLOADS.items()}
    runs = []
    with ExitStack() as servers:
        urls = {}
        for label, stage, flags in configurations(number, ks, proposers):
            port = free_port()
            urls[label] = f"http://127.0.0.1:{port}"
            servers.enter_context(stage_server(stage_command(stage, port, args.model, args.device, args.dtype) + flags,
                                               urls[label]))
        for workload, workload_prompts in prompts.items():
            for url in urls.values():  # unmeasured: lazy set-up, and the workload's first prompt
                asyncio.run(warm_up(workload_of(url, args.model, workload_prompts)))
            for i, concurrency in enumerate(levels):
                order = list(urls.items())
                for label, url in order if i % 2 == 0 else order[::-1]:  # every other round backwards: no config
                    # is always measured last, when the machine may have drifted most
                    row = asyncio.run(measure(url, args.model, workload_prompts, concurrency, args.requests))
                    runs.append({"config": label, "workload": workload, **row})
                    print(f"{workload} c={concurrency} {label}: {row['output_tokens_per_s']:.1f} tokens/s, accepted "
                          f"{row['accepted']} of {row['proposed']} guesses", flush=True)
    speed_ups(runs)
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine_info(args.device),
              "git": git_state(), "dtype": args.dtype, "levels": levels,
              "max_tokens": MAX_TOKENS, "requests_per_level": args.requests, "workloads": WORKLOADS, "runs": runs}
    path = out / f"{number}_speculative.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, path.with_suffix(".png"))
    print(f"\n{'config':<16} {'workload':<11} {'c':>3} {'tok/s':>7} {'x 07':>6} {'accept':>7} {'len':>5}")
    for r in runs:
        rate = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        length = "" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(f"{r['config']:<16} {r['workload']:<11} {r['concurrency']:3d} {r['output_tokens_per_s']:7.1f} "
              f"{r['speed_up']:6.2f} {rate:>7} {length:>5}")
    print(f"\nwrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
