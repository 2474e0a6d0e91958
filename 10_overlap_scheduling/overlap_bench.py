"""Stage 10 measured offline: one batch through stage 09's engine, this stage's with --disable-overlap, this stage's
overlapping, and overlapping with the CPU's device thread (--device-thread on), in rounds, in one process.

    python -m 10_overlap_scheduling.overlap_bench            # results/cpu/10_overlap_scheduling_offline.json
    python -m 10_overlap_scheduling.overlap_bench --quick    # 8 sequences, one round, into results/quick/ (CI)
    python -m 10_overlap_scheduling.overlap_bench --stage 12 # a later stage's engine in this stage's place

A served sweep on a 2-core machine moves by a fifth from run to run (other processes, the client on the same
cores); here the three engines take turns within each round, so that the machine's drift falls on all three
alike, and no server or client shares the cores. Each run: the same greedy, fixed-length requests added at once
and stepped to the end, every turn timed: tokens per second, turns, per turn the device's time for the step it read
(stage 10's ``device_seconds``; stage 09's ``execute`` phase) and the rest, and stage 10's overlapped and synchronous
steps.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from datetime import UTC, datetime
from typing import Any

from common.bench import RESULTS, git_state, machine_info, stage_folder
from common.trace import StepClock
from common.weights import DEFAULT_MODEL, resolve_model

STAGE = __package__  # 10_overlap_scheduling: the stage measured unless --stage names a later one
BEFORE = "09_tensor_parallel"  # the stage whose loop this one overlaps
PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):", "1. Apples\n2.", "The three laws of thermodynamics"]


def make_engine(folder: str, model: str, **config: Any):
    """A stage's engine on a CPU, float32, with its defaults but ``config``."""
    engine_config = importlib.import_module(f"{folder}.config").EngineConfig
    return importlib.import_module(f"{folder}.engine").Engine(engine_config(model=model, device="cpu",
                                                                            dtype="float32", **config))


def run_batch(engine, folder: str, num_seqs: int, max_tokens: int, tag: str) -> dict[str, float]:
    """``num_seqs`` greedy requests of ``max_tokens`` tokens each, added at once and stepped to the end."""
    sampling_params = importlib.import_module(f"{folder}.sampler").SamplingParams
    params = sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"{tag}-{i}", engine.encode(f"{i}: {PROMPTS[i % len(PROMPTS)]}"), params)
    turns, device = 0, 0.0
    overlap_before = getattr(engine.stats(), "overlap", None)
    started = time.perf_counter()
    while engine.has_unfinished():
        clock = StepClock()
        result = engine.step(clock)
        turns += 1
        device += getattr(result, "device_seconds", None) or clock.phases.get("execute", 0.0)
    seconds = time.perf_counter() - started
    run = {"seqs": num_seqs, "tokens_per_s": round(num_seqs * max_tokens / seconds, 2), "turns": turns,
           "device_ms_per_turn": round(1000 * device / turns, 2),
           "rest_ms_per_turn": round(1000 * (seconds - device) / turns, 3)}
    if overlap_before is not None:
        after = engine.stats().overlap
        run["overlapped_steps"] = after.overlapped - overlap_before.overlapped
        run["synchronous_steps"] = {reason: count - overlap_before.synchronous.get(reason, 0)
                                    for reason, count in after.synchronous.items()}
    return run


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {STAGE}.overlap_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--stage", help=f"the stage to measure, 10 or later (default: {STAGE[:2]}, this one)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--quick", action="store_true", help="8 sequences of 16 tokens, one round, into results/quick/")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 64], help="batch sizes, each in every round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    folder = stage_folder(args.stage) if args.stage else STAGE
    label = f"stage {folder[:2]}"
    seqs, max_tokens, rounds = ([8], 16, 1) if args.quick else (args.seqs, args.max_tokens, args.rounds)
    model = str(resolve_model(args.model))
    machine = machine_info("cpu")  # before the engines load: the load average is the machine's, not ours
    engines = {"stage 09": (BEFORE, make_engine(BEFORE, model)),
               f"{label}, --disable-overlap": (folder, make_engine(folder, model, disable_overlap=True)),
               label: (folder, make_engine(folder, model)),
               f"{label}, --device-thread on": (folder, make_engine(folder, model, device_thread="on"))}
    runs = []
    for round_ in range(rounds):
        for num_seqs in seqs:
            for name, (stage, engine) in engines.items():
                tag = f"r{round_}-{num_seqs}"
                runs.append({"engine": name, "round": round_, **run_batch(engine, stage, num_seqs, max_tokens, tag)})
                print(f"round {round_} {name}: {runs[-1]}")
    median = {f"{name}, {n} seqs": statistics.median(r["tokens_per_s"] for r in runs
                                                     if r["engine"] == name and r["seqs"] == n)
              for n in seqs for name in engines}
    out = RESULTS / ("quick" if args.quick else "") / "cpu" / f"{folder}_offline.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "name": out.stem, "stage": folder, "before": BEFORE, "model": args.model, "device": "cpu", "dtype": "float32",
        "workload": {"seqs": seqs, "max_tokens": max_tokens, "rounds": rounds, "prompts": PROMPTS,
                     "speculative": "the engines' default (ngram, cost policy)"},
        "machine": machine, **git_state(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": f"python -m {STAGE}.overlap_bench" + (f" --stage {args.stage}" if args.stage else "")
                   + (" --quick" if args.quick else ""),
        "median_tokens_per_s": median, "runs": runs}, indent=1) + "\n")
    print(f"median tokens/s: {median}\nWrote {out}")


if __name__ == "__main__":
    main()
