"""The decode step alone, timed against batch size: eager (every operator launched by Python) against the
static buffers of stage 07 (a replayed CUDA graph on a GPU, the same computation eagerly on a CPU).

    python -m 07_cuda_graphs.step_bench                       # on this machine's default device
    python -m 07_cuda_graphs.step_bench --device cuda --profile
    python -m 07_cuda_graphs.step_bench --stage 09               # a later stage's engine, the same steps

It lives here only, beside the lesson it measures: ``--stage NN`` loads stage NN's engine instead (any stage
from 07 on), so a later stage measures its own decode step without a copy of this file.

Each step decodes one token for ``batch_size`` sequences of ``context`` tokens; it writes no K/V (slot -1)
and reads block 0 over and over, so it has a real step's shape and needs no requests. For each batch size
the median of ``repeats`` runs of each path goes to ``results/<device>/NN_name_decode_steps.json``. With
``--profile``, one step at batch 1 and at the largest batch is also profiled (``torch.profiler``): how
many operators it runs, and how much of its time is inside them against outside (Python).
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import torch

from common.bench import RESULTS, device_and_dtype, dumps, git_state, machine_info, stage_folder
from common.weights import DEFAULT_MODEL

STAGE = __package__  # 07_cuda_graphs: the stage measured unless --stage names a later one
BATCH_SIZES = [1, 2, 4, 8, 16, 17, 32, 48, 64]


def stage_parts(folder: str) -> tuple[type, type, type]:
    """Stage ``folder``'s ``Engine``, ``EngineConfig`` and ``StepInput``: what a step benchmark drives. (A folder
    name starts with a digit, so ``import`` cannot name it: importlib can.)"""
    if int(folder[:2]) < int(STAGE[:2]):
        raise SystemExit(f"error: {folder} has no static buffers to measure: a stage from {STAGE} on")
    engine, config, runner = (importlib.import_module(f"{folder}.{name}") for name in ("engine", "config",
                                                                                       "model_runner"))
    return engine.Engine, config.EngineConfig, runner.StepInput


def decode_step(step_input: type, batch_size: int, context: int, block_size: int) -> Any:
    """A decode step (the stage's ``StepInput``) of ``batch_size`` sequences of ``context`` tokens that writes
    nothing (slot -1) and reads block 0 for every position: the shape of a real step, for timing."""
    table = [0] * -(-context // block_size)
    return step_input(input_ids=[0] * batch_size, positions=[context - 1] * batch_size,
                      slot_mapping=[-1] * batch_size, query_start_loc=list(range(batch_size + 1)),
                      seq_lens=[context] * batch_size, block_tables=[table] * batch_size,
                      logits_indices=list(range(batch_size)), prompt_logits_indices=[],
                      num_prompt_logits=[0] * batch_size)


def bucket_of(batch_size: int, sizes: list[int]) -> int | None:
    """The bucket a decode step of ``batch_size`` sequences pads to: the smallest size that holds it, else None."""
    return next((size for size in sizes if size >= batch_size), None)


def time_ms(run: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The median of ``repeats`` timed calls of ``run``, in ms, after one untimed call."""

    def synchronize() -> None:  # a GPU runs asynchronously: wait for it, or the clock stops too early
        if device.type == "cuda":
            torch.cuda.synchronize()

    run()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def profile_step(run: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """One step under torch.profiler: its operators, and the share of its wall time spent inside them."""
    from torch.profiler import ProfilerActivity, profile

    run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall_us = 1e6 * (time.perf_counter() - start)
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    result = {
        "wall_ms_under_profiler": wall_us / 1000,
        # Operator calls: an aten:: call can call others (linear -> addmm), so count the leaves' self time only.
        "aten_calls": sum(e.count for e in events),
        "aten_self_cpu_ms": sum(e.self_cpu_time_total for e in events) / 1000,
        "top_self_cpu_ms": {e.key: e.self_cpu_time_total / 1000 for e in top},
    }
    if device.type == "cuda":
        kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and not e.key.startswith("aten::")]
        result["gpu_kernel_launches"] = sum(e.count for e in kernels)
        result["gpu_kernel_ms"] = sum(e.self_device_time_total for e in kernels) / 1000
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {STAGE}.step_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", help=f"the stage to measure, 07 or later (default: {STAGE[:2]}, this one)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--context", type=int, default=256, help="tokens of each sequence (default: 256)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=BATCH_SIZES)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="profile one step at the smallest and largest batch")
    parser.add_argument("--name", help="the result file's name (default: NN_name_decode_steps)")
    args = parser.parse_args(argv)
    device, dtype = device_and_dtype(args.device, args.dtype)
    folder = stage_folder(args.stage) if args.stage else STAGE
    Engine, EngineConfig, StepInput = stage_parts(folder)  # noqa: N806 (classes)
    engine = Engine(EngineConfig(model=args.model, device=device, dtype=dtype, max_num_seqs=max(args.batch_sizes)))
    runner, graphs = engine.runner, engine.runner.capture_seconds is not None
    block_size = engine.kv_cache.shape.block_size
    rows, profiles = [], {}
    with torch.inference_mode():
        for batch_size in args.batch_sizes:
            step = decode_step(StepInput, batch_size, args.context, block_size)
            bucket = bucket_of(batch_size, runner.sizes)
            eager = time_ms(lambda: runner.run_eager(step), engine.device, args.repeats)  # noqa: B023 (called now)
            static = time_ms(lambda: runner.execute(step), engine.device, args.repeats)  # noqa: B023 (the logits too)
            rows.append({"batch_size": batch_size, "bucket": bucket, "eager_ms": eager, "static_ms": static,
                         "graphs": graphs})
            print(f"batch {batch_size:3d} (bucket {bucket:3d}): eager {eager:8.2f} ms, static "
                  f"{'(graph) ' if graphs else ''}{static:8.2f} ms", flush=True)
        if args.profile:
            for batch_size in (min(args.batch_sizes), max(args.batch_sizes)):
                step = decode_step(StepInput, batch_size, args.context, block_size)
                profiles[f"eager_{batch_size}"] = profile_step(lambda: runner.run_eager(step), engine.device)  # noqa: B023
                profiles[f"static_{batch_size}"] = profile_step(lambda: runner.execute(step),  # noqa: B023
                                                                engine.device)
                for key in (f"eager_{batch_size}", f"static_{batch_size}"):
                    p = profiles[key]
                    print(f"{key}: {p['aten_calls']} aten calls, {p['aten_self_cpu_ms']:.1f} ms inside them of "
                          f"{p['wall_ms_under_profiler']:.1f} ms (under the profiler)", flush=True)
    result = {"name": args.name or f"{folder}_decode_steps", "stage": folder, "device": device, "dtype": dtype,
              "context": args.context, "capture_seconds": engine.runner.capture_seconds,
              "graph_memory_bytes": engine.runner.graph_memory_bytes, "buckets": runner.sizes,
              "machine": machine_info(device), "command": shlex.join(sys.orig_argv), **git_state(),
              "date": datetime.now(UTC).isoformat(timespec="seconds"), "steps": rows, "profiles": profiles}
    out = RESULTS / device / f"{result['name']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(result) + "\n")
    print(f"Wrote {out}")


if __name__ == "__main__":
    main()
