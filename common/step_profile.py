"""One decode step of a stage, eager against replayed, timed and profiled kernel by kernel: the speed part of
``make gpu-check``.

    python -m common.step_profile --stage 07 --device cuda                  # batch 1, 16, 64; median of 20
    python -m common.step_profile --stage 09 --device cuda --batch-sizes 1 64 --out results/cuda/nvidia-h200

It drives the step benchmark (``07_cuda_graphs/step_bench.py``, beside the lesson it measures: its decode step,
its bucket rule, its timer) on the stage's own Engine, and adds what the speed part needs of it: every batch size
profiled on both paths (``torch.profiler``), with the GPU's kernels of one step by name (how many launches of each,
their time), and the result filed under the GPU's name (``results/cuda/<gpu>/NN_name_decode_steps.json``) with
the GPU's name, the torch, triton and transformers versions and the commit, so that one GPU's run never overwrites
another's. The file has the step benchmark's own keys (``steps``, ``profiles``...), so whatever reads one reads this.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from .gpu_env import environment, results_dir
from .throughput import latest_stage, stage_folder
from .weights import DEFAULT_MODEL

REPO = Path(__file__).resolve().parents[1]
BATCH_SIZES = [1, 16, 64]
REPEATS = 20


def kernels_by_name(events: list[Any]) -> dict[str, dict[str, float]]:
    """The profiler's GPU kernels (events with device time that are no aten:: operator), by name: launches and
    milliseconds, the most launched first."""
    kernels: dict[str, dict[str, float]] = {}
    for event in events:
        if event.key.startswith("aten::") or getattr(event, "self_device_time_total", 0) <= 0:
            continue
        entry = kernels.setdefault(event.key, {"count": 0, "ms": 0.0})
        entry["count"] += event.count
        entry["ms"] += event.self_device_time_total / 1000
    return dict(sorted(kernels.items(), key=lambda item: (-item[1]["count"], -item[1]["ms"], item[0])))


def profile_step(run: Callable[[], Any], device: Any) -> dict[str, Any]:
    """One step under torch.profiler (after an untimed one): its operators and the share of its wall time inside
    them, as the step benchmark reports it, and on a GPU its kernels by name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall_us = 1e6 * (time.perf_counter() - start)
    averages = list(prof.key_averages())
    operators = [e for e in averages if e.key.startswith("aten::")]
    top = sorted(operators, key=lambda e: -e.self_cpu_time_total)[:8]
    result: dict[str, Any] = {
        "wall_ms_under_profiler": wall_us / 1000,
        "aten_calls": sum(e.count for e in operators),
        "aten_self_cpu_ms": sum(e.self_cpu_time_total for e in operators) / 1000,
        "top_self_cpu_ms": {e.key: e.self_cpu_time_total / 1000 for e in top},
    }
    if device.type == "cuda":
        kernels = kernels_by_name(averages)
        result["gpu_kernel_launches"] = sum(int(k["count"]) for k in kernels.values())
        result["gpu_kernel_ms"] = sum(k["ms"] for k in kernels.values())
        result["kernels"] = kernels
    return result


def step_bench() -> ModuleType:
    """The step benchmark: the first stage's with static buffers (07's), the one place it lives."""
    harness = min(path.parent.name for path in REPO.glob("[0-9][0-9]_*/step_bench.py"))
    return importlib.import_module(f"{harness}.step_bench")


def measure(folder: str, model: str, device: str, dtype: str, batch_sizes: list[int], repeats: int, context: int,
            profile: bool, quantization: str = "") -> dict[str, Any]:
    """The stage's decode step at each batch size, eager and from its static buffers (a replayed graph on CUDA)."""
    import torch

    bench = step_bench()
    Engine, EngineConfig, StepInput = bench.stage_parts(folder)  # noqa: N806 (classes)
    mode = {"quantization": quantization} if quantization else {}  # stage 11 on
    engine = Engine(EngineConfig(model=model, device=device, dtype=dtype, max_num_seqs=max(batch_sizes), **mode))
    try:
        runner = engine.runner
        block_size = engine.kv_cache.shape.block_size
        rows, profiles = [], {}
        with torch.inference_mode():
            for batch_size in batch_sizes:
                step = bench.decode_step(StepInput, batch_size, context, block_size)
                bucket = bench.bucket_of(batch_size, runner.sizes)
                paths = {"eager": lambda: runner.run_eager(step), "static": lambda: runner.execute(step)}  # noqa: B023
                times = {name: bench.time_ms(run, engine.device, repeats) for name, run in paths.items()}
                rows.append({"batch_size": batch_size, "bucket": bucket, "eager_ms": times["eager"],
                             "static_ms": times["static"], "graphs": runner.capture_seconds is not None})
                line = f"batch {batch_size:3d} (bucket {bucket}): eager {times['eager']:8.2f} ms, static " \
                       f"{times['static']:8.2f} ms"
                if profile:
                    for name, run in paths.items():
                        profiles[f"{name}_{batch_size}"] = p = profile_step(run, engine.device)
                        line += f"; {name}: {p['aten_calls']} aten calls" + (
                            f", {p['gpu_kernel_launches']} kernels" if "kernels" in p else "")
                print(line, flush=True)
        return {"stage": folder, "device": device, "dtype": dtype, "context": context, "repeats": repeats,
                "capture_seconds": runner.capture_seconds, "graph_memory_bytes": runner.graph_memory_bytes,
                "buckets": runner.sizes, "steps": rows, "profiles": profiles}
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.step_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", default=latest_stage(), help="the stage (default: the latest, %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=BATCH_SIZES)
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed steps per path and size (the median)")
    parser.add_argument("--context", type=int, default=256, help="tokens of each sequence (default: 256)")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="time only, no profiler")
    parser.add_argument("--quantization", default="", help="a quantized stage's mode (stage 11 on): int4, int8, none")
    parser.add_argument("--out", type=Path, help="folder for the JSON (default: results/cuda/<gpu>/ on a GPU)")
    args = parser.parse_args(argv)

    from .bench import device_and_dtype, dumps, machine_info
    from .cli import model_dir_or_exit

    folder = stage_folder(args.stage)
    device, dtype = device_and_dtype(args.device, args.dtype)
    model = str(model_dir_or_exit(args.model))
    measured = measure(folder, model, device, dtype, args.batch_sizes, args.repeats, args.context, args.profile,
                       args.quantization)
    suffix = f"_{args.quantization}" if args.quantization else ""
    result = {"name": f"{folder}_decode_steps{suffix}", **measured, "model": model, **environment(device),
              "machine": machine_info(device), "command": shlex.join(sys.orig_argv),
              "date": datetime.now(UTC).isoformat(timespec="seconds")}
    out = args.out or results_dir(device)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result['name']}.json"
    path.write_text(dumps(result) + "\n")
    print(f"Wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
