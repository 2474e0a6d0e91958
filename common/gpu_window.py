"""One lent GPU's window as one command: what a GPU issue runs, a part of ``make gpu-check`` with what it needs
around it, every command with its timeout, their sum within one call.

A lent GPU runs one command of 10 minutes at most, offline, on a fresh machine, and sends back at most 8 files
from ``$OUT`` (none more than two folders down). So the window runs, in order, each under its timeout:

1. ``env``: the machine (nvidia-smi, the versions of torch, triton, transformers; whether flash-attention, the
   Hub's ``kernels``, pytest-timeout, Ray and gguf import) into ``$OUT/env.txt``;
2. ``install``: the wheels of ``wheels/`` the machine lacks (``common.gpu_check --install-wheels``);
3. ``triton cache``: a Triton cache carried from the last window (``scripts/carry/triton-cache.tgz``) unpacked
   into the window's one cache (``TRITON_CACHE_DIR``), so that kernels compiled and tuned then are not again;
4. ``model``: the real model where its GGUF's parts came (``common/gguf_parts.py``: joined, checked, converted),
   else the random-weight one (``common/random_model.py``, what ``gpu_check`` picks without the embedded model);
5. the part (``python -m common.gpu_check --part P --budget S``): its results packed into
   ``$OUT/results-<gpu>.tgz`` after every command;
6. the Triton cache packed into ``$OUT/triton-cache.tgz`` (when it is at most CACHE_MAX_BYTES: one file comes
   back at 16 MiB at most), for the next window to carry; and ``$OUT/summary.txt``: each step's status and
   seconds, then the part's summary.

    python -m common.gpu_window speed --dry-run     # the plan: each command's timeout, the sum, whether it fits
    python3 -m common.gpu_window speed              # on the GPU machine: run(command=..., carry=["wheels"])

The sum of the timeouts is at most WINDOW_S, which leaves the call's 600 s its transfers and a margin: the dry run
prints it for each part, and test_gpu_check adds it up.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from . import gguf_parts, gpu_check
from .gpu_check import PARTS, REPO, Check

WINDOW_S = 590  # the whole window: a lent GPU's command is 600 s at most (run with timeout_s=600)
ENV_S, INSTALL_S, CACHE_S, RANDOM_MODEL_S, REAL_MODEL_S, PACK_S = 10, 20, 5, 25, 60, 10
PART_OVERHEAD_S = 15  # gpu_check around its commands: imports, a stopped command's 10 s grace, the last packing
CARRIED_CACHE = REPO / "scripts" / "carry" / "triton-cache.tgz"  # ignored: travels when a call's carry names it
TRITON_CACHE = Path("/tmp/llm-course-triton")  # the window's one Triton cache
REAL_MODEL = Path("/tmp/llm-course-smollm2")  # the real model, converted from its joined GGUF
CACHE_MAX_BYTES = 15 * (1 << 20)  # a file that comes back is 16 MiB at most
PROBES = ("flash_attn", "flash_attn_interface", "kernels", "pytest_timeout", "ray", "gguf", "fastapi")


@dataclass(frozen=True)
class Step:
    """One command of the window, or work done in this process (``command`` empty), with its timeout."""

    name: str
    command: list[str]
    timeout_s: int


def out_dir() -> Path:
    return Path(os.environ.get("OUT") or "/tmp/out")


def has_gguf_parts() -> bool:
    """The real model's parts came with this call, or an earlier call of the lease stashed them."""
    return any(gguf_parts.CARRY.glob("*.part[0-9][0-9]")) or (gguf_parts.STASH / gguf_parts.MANIFEST).is_file()


def plan(part: str, real_model: bool) -> tuple[list[Step], list[Check], int]:
    """The steps around the part, the part's own commands (gpu_check's plan) and the budget the part gets."""
    model = str(REAL_MODEL) if real_model else "MODEL"
    checks = gpu_check.plan(part, model, gpu_check.out_dir(None), "given" if real_model else gpu_check.RANDOM_KIND)
    python = gpu_check.python
    build = (python("-m", "common.gguf_parts", "join", "--convert", str(REAL_MODEL)), REAL_MODEL_S) if real_model \
        else (python("-m", "common.random_model"), RANDOM_MODEL_S)
    around = ENV_S + INSTALL_S + CACHE_S + build[1] + PACK_S + PART_OVERHEAD_S
    budget = min(gpu_check.budget(part), sum(c.timeout_s for c in checks), WINDOW_S - around)
    part_command = python("-m", "common.gpu_check", "--part", part, "--budget", str(budget),
                          *(["--model", str(REAL_MODEL)] if real_model else []))
    steps = [Step("env", python("-m", "common.gpu_window", "--report-env"), ENV_S),
             Step("install", python("-m", "common.gpu_check", "--install-wheels", "wheels", "--site",
                                    str(gpu_check.SITE)), INSTALL_S),
             Step("triton cache", [], CACHE_S),
             Step("model", *build),
             Step(f"part {part}", part_command, budget + PART_OVERHEAD_S),
             Step("pack triton cache", [], PACK_S)]
    return steps, checks, budget


def print_plan(part: str, real_model: bool) -> int:
    """The window's steps with their seconds, the part's commands inside its step, the total; 1 if it does not fit."""
    steps, checks, budget = plan(part, real_model)
    total = sum(step.timeout_s for step in steps)
    print(f"window for part {part}{' (the real model)' if real_model else ''}: {total} s of timeouts, at most "
          f"{WINDOW_S} s: {'fits' if total <= WINDOW_S else 'DOES NOT FIT'}")
    for step in steps:
        print(f"  {step.timeout_s:>4} s  {step.name}" + (f": {shlex.join(step.command)}" if step.command else ""))
        if step.name.startswith("part "):
            for check in checks:
                state = f"skipped ({check.skip})" if check.skip else ""
                print(f"         {check.timeout_s:>4} s  {check.name} {state}")
            planned = sum(c.timeout_s for c in checks)
            print(f"         {planned:>4} s  in all (the part's budget here: {budget} s" + (
                ")" if planned <= budget else ": its last commands start only where earlier ones end before their "
                                              "timeouts)"))
    return 0 if total <= WINDOW_S else 1


def report_env() -> int:
    """What the window's env.txt holds: which paths transformers can take, which wheels are needed."""
    for command in (["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                    ["nproc"], ["git", "log", "-1", "--format=commit %H %s"]):
        try:
            print(subprocess.run(command, capture_output=True, text=True, timeout=5, cwd=REPO).stdout.strip())
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"{command[0]}: {exc}")
    print("python", sys.version.split()[0])
    for name in ("torch", "triton", "transformers"):
        try:
            module = __import__(name)
            print(name, module.__version__, *(["cuda", module.version.cuda] if name == "torch" else []))
        except Exception as exc:  # an import that fails says why, the rest still prints
            print(f"{name}: {type(exc).__name__}: {exc}")
    for name in PROBES:
        print(f"{name}: {'yes' if importlib.util.find_spec(name) else 'no'}")
    return 0


def restore_cache(carried: Path, cache: Path) -> str:
    if not carried.is_file():
        return f"no carried cache ({carried}): kernels compile and tune afresh"
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(carried) as archive:
        archive.extractall(cache, filter="data")
    return f"unpacked {carried.name} into {cache}"


def pack_cache(cache: Path, target: Path, most: int = CACHE_MAX_BYTES) -> str:
    """The window's Triton cache as one archive under $OUT for the next window to carry, if it is small enough to
    come back (a larger one is left out, saying so)."""
    if not cache.is_dir():
        return "no Triton cache written"
    partial = target.with_name(f".{target.name}.partial")
    with tarfile.open(partial, "w:gz") as archive:
        archive.add(cache, arcname=".")
    if partial.stat().st_size > most:
        size = partial.stat().st_size
        partial.unlink()
        return f"Triton cache not packed: {size / (1 << 20):.1f} MiB packed, over {most / (1 << 20):.0f} MiB"
    partial.replace(target)
    return f"packed {target.name} ({target.stat().st_size / (1 << 20):.1f} MiB): carry it as " \
           f"{CARRIED_CACHE.relative_to(REPO)} next time"


def summaries(since: float) -> list[str]:
    """The part's summaries (``<part>-summary.txt``) written into results/cuda/*/ since ``since``."""
    found = [p for p in sorted((REPO / "results" / "cuda").glob("*/*-summary.txt")) if p.stat().st_mtime >= since]
    return [line for path in found for line in [f"--- {path.relative_to(REPO)}", *path.read_text().splitlines()]]


def run(part: str) -> int:
    """The window itself: each step under its timeout (capped to what is left of WINDOW_S), a line each in
    window.log and summary.txt under $OUT."""
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRITON_CACHE_DIR", str(TRITON_CACHE))
    os.environ.update(gpu_check.TRITON_ENV)
    # the wheels installed in step 2, for every later command
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(gpu_check.SITE), os.environ.get("PYTHONPATH")]))
    real = has_gguf_parts()
    steps, _, _ = plan(part, real)
    log, lines, started, failed = out / "window.log", [], time.monotonic(), False
    begun = time.time()
    for step in steps:
        left = WINDOW_S - (time.monotonic() - started)
        if not step.command:
            note = restore_cache(CARRIED_CACHE, Path(os.environ["TRITON_CACHE_DIR"])) if step.name == "triton cache" \
                else pack_cache(Path(os.environ["TRITON_CACHE_DIR"]), out / "triton-cache.tgz")
            lines.append(f"{step.name}: {note}")
        else:
            if step.name.startswith("part "):  # its budget: what the window has left after it, if that is less
                step = within(step, left - PART_OVERHEAD_S - PACK_S)
            with (out / "env.txt").open("w") if step.name == "env" else log.open("a") as sink:
                outcome = run_step(step, sink, left)
            failed |= not outcome.startswith("passed") and step.name != "env"
            lines.append(f"{step.name}: {outcome}")
        print(lines[-1], flush=True)
        with log.open("a") as sink:
            sink.write(f"== {lines[-1]}\n")
    (out / "summary.txt").write_text("\n".join([*lines, *summaries(begun)]) + "\n")
    return 1 if failed else 0


def within(step: Step, left_s: float) -> Step:
    """The part's step with its --budget at most ``left_s``: gpu_check then leaves its last commands unstarted,
    saying so, rather than being stopped before it packs what it has."""
    command = list(step.command)
    at = command.index("--budget") + 1
    budget = max(0, min(int(command[at]), int(left_s)))
    command[at] = str(budget)
    return Step(step.name, command, budget + PART_OVERHEAD_S)


def run_step(step: Step, sink: IO[str], left: float) -> str:
    """One command in its own process group, for its timeout at most (and what the window has left)."""
    timeout = min(step.timeout_s, left)
    if timeout < gpu_check.MIN_CHECK_S:
        return "not started: the window's time was spent"
    began = time.monotonic()
    process = subprocess.Popen(step.command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        status = "passed" if process.wait(timeout=timeout) == 0 else f"failed ({process.returncode})"
    except subprocess.TimeoutExpired:
        status = f"timeout after {timeout:.0f} s"
    finally:
        gpu_check.stop_group(process)
    return f"{status} in {time.monotonic() - began:.0f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.gpu_window", description=__doc__.split("\n\n")[0])
    parser.add_argument("part", nargs="?", choices=PARTS, help="the part of make gpu-check this window runs")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and whether it fits; run nothing")
    parser.add_argument("--real-model", action="store_true",
                        help="with --dry-run: plan as if the GGUF's parts had come (they decide it on the GPU)")
    parser.add_argument("--report-env", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.report_env:
        return report_env()
    if args.part is None:
        parser.error("which part?")
    if args.dry_run:
        return print_plan(args.part, args.real_model or has_gguf_parts())
    return run(args.part)


if __name__ == "__main__":
    sys.exit(main())
