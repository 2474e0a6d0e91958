"""``make gpu-check``: on a GPU machine, what the CPU test suite cannot show, in parts that fit a short lease.

A GPU is often lent for minutes, not hours: one command of ten minutes at most (nine, to be safe), on a machine
that cannot reach the internet and has its own PyTorch, Triton and transformers. So the check comes in named
parts, each a fixed plan of commands with a timeout each, and each part's timeouts add up to ``PART_BUDGET_S``
at most (the kernels part's to ``KERNELS_BUDGET_S``):

* **smoke**: every stage's demo with ``--device cuda`` (the Triton kernels; the PyTorch reference too where a
  stage brings new kernels), and the stage with ranks under ``torchrun --nproc-per-node 1``: one rank whose
  collectives all go through NCCL. The gateway's demo needs Ray, and is skipped, saying so, where it is missing.
* **correctness**: the GPU tests (``pytest -m cuda``) one file at a time, those written for the GPU alone first
  (``tests/test_cuda.py``, then stage 07's graph replay), then every stage's tokens against Hugging Face; last
  the gateway's GPU tests (replicas sharing one GPU), where Ray imports (else one line says why not).
* **kernels**: the attention kernels' grid of shapes against the PyTorch reference, once per version of
  ``triton_attention.py`` (a stage whose copy is byte-identical to an earlier stage's is not tested again),
  newest first; five minutes at most, because Triton compiles each shape once.
* **speed**: the decode step at batch 1, 16 and 64, eager and replayed, of the first stage with CUDA graphs and
  of the latest (``common/step_profile.py``: the median of 20, each step's kernels by name from the profiler);
  the served sweep at concurrency 1 and 64 of the stage before graphs, the first with them and the latest
  (``common/bench.py``: ITL and tokens/s); nano-vllm's throughput workload (256 sequences, 100 to 1,024 tokens
  in and out) on the latest stage's offline engine and on transformers' continuous batching, same weights
  (``common/throughput.py``). Then a one-screen summary of it all.

A command that outlives its timeout is stopped with everything it started (servers, ranks): no part can hang.
Each part prints what it runs, how long each command took and what failed, writes ``<part>.log`` (every
command's output) and ``<part>.json`` (the summary) into ``results/cuda/<gpu>/`` (the GPU's name as a folder,
``nvidia-h200``: a run on one GPU never overwrites another's), and exits non-zero when a command failed or ran
out of time. The benchmarks write their JSON and figures beside them, each record with the GPU's name, the
torch and triton versions and the commit (added to a record that lacks them). With ``$OUT`` set (a lent
machine's folder of results to send back), that folder is copied there after every command, as
``$OUT/results/cuda/<gpu>/``: what finished comes back even if the lease ends first.

Nothing is downloaded and nothing replaces the machine's own packages: ``--install-wheels FOLDER`` installs only
the wheels whose project this Python lacks (``requirements-gpu.txt`` lists them), with ``--no-index --no-deps``,
into a folder of their own. No model wheel either: without the embedded model a random-weight checkpoint with
SmolLM2-135M's configuration and tokenizer is built (``common/random_model.py``), and correctness is checked
against Hugging Face on those same weights.

    python -m common.gpu_check --part smoke|correctness|kernels|speed|all [--model FOLDER] [--out DIR] [--dry-run]
    python -m common.gpu_check --install-wheels wheels [--site .venv/cuda-site]
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .gpu_env import RESULTS, gpu_slug
from .random_model import random_model_dir
from .weights import DEFAULT_MODEL, ModelNotFound, resolve_model

REPO = Path(__file__).resolve().parent.parent
SITE = REPO / ".venv" / "cuda-site"  # the wheels the machine lacked, on PYTHONPATH (make ... CUDA=1)
PARTS = ("smoke", "correctness", "kernels", "speed")
# A lent GPU runs one command for 10 minutes at most; a minute of it is left for installing the wheels, building
# the random model and copying the results back.
PART_BUDGET_S = 540
KERNELS_BUDGET_S = 300  # the kernels part: five minutes
MIN_CHECK_S = 5  # less than this left of a part's budget: its remaining commands are not started
NO_GPU_NAME = "GPU-NAME"  # the dry run's stand-in for the folder named after the GPU (results/cuda/<gpu>/)

# Each command's timeout, in seconds. Most of a demo's or a sweep's time is starting up (imports, weights, Triton's
# compilation, graph capture); each <part>.json records what every command took, to set these from. On an H200
# (results/cuda/gpu-check/smoke.json, correctness.json): a stage's demo 17-23 s, under torchrun 27 s. Eleven stages'
# demos, two of them also under torchrun, fit the part's budget with these (test_gpu_check adds them up).
DEMO_S = 30
REFERENCE_DEMO_S = 25  # the PyTorch reference instead of the Triton kernels: nothing to compile
TORCHRUN_S = 40
GATEWAY_DEMO_S = 100  # Ray, two models' replicas, and a second random model built once (skipped where Ray is not)
# The GPU tests, by file: the tests written for the GPU first, then the stages' tokens against Hugging Face. On an
# H200: test_cuda 78 s, test_sync 6 s, test_07_cuda_graphs 21 s, test_all_stages 72 s (alone).
TEST_FILES_S = {"test_cuda.py": 150, "test_sync.py": 30, "test_07_cuda_graphs.py": 45, "test_all_stages.py": 150,
                "test_fused_kernels.py": 45}
GATEWAY_TESTS_S = 120  # the gateway's GPU tests: Ray started, two replicas of a model sharing the GPU
KERNEL_TESTS = "test_attention.py"  # the kernel grid: the kernels part, not the correctness part
TEST_TIMEOUT_S = 150  # one test, where pytest-timeout is installed
# The speed part. A step profile: a demo's start-up (~20 s), then 3 sizes x 2 paths x 21 steps and 6 profiled steps.
STEP_PROFILE_S = 60
STEP_BATCH_SIZES, STEP_REPEATS = ("1", "16", "64"), "20"
# A served sweep: a server's start-up (~20 s), a warm-up, then 64 requests of 16 tokens one at a time and 64 at once.
# Without graphs a token takes ~38 ms at concurrency 1 (stage 06 on an H100): 64 x (44 + 15 x 38) ms = 39 s.
SWEEP_LEVELS, SWEEP_REQUESTS, SWEEP_TOKENS = ("1", "64"), "64", "16"
SWEEP_S = 60
EAGER_SWEEP_S = 90  # the stage before graphs: its 64 requests at concurrency 1 take ~40 s
# nano-vllm's workload: 133,966 output tokens (142,827 in). The stage: start-up with 256 sequences' buckets captured,
# then ~1,040 steps of up to 256 sequences; transformers: its model, its cache and graphs, then the same tokens.
THROUGHPUT_S = 100
PEER_THROUGHPUT_S = 110
THROUGHPUT_DTYPE = "bfloat16"

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


def servers() -> list[str]:
    """The stages that are one server process (not a gateway's fleet), in course order."""
    return [folder for folder in stage_folders() if not is_gateway(folder)]


def latest_server() -> str:
    """The latest stage that is one server: the one the speed part measures besides the lessons' own."""
    return servers()[-1]


def first_with_graphs() -> str:
    """The first stage whose decode steps replay CUDA graphs: the first with a step benchmark."""
    return next(folder for folder in servers() if (REPO / folder / "step_bench.py").is_file())


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


def versions_of(name: str) -> dict[str, list[str]]:
    """Each version of a stage file ``name``: the first stage that has it, with every stage whose copy is
    byte-identical to it (later ones, or after a stage with another version), in course order."""
    versions: dict[str, list[str]] = {}
    first_of: dict[str, str] = {}
    for folder in stage_folders():
        path = REPO / folder / name
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            first = first_of.setdefault(digest, folder)
            versions.setdefault(first, []).append(folder)
    return versions


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def no_ray() -> str | None:
    """Why the gateway cannot run here, or None."""
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed here (the gateway's replicas run on Ray Serve; carry its wheels to run them)"
    return None


def smoke(model: str) -> list[Check]:
    """Every stage's demo on CUDA; the PyTorch reference where a stage brings new kernels; one rank under torchrun."""
    checks = []
    for folder in stage_folders():
        demo = python("-m", folder, "--demo", "--device", "cuda", "--model", model)
        if is_gateway(folder):  # two models' replicas on this one GPU, each sizing its pool from its share
            fleet = ["--replica-gpus", "0.25"]  # four replicas on the GPU, each its quarter
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


def has_cuda_tests(path: Path) -> bool:
    return path.is_file() and re.search(r"\bpytest\.mark\.cuda\b", path.read_text()) is not None


def gateway_test_files() -> list[str]:
    """The test file of each gateway stage (tests/test_11_gateway.py): run only where Ray is."""
    return [f"test_{folder}.py" for folder in stage_folders() if is_gateway(folder)]


def cuda_test_files() -> list[str]:
    """The test files that hold cuda-marked tests, those TEST_FILES_S names first, in its order; the kernel grid
    and the gateway's files (see gateway_tests) left out."""
    found = {p.name for p in (REPO / "tests").glob("test_*.py") if has_cuda_tests(p)}
    found -= {KERNEL_TESTS, *gateway_test_files()}
    named = [name for name in TEST_FILES_S if name in found]
    return [*named, *sorted(found - set(named))]


def pytest_command(*args: str) -> list[str]:
    """``pytest -m cuda`` with every test's outcome on its own line, and a timeout per test where it can."""
    per_test = ["--timeout", str(TEST_TIMEOUT_S)] if importlib.util.find_spec("pytest_timeout") else []
    return python("-m", "pytest", "-m", "cuda", "-v", "-p", "no:cacheprovider", *per_test, *args)


def gateway_tests(model: str) -> list[Check]:
    """The gateway's GPU tests (replicas sharing one GPU, each within its memory budget): where Ray imports, and
    once the file has cuda-marked tests; else skipped, saying why in one line."""
    checks = []
    for name in gateway_test_files():
        why = no_ray() or (None if has_cuda_tests(REPO / "tests" / name) else f"tests/{name} has no GPU test yet")
        checks.append(Check(f"pytest -m cuda {name} (replicas sharing the GPU)", pytest_command(f"tests/{name}"),
                            GATEWAY_TESTS_S, {"LLM_COURSE_MODEL": model}, skip=why))
    return checks


def correctness(model: str) -> list[Check]:
    """Each file of GPU tests, with its timeout from TEST_FILES_S (a file the table does not name yet gets an even
    share of what the named ones and the gateway's leave of the part's budget), then the gateway's."""
    files = cuda_test_files()
    gateway = gateway_tests(model)
    others = [name for name in files if name not in TEST_FILES_S]
    left = PART_BUDGET_S - sum(TEST_FILES_S[name] for name in files if name in TEST_FILES_S) - sum(
        check.timeout_s for check in gateway)
    return [*[Check(f"pytest -m cuda {name}", pytest_command(f"tests/{name}"),
                    TEST_FILES_S.get(name) or left // len(others), {"LLM_COURSE_MODEL": model}) for name in files],
            *gateway]


def kernel_versions() -> dict[str, list[str]]:
    """The attention kernels' versions: for each distinct ``triton_attention.py``, the first stage with it and the
    stages that share it, newest version first."""
    return dict(reversed(versions_of("triton_attention.py").items()))


def kernels(model: str) -> list[Check]:
    """The kernel grid once per version of the Triton kernels, newest first, KERNELS_BUDGET_S shared evenly: the
    tests of the first stage with that version, and the whole-model tests of every stage that shares it
    (test_stage03_..., test_stage04_...), as `make test STAGE=NN` selects them."""
    versions = kernel_versions()
    return [Check(f"pytest -m cuda {KERNEL_TESTS}, {first}", pytest_command(f"tests/{KERNEL_TESTS}", "-k", selected),
                  KERNELS_BUDGET_S // len(versions), {"LLM_COURSE_MODEL": model})
            for first, sharing in versions.items()
            for selected in [" or ".join([first, *(f"stage{folder[:2]}" for folder in sharing)])]]


def speed(model: str, out: Path) -> list[Check]:
    """The decode step of the first stage with graphs and of the latest; the served sweep (concurrency 1 and 64)
    of the stage before graphs, the first with them and the latest; nano-vllm's throughput workload on the latest
    stage and on transformers. Every result into ``out``."""
    graphs, latest = first_with_graphs(), latest_server()
    before = servers()[servers().index(graphs) - 1]
    steps = [Check(f"{folder} decode step (batch {', '.join(STEP_BATCH_SIZES)})",
                   python("-m", "common.step_profile", "--stage", folder[:2], "--device", "cuda", "--model", model,
                          "--batch-sizes", *STEP_BATCH_SIZES, "--repeats", STEP_REPEATS, "--out", str(out)),
                   STEP_PROFILE_S)
             for folder in dict.fromkeys([graphs, latest])]
    sweeps = [Check(f"{folder} served (concurrency {' and '.join(SWEEP_LEVELS)})",
                    python("-m", "common.bench", "--stage", folder[:2], "--device", "cuda", "--model", model,
                           "--levels", *SWEEP_LEVELS, "--requests", SWEEP_REQUESTS, "--max-tokens", SWEEP_TOKENS,
                           "--name", f"{folder}_c{'_c'.join(SWEEP_LEVELS)}", "--out", str(out)),
                    EAGER_SWEEP_S if folder == before else SWEEP_S)
              for folder in dict.fromkeys([before, graphs, latest])]
    workload = ["--stage", latest[:2], "--device", "cuda", "--dtype", THROUGHPUT_DTYPE, "--model", model,
                "--out", str(out)]
    throughput = [Check(f"{latest} throughput (nano-vllm's workload, offline)",
                        python("-m", "common.throughput", *workload), THROUGHPUT_S),
                  Check("transformers throughput (nano-vllm's workload, continuous batching)",
                        python("-m", "common.throughput", *workload, "--peer", "transformers"), PEER_THROUGHPUT_S)]
    return [*steps, *sweeps, *throughput]


def budget(part: str) -> int:
    """The most a part may take, its timeouts' sum at most."""
    return KERNELS_BUDGET_S if part == "kernels" else PART_BUDGET_S


def plan(part: str, model: str, out: Path) -> list[Check]:
    return {"smoke": lambda: smoke(model), "correctness": lambda: correctness(model),
            "kernels": lambda: kernels(model), "speed": lambda: speed(model, out)}[part]()


def out_dir(gpu: str | None) -> Path:
    """Where a GPU's results go: results/cuda/<its name as a folder>/ (NO_GPU_NAME's in a dry run)."""
    return RESULTS / "cuda" / (gpu_slug(gpu) if gpu else NO_GPU_NAME)


def mirror_dir(out: Path) -> Path | None:
    """Where ``out`` is copied to when $OUT is set (a lent machine sends back what is there): the same path under
    it as in the repository (``$OUT/results/cuda/<gpu>/``), else ``$OUT/<out's name>``."""
    target = os.environ.get("OUT")
    if not target:
        return None
    try:
        relative = out.resolve().relative_to(REPO)
    except ValueError:
        relative = Path(out.name)
    return Path(target) / relative


def mirror(out: Path) -> None:
    """Copy ``out`` under $OUT, when set (after every command: what is finished comes back if the lease ends)."""
    target = mirror_dir(out)
    if target is not None and out.is_dir() and target.resolve() != out.resolve():
        shutil.copytree(out, target, dirs_exist_ok=True)


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


# pytest -v's line for a test's outcome: its node id (whose parameters may hold spaces: "[(0, 130)]"), then the
# outcome (a skip's or xfail's reason after it), then its progress where pytest prints one. Not a line of the short
# summary ("FAILED tests/...::name - reason").
TEST_OUTCOME = re.compile(r"^\S+\.py::.*? (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \(.*\))?(?: +\[ *\d+%\])? *$",
                          re.MULTILINE)


def count_tests(output: str) -> dict[str, int]:
    """pytest -v's outcome per test, counted: also what a file stopped at its timeout got through."""
    counts: dict[str, int] = {}
    for status in TEST_OUTCOME.findall(output):
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


def stamp(out: Path, since: float, environment: dict[str, Any], skip: set[str]) -> None:
    """Give each JSON record written into ``out`` since ``since`` (a time.time()) that does not say which triton
    it ran with (a sweep of common/bench.py) the run's ``environment``: the GPU, torch, triton, the commit."""
    for path in sorted(out.glob("*.json")):
        if path.name in skip or path.stat().st_mtime < since - 1:  # a coarse clock's second
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or "triton" in record or "environment" in record:
            continue
        record["environment"] = environment
        try:
            from .bench import dumps  # the sweeps' own layout: one line per record
        except ImportError:
            dumps = lambda value: json.dumps(value, indent=1)  # noqa: E731
        path.write_text(dumps(record) + "\n")


def run_part(part: str, checks: list[Check], out: Path, context: dict) -> bool:
    """Run a part's checks within its budget (``budget``); write <part>.log and <part>.json, copied under $OUT
    after each command when it is set; True if every check passed or was skipped for a reason (a check that
    failed, ran out of time or found no time left fails the part)."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{part}.log"
    log.write_text(f"make gpu-check PART={part}: {json.dumps(context)}\n")
    limit = budget(part)
    print(f"===== {part}: {len(checks)} commands, {limit} s at most; results in {out}"
          + (f", copied to {mirror_dir(out)}" if mirror_dir(out) else ""), flush=True)
    started = time.time()
    deadline = time.monotonic() + limit
    outcomes = []
    for check in checks:
        check_started = time.time()
        outcomes.append(run_check(check, log, deadline - time.monotonic()))
        stamp(out, check_started, context, {f"{name}.json" for name in PARTS})
        mirror(out)
    bad = [o.name for o in outcomes if o.status in ("failed", "timeout", "not started")]
    skipped = [o.name for o in outcomes if o.status == "skipped"]
    seconds = round(sum(o.seconds for o in outcomes))
    (out / f"{part}.json").write_text(json.dumps({"part": part, **context, "seconds": seconds,
                                                  "checks": [asdict(o) for o in outcomes]}, indent=2) + "\n")
    print(f"===== {part}: {len(outcomes) - len(bad) - len(skipped)} of {len(outcomes)} passed in {seconds} s"
          + (f"; FAILED or not finished: {', '.join(bad)}" if bad else "")
          + (f"; skipped: {', '.join(skipped)}" if skipped else "") + f"; {log}", flush=True)
    if part == "speed":
        lines = speed_summary(out, started)
        (out / "speed-summary.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    mirror(out)
    return not bad


# --- the speed part's summary --------------------------------------------------------------------


def read_records(out: Path, pattern: str, since: float) -> list[dict[str, Any]]:
    """The JSON records in ``out`` matching ``pattern`` written since ``since``, by name."""
    records = []
    for path in sorted(out.glob(pattern)):
        if path.stat().st_mtime >= since - 1:
            try:
                records.append(json.loads(path.read_text()))
            except ValueError:
                continue
    return records


def speed_summary(out: Path, since: float = 0) -> list[str]:
    """One screen: the decode steps (ms, kernels per step), the served sweeps (ITL p50, tokens/s) and the
    throughput workload (tokens/s), from the records the speed part wrote into ``out`` since ``since``."""
    lines = []
    steps = read_records(out, "*_decode_steps.json", since)
    if steps:
        lines += ["Decode step (median ms; GPU kernels per step, from the profiler)",
                  f"  {'stage':20} {'batch':>5} {'eager':>8} {'replayed':>9} {'faster':>7} {'kernels e/r':>15}"]
        for record in steps:
            profiles = record.get("profiles", {})
            for row in record.get("steps", []):
                n = row["batch_size"]
                kernels = [profiles.get(f"{path}_{n}", {}).get("gpu_kernel_launches") for path in ("eager", "static")]
                counted = "/".join("-" if k is None else str(k) for k in kernels)
                faster = row["eager_ms"] / row["static_ms"] if row["static_ms"] else float("nan")
                lines.append(f"  {record['stage']:20} {n:>5} {row['eager_ms']:>8.2f} {row['static_ms']:>9.2f} "
                             f"{faster:>6.1f}x {counted:>15}")
    sweeps = [r for r in read_records(out, "*.json", since) if "levels" in r and "workload" in r]
    if sweeps:
        lines += ["Served (ITL p50, output tokens/s)",
                  f"  {'stage':28} " + " ".join(f"{'c=' + str(level['concurrency']):>18}"
                                               for level in sweeps[0]["levels"])]
        for record in sweeps:
            cells = []
            for level in record["levels"]:
                itl = (level.get("itl_s") or {}).get("p50")
                itl_ms = "-" if itl is None else f"{1000 * itl:.1f}"
                cells.append(f"{itl_ms:>6} ms {level['output_tokens_per_s']:>6.0f}/s")
            lines.append(f"  {record['name']:28} " + " ".join(f"{cell:>18}" for cell in cells))
    throughput = read_records(out, "throughput_*.json", since)
    if throughput:
        lines.append("Throughput, nano-vllm's workload (output tokens / wall time)")
        for record in throughput:
            rate = record.get("tokens_per_s")
            done = "" if record.get("complete") else " (stopped before the end)"
            lines.append(f"  {record['name']:36} {record['output_tokens']:>8} tokens in "
                         f"{record['seconds'] or 0:>7.1f} s: {rate or 0:>8.0f} tokens/s{done}")
        rates = {r["name"]: r.get("tokens_per_s") for r in throughput if r.get("complete")}
        peer = rates.pop("throughput_transformers", None)
        for name, rate in rates.items():
            if peer and rate:
                lines.append(f"  {name.removeprefix('throughput_')} / transformers: {rate / peer:.2f}x")
    return lines or ["(the speed part wrote no results)"]


def print_plan(parts: list[str], model: str, out: Path) -> None:
    """What each part would run, with its timeouts and their sum: nothing runs, and no GPU is needed."""
    for part in parts:
        checks = plan(part, model, out)
        print(f"{part}: {len(checks)} commands, {sum(c.timeout_s for c in checks)} s of timeouts "
              f"(at most {budget(part)} s)")
        for check in checks:
            env = "".join(f"{k}={shlex.quote(v)} " for k, v in check.env.items())
            status = f"skipped: {check.skip}" if check.skip else f"{check.timeout_s:>4} s"
            print(f"  {status}  {check.name}: {env}{shlex.join(check.command)}")
    where = mirror_dir(out)
    print(f"  results in {out}" + (f", copied to {where}" if where else " (and under $OUT/ when it is set)"))


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
    parser.add_argument("--out", type=Path, help="where the logs, summaries and results go (default: "
                                                  "results/cuda/<the GPU's name>/; copied under $OUT when set)")
    parser.add_argument("--dry-run", action="store_true", help="print each part's commands and timeouts, run nothing")
    parser.add_argument("--install-wheels", type=Path, metavar="FOLDER",
                        help="install the wheels in FOLDER that this Python lacks (offline, --no-deps), then exit")
    parser.add_argument("--site", type=Path, default=SITE, help="where --install-wheels installs")
    args = parser.parse_args(argv)
    parts = list(PARTS) if args.part == "all" else [args.part]
    if args.install_wheels:
        return install_wheels(args.install_wheels, args.site)
    if args.dry_run:
        print_plan(parts, args.model or "MODEL", args.out or out_dir(None))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("make gpu-check: CUDA is not usable here (run it on a GPU machine, with CUDA=1)")
        return 2
    from .gpu_env import environment

    model, kind = pick_model(args.model)
    out = args.out or out_dir(torch.cuda.get_device_name())
    out.mkdir(parents=True, exist_ok=True)
    context = {"device": torch.cuda.get_device_name(), **environment("cuda"), "model": str(model),
               "model_kind": kind}
    passed = [run_part(part, plan(part, str(model), out), out, context) for part in parts]
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
