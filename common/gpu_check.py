"""``make gpu-check``: on a GPU machine, what the CPU test suite cannot show, in parts that fit a short lease.

A GPU is often lent for minutes, not hours: one command of ten minutes at most, on a machine that cannot reach
the internet and has its own PyTorch, Triton and transformers. So the check comes in named parts, each a fixed
plan of commands with a timeout each, and each part's timeouts add up to ``PART_BUDGET_S`` at most:

* **smoke**: every stage's demo with ``--device cuda`` (the Triton kernels; the PyTorch reference too where a
  stage brings new kernels), and the stage with ranks under ``torchrun --nproc-per-node 1``: one rank whose
  collectives all go through NCCL. The gateway's demo needs Ray, and is skipped, saying so, where it is missing.
* **correctness**: the GPU tests (``pytest -m cuda``) one file at a time, those written for the GPU alone first
  (``tests/test_cuda.py``, then stage 07's graph replay), then every stage's tokens against Hugging Face.
* **kernels**: the attention kernels' grid of shapes against the PyTorch reference, for each stage that changed
  the attention, newest first; the longest part, because Triton compiles each shape once.
* **speed**: the decode step's profile (``NN_name.step_bench``) and the short sweep (``--quick``) of every stage
  that batches.

A command that outlives its timeout is stopped with everything it started (servers, ranks): no part can hang.
Each part prints what it runs, how long each command took and what failed, writes ``<part>.log`` (every
command's output) and ``<part>.json`` (the summary) into ``results/cuda/gpu-check/``, and exits non-zero when
a command failed or ran out of time. The benchmarks write their JSON and figures beside them; ``step_bench``
writes to ``results/cuda/`` as it always does.

Nothing is downloaded and nothing replaces the machine's own packages: ``--install-wheels FOLDER`` installs only
the wheels whose project this Python lacks (``requirements-gpu.txt`` lists them), with ``--no-index --no-deps``,
into a folder of their own. No model wheel either: without the embedded model a random-weight checkpoint with
SmolLM2-135M's configuration and tokenizer is built (``common/random_model.py``), and correctness is checked
against Hugging Face on those same weights.

    python -m common.gpu_check --part smoke|correctness|kernels|speed|all [--model FOLDER] [--dry-run]
    python -m common.gpu_check --install-wheels wheels [--site .venv/cuda-site]
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .random_model import random_model_dir
from .weights import DEFAULT_MODEL, ModelNotFound, resolve_model

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "results" / "cuda" / "gpu-check"
SITE = REPO / ".venv" / "cuda-site"  # the wheels the machine lacked, on PYTHONPATH (make ... CUDA=1)
PARTS = ("smoke", "correctness", "kernels", "speed")
# A lent GPU runs one command for 10 minutes at most; a minute of it is left for installing the wheels, building
# the random model and copying the results back.
PART_BUDGET_S = 540
FIRST_BENCHMARKED_STAGE = "04"  # the first stage that serves many requests at once
MIN_CHECK_S = 5  # less than this left of a part's budget: its remaining commands are not started

# Each command's timeout, in seconds. Most of a demo's or a sweep's time is starting up (imports, weights, Triton's
# compilation, graph capture); each <part>.json records what every command took, to set these from.
DEMO_S = 35
REFERENCE_DEMO_S = 25  # the PyTorch reference instead of the Triton kernels: nothing to compile
TORCHRUN_S = 45
GATEWAY_DEMO_S = 120  # Ray, two models' replicas, and a second random model built once
# The GPU tests, by file: the tests written for the GPU first, then the stages' tokens against Hugging Face.
TEST_FILES_S = {"test_cuda.py": 240, "test_sync.py": 45, "test_07_cuda_graphs.py": 45, "test_all_stages.py": 210}
KERNEL_TESTS = "test_attention.py"  # the kernel grid: the kernels part, not the correctness part
TEST_TIMEOUT_S = 150  # one test, where pytest-timeout is installed
STEP_BENCH_S = 50
PROFILED_STEP_BENCH_S = 65  # the first stage with static buffers: its step profiled too (--profile)
SWEEP_S = 50
GATEWAY_BENCH_S = 60

# What the checks import: the machine's own (torch, triton, transformers ...) and the wheels it may lack.
NEEDED_MODULES = ("torch", "triton", "transformers", "tokenizers", "safetensors", "pytest", "httpx", "matplotlib",
                  "fastapi", "starlette", "pydantic", "uvicorn", "prometheus_client")


@dataclass(frozen=True)
class Check:
    """One command of a part: what it is called, what it runs, and for how long at most."""

    name: str
    command: list[str]
    timeout_s: int
    env: dict[str, str] = field(default_factory=dict)
    skip: str | None = None  # why it cannot run on this machine: then it is reported, not run


@dataclass
class Outcome:
    """What one check did, for the part's summary."""

    name: str
    command: list[str]
    timeout_s: int
    status: str  # passed, failed, timeout, skipped (cannot run here) or not started (no time left)
    seconds: float = 0.0
    exit_code: int | None = None
    note: str = ""
    tests: dict[str, int] = field(default_factory=dict)  # a pytest command's tests by outcome, read off its output


# --- the plan ------------------------------------------------------------------------------------


def stage_folders() -> list[str]:
    return sorted(p.parent.name for p in REPO.glob("[0-9][0-9]_*/__main__.py"))


def is_gateway(folder: str) -> bool:
    """A stage that serves through a gateway of replicas (10 on), not one server process."""
    return (REPO / folder / "gateway.py").is_file()


def changes(folder: str, *files: str) -> bool:
    """The stage has one of ``files``, and it differs from the previous stage's (or no stage before has it)."""
    folders = stage_folders()
    previous = folders[folders.index(folder) - 1] if folders.index(folder) > 0 else None
    for name in files:
        path = REPO / folder / name
        if path.is_file() and (previous is None or not (REPO / previous / name).is_file()
                               or not filecmp.cmp(path, REPO / previous / name, shallow=False)):
            return True
    return False


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def no_ray() -> str | None:
    """Why the gateway cannot run here, or None."""
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed here (the gateway's replicas run on Ray Serve)"
    return None


def smoke(model: str) -> list[Check]:
    """Every stage's demo on CUDA; the PyTorch reference where a stage brings new kernels; one rank under torchrun."""
    checks = []
    for folder in stage_folders():
        demo = python("-m", folder, "--demo", "--device", "cuda", "--model", model)
        if is_gateway(folder):  # two models' replicas on this one GPU: a quarter of it each, a fifth of its memory
            fleet = ["--replica-gpus", "0.25", "--gpu-memory-utilization", "0.2"]
            checks.append(Check(f"{folder} demo", [*demo, *fleet], GATEWAY_DEMO_S, skip=no_ray()))
            continue
        checks.append(Check(f"{folder} demo", demo, DEMO_S))
        if changes(folder, "triton_attention.py"):
            reference = {"LLM_ATTENTION": "torch"}
            checks.append(Check(f"{folder} demo (PyTorch attention)", demo, REFERENCE_DEMO_S, reference))
        if (REPO / folder / "distributed.py").is_file():  # one rank, a process group all the same: NCCL's path
            torchrun = python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                              "-m", folder, "--demo", "--device", "cuda", "--model", model)
            checks.append(Check(f"{folder} demo (torchrun, one rank)", torchrun, TORCHRUN_S))
    return checks


def cuda_test_files() -> list[str]:
    """The test files that hold cuda-marked tests, those TEST_FILES_S names first, in its order; the kernel grid
    left out."""
    found = {p.name for p in (REPO / "tests").glob("test_*.py") if re.search(r"\bpytest\.mark\.cuda\b", p.read_text())}
    named = [name for name in TEST_FILES_S if name in found]
    return [*named, *sorted(found - set(named) - {KERNEL_TESTS})]


def pytest_command(*args: str) -> list[str]:
    """``pytest -m cuda`` with every test's outcome on its own line, and a timeout per test where it can."""
    per_test = ["--timeout", str(TEST_TIMEOUT_S)] if importlib.util.find_spec("pytest_timeout") else []
    return python("-m", "pytest", "-m", "cuda", "-v", "-p", "no:cacheprovider", *per_test, *args)


def correctness(model: str) -> list[Check]:
    """Each file of GPU tests, with its timeout from TEST_FILES_S; a file the table does not name yet gets an even
    share of what the named ones leave of the part's budget."""
    files = cuda_test_files()
    others = [name for name in files if name not in TEST_FILES_S]
    left = PART_BUDGET_S - sum(TEST_FILES_S[name] for name in files if name in TEST_FILES_S)
    return [Check(f"pytest -m cuda {name}", pytest_command(f"tests/{name}"),
                  TEST_FILES_S.get(name) or left // len(others), {"LLM_COURSE_MODEL": model}) for name in files]


def kernels(model: str) -> list[Check]:
    """The kernel grid of each stage that changed its attention, newest first, the part's budget shared evenly."""
    folders = [f for f in reversed(stage_folders()) if changes(f, "attention.py", "triton_attention.py")]
    # A stage's tests: its cases of the tests over stages, and its own (test_stage03_...), as `make test STAGE=03`.
    return [Check(f"pytest -m cuda {KERNEL_TESTS}, {f}", pytest_command(f"tests/{KERNEL_TESTS}", "-k", selected),
                  PART_BUDGET_S // len(folders), {"LLM_COURSE_MODEL": model})
            for f in folders for selected in [f"{f} or stage{f[:2]}"]]


def speed(model: str, out: Path) -> list[Check]:
    """The decode step timed (eager against static buffers) where the runner changed, and every batching stage's
    short sweep; the gateway's own benchmark (the hop through it) where Ray is."""
    steps, sweeps = [], []
    for folder in stage_folders():
        if is_gateway(folder):
            sweeps.append(Check(f"{folder} benchmark (the hop, quick)",
                                python("-m", f"{folder}.gateway_bench", "hop", "--quick", "--device", "cuda",
                                       "--model", model, "--out", str(out)), GATEWAY_BENCH_S, skip=no_ray()))
            continue
        if (REPO / folder / "step_bench.py").is_file() and changes(folder, "model_runner.py"):
            first = not steps
            steps.append(Check(f"{folder} decode step", python("-m", f"{folder}.step_bench", "--device", "cuda",
                                                                "--model", model, *(["--profile"] if first else [])),
                               PROFILED_STEP_BENCH_S if first else STEP_BENCH_S))
        if folder[:2] >= FIRST_BENCHMARKED_STAGE:
            sweeps.append(Check(f"{folder} sweep (quick)",
                                python("-m", "common.bench", "--stage", folder[:2], "--quick", "--device", "cuda",
                                       "--model", model, "--out", str(out)), SWEEP_S))
    return [*steps, *sweeps]


def plan(part: str, model: str, out: Path) -> list[Check]:
    return {"smoke": lambda: smoke(model), "correctness": lambda: correctness(model),
            "kernels": lambda: kernels(model), "speed": lambda: speed(model, out)}[part]()


# --- running it ----------------------------------------------------------------------------------


def stop_group(process: subprocess.Popen, grace_s: float = 10) -> None:
    """End the command and everything it started (a server, workers, torchrun's ranks): its process group."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def count_tests(output: str) -> dict[str, int]:
    """pytest -v's outcome per test, counted: also what a file stopped at its timeout got through."""
    counts: dict[str, int] = {}
    for status in re.findall(r"::\S+ (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", output):
        counts[status.lower()] = counts.get(status.lower(), 0) + 1
    return counts


def run_check(check: Check, log: Path, seconds_left: float) -> Outcome:
    """Run one check in its own process group, its output appended to ``log``, for its timeout at most (and no
    longer than the part has left)."""
    outcome = Outcome(check.name, check.command, check.timeout_s, "skipped")
    if check.skip:
        outcome.note = check.skip
        print(f"--- {check.name}: skipped: {check.skip}", flush=True)
        return outcome
    timeout = min(check.timeout_s, seconds_left)
    if timeout < MIN_CHECK_S:
        outcome.status, outcome.note = "not started", "the part's time was spent"
        print(f"--- {check.name}: not started: {outcome.note}", flush=True)
        return outcome
    print(f"--- {check.name} (at most {timeout:.0f} s): {shlex.join(check.command)}", flush=True)
    with log.open("a") as out:
        out.write(f"\n===== {check.name}\n$ {shlex.join(check.command)}\n")
        out.flush()
        start_byte, started = out.tell(), time.perf_counter()
        process = subprocess.Popen(check.command, cwd=REPO, env={**os.environ, **check.env, "PYTHONUNBUFFERED": "1"},
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            outcome.exit_code = process.wait(timeout=timeout)
            outcome.status = "passed" if outcome.exit_code == 0 else "failed"
        except subprocess.TimeoutExpired:
            outcome.status, outcome.note = "timeout", f"stopped after {timeout:.0f} s"
        finally:
            stop_group(process)
    outcome.seconds = round(time.perf_counter() - started, 1)
    with log.open() as written:
        written.seek(start_byte)
        outcome.tests = count_tests(written.read())
    tests = f"; tests: {outcome.tests}" if outcome.tests else ""
    print(f"    {outcome.status}{f' ({outcome.exit_code})' if outcome.status == 'failed' else ''} "
          f"in {outcome.seconds} s{tests}", flush=True)
    return outcome


def run_part(part: str, checks: list[Check], out: Path, context: dict) -> bool:
    """Run a part's checks within PART_BUDGET_S; write <part>.log and <part>.json; True if every check passed or
    was skipped for a reason (a check that failed, ran out of time or found no time left fails the part)."""
    log = out / f"{part}.log"
    log.write_text(f"make gpu-check PART={part}: {json.dumps(context)}\n")
    print(f"===== {part}: {len(checks)} commands, {PART_BUDGET_S} s at most", flush=True)
    deadline = time.monotonic() + PART_BUDGET_S
    outcomes = [run_check(check, log, deadline - time.monotonic()) for check in checks]
    bad = [o.name for o in outcomes if o.status in ("failed", "timeout", "not started")]
    skipped = [o.name for o in outcomes if o.status == "skipped"]
    seconds = round(sum(o.seconds for o in outcomes))
    (out / f"{part}.json").write_text(json.dumps({"part": part, **context, "seconds": seconds,
                                                  "checks": [asdict(o) for o in outcomes]}, indent=2) + "\n")
    print(f"===== {part}: {len(outcomes) - len(bad) - len(skipped)} of {len(outcomes)} passed in {seconds} s"
          + (f"; FAILED or not finished: {', '.join(bad)}" if bad else "")
          + (f"; skipped: {', '.join(skipped)}" if skipped else "") + f"; {log}", flush=True)
    return not bad


def print_plan(parts: list[str], model: str, out: Path) -> None:
    """What each part would run, with its timeouts and their sum: nothing runs, and no GPU is needed."""
    for part in parts:
        checks = plan(part, model, out)
        print(f"{part}: {len(checks)} commands, {sum(c.timeout_s for c in checks)} s of timeouts "
              f"(at most {PART_BUDGET_S} s)")
        for check in checks:
            env = "".join(f"{k}={shlex.quote(v)} " for k, v in check.env.items())
            status = f"skipped: {check.skip}" if check.skip else f"{check.timeout_s:>4} s"
            print(f"  {status}  {check.name}: {env}{shlex.join(check.command)}")


# --- what the machine needs ----------------------------------------------------------------------


def project_of(wheel: Path) -> str:
    """A wheel's project name, from its file name (name-version[-build]-python-abi-platform.whl)."""
    return wheel.name.split("-")[0]


def is_installed(project: str) -> bool:
    try:
        importlib.metadata.distribution(project)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def install_wheels(folder: Path, site: Path) -> int:
    """Install, offline, the wheels in ``folder`` whose project this Python does not have, into ``site`` (to be
    put on PYTHONPATH). ``--no-deps``: nothing the machine has is upgraded or downgraded, its torch, triton and
    transformers least of all. Then every module the checks import must be importable."""
    sys.path.insert(0, str(site))  # what an earlier run installed there counts as installed
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    missing = [wheel for wheel in wheels if not is_installed(project_of(wheel))]
    print(f"{len(wheels)} wheels in {folder}; {len(missing)} of them missing here"
          + (f": {', '.join(project_of(w) for w in missing)}" if missing else ""))
    site.mkdir(parents=True, exist_ok=True)
    if missing:
        subprocess.run(python("-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                              "--target", str(site), *map(str, missing)), check=True)
    failures = unimportable(NEEDED_MODULES)
    for failure in failures:
        print(f"cannot import {failure}")
    if failures:
        print(f"bring the missing wheels into {folder}/ (requirements-gpu.txt says how), then run this again")
    return 1 if failures else 0


def unimportable(modules: tuple[str, ...]) -> list[str]:
    """Each of ``modules`` that does not import, and why: also a wheel that needs a newer version of a package
    than the machine has."""
    importlib.invalidate_caches()
    failures = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or whatever a package raises when a dependency is too old
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    return failures


def pick_model(name: str | None) -> tuple[Path, str]:
    """The model to check with, and what it is: the embedded model when installed, else random weights."""
    if name:
        return resolve_model(name), "given"
    try:
        return resolve_model(DEFAULT_MODEL), "embedded"
    except ModelNotFound:
        return random_model_dir(), "random weights, SmolLM2-135M's configuration"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all", help="which part (default: all, in order)")
    parser.add_argument("--model", help="a model folder (default: the embedded model, else random weights)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--dry-run", action="store_true", help="print each part's commands and timeouts, run nothing")
    parser.add_argument("--install-wheels", type=Path, metavar="FOLDER",
                        help="install the wheels in FOLDER that this Python lacks (offline, --no-deps), then exit")
    parser.add_argument("--site", type=Path, default=SITE, help="where --install-wheels installs")
    args = parser.parse_args(argv)
    parts = list(PARTS) if args.part == "all" else [args.part]
    if args.install_wheels:
        return install_wheels(args.install_wheels, args.site)
    if args.dry_run:
        print_plan(parts, args.model or "MODEL", args.out)
        return 0

    import torch

    if not torch.cuda.is_available():
        print("make gpu-check: CUDA is not usable here (run it on a GPU machine, with CUDA=1)")
        return 2
    model, kind = pick_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    context = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": str(model),
               "model_kind": kind}
    passed = [run_part(part, plan(part, str(model), args.out), args.out, context) for part in parts]
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
