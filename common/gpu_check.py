"""``make gpu-check``: on a GPU machine, what the CPU test suite cannot show, in parts that fit a short lease.

A GPU is often lent for minutes, not hours: one command of ten minutes at most (nine, to be safe), on a machine
that cannot reach the internet and has its own PyTorch, Triton and transformers. So the check comes in named
parts, each a fixed plan of commands with a timeout each, and each part's timeouts add up to ``PART_BUDGET_S``
at most (the kernels part's to ``KERNELS_BUDGET_S``):

* **smoke**: every stage's demo with ``--device cuda`` (the Triton kernels; the PyTorch reference too where a
  stage brings new kernels), and the stage with ranks under ``torchrun --nproc-per-node 1``: one rank whose
  collectives all go through NCCL. The gateway's demo needs Ray, and is skipped, saying so, where it is missing.
* **correctness**: the GPU tests (``pytest -m cuda``) one file at a time, those written for the GPU alone first
  (``tests/test_cuda.py``, then stage 07's graph replay), then every stage's tokens against Hugging Face; each
  test under a timeout that prints every thread's stack (pytest-timeout, where installed) before its file's ends.
* **gateway**: the gateway's GPU tests (replicas sharing one GPU), where Ray imports (else one line says why not).
* **kernels**: the attention kernels' grid of shapes against the PyTorch reference, once per version of
  ``triton_attention.py`` (a stage whose copy is byte-identical to an earlier stage's is not tested again),
  newest first; five minutes at most, because Triton compiles each shape once.
* **speed**: the decode step at batch 1, 16 and 64, eager and replayed, of the first stage with CUDA graphs and
  of the latest (``common/step_profile.py``: the median of 20, each step's kernels by name from the profiler), and
  the quantized stage's modes at batch 1 and 64 once a stage has a ``quantize.py``; the served sweep at
  concurrency 1 and 64, 64 tokens a request, of the stage before graphs, the first with them and the latest, the
  latest also with speculation off and with speculation off and overlap disabled (``common/bench.py``: ITL and
  tokens/s, read against the step). Then a one-screen summary.
* **peer**: nano-vllm's throughput workload (100 to 1,024 tokens in and out) on the latest stage's offline engine
  and on transformers' continuous batching in its best configuration here, same weights
  (``common/throughput.py``): a 64-sequence draw, then the 256-sequence one, transformers under a time limit.
* **spec**: stage 08 against 07 (``spec_bench --quick``): on the real model where its GGUF came in parts
  (``common/gguf_parts.py``), else on random weights, labelled so (their answers copy nothing).

A command that outlives its timeout is stopped with everything it started (servers, ranks): no part can hang.
Every command runs with Triton's autotuning printed and kept in its cache (``TRITON_ENV``). Each part prints what
it runs, how long each command took and what failed, writes ``<part>.log`` (every command's output) and
``<part>.json`` (the summary) into ``results/cuda/<gpu>/`` (the GPU's name as a folder, ``nvidia-h200``: a run on
one GPU never overwrites another's), and exits non-zero when a command failed or ran out of time. The benchmarks
write their JSON and figures beside them, each record with the GPU's name, the torch and triton versions and the
commit (added to a record that lacks them). With ``$OUT`` set (a lent machine's folder of results to send back,
8 files at most), that folder is packed there after every command, as ``$OUT/results-<gpu>.tgz``: what finished
comes back even if the lease ends first. ``common/gpu_window.py`` runs one part as a lent GPU's one command.

Nothing is downloaded and nothing replaces the machine's own packages: ``--install-wheels FOLDER`` installs only
the wheels whose project this Python lacks (``requirements-gpu.txt`` lists them), with ``--no-index --no-deps``,
into a folder of their own. No model wheel either: without the embedded model a random-weight checkpoint with
SmolLM2-135M's configuration and tokenizer is built (``common/random_model.py``), and correctness is checked
against Hugging Face on those same weights.

    python -m common.gpu_check --part smoke|correctness|gateway|kernels|speed|peer|spec|all [--model FOLDER]
                               [--out DIR] [--budget S] [--dry-run]
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
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .gpu_env import RESULTS, gpu_slug
from .random_model import random_model_dir
from .weights import DEFAULT_MODEL, ModelNotFound, resolve_model

REPO = Path(__file__).resolve().parent.parent
SITE = REPO / ".venv" / "cuda-site"  # the wheels the machine lacked, on PYTHONPATH (make ... CUDA=1)
PARTS = ("smoke", "correctness", "gateway", "kernels", "speed", "peer", "spec")
# A lent GPU runs one command for 10 minutes at most; a minute of it is left for installing the wheels, building
# the random model and copying the results back.
PART_BUDGET_S = 540
KERNELS_BUDGET_S = 300  # the kernels part: five minutes
MIN_CHECK_S = 5  # less than this left of a part's budget: its remaining commands are not started
RANDOM_KIND = "random weights, SmolLM2-135M's configuration"  # pick_model's kind without the embedded model
NO_GPU_NAME = "GPU-NAME"  # the dry run's stand-in for the folder named after the GPU (results/cuda/<gpu>/)

# Each command's timeout, in seconds. Most of a demo's or a sweep's time is starting up (imports, weights, Triton's
# compilation, graph capture); each <part>.json records what every command took, to set these from. On an H200
# (results/cuda/gpu-check/smoke.json, correctness.json): a stage's demo 17-23 s, under torchrun 27 s. Eleven stages'
# demos, three of them also under torchrun, fit the part's budget with these (test_gpu_check adds them up); the
# gateway's demo is the gateway part's.
DEMO_S = 30
REFERENCE_DEMO_S = 25  # the PyTorch reference instead of the Triton kernels: nothing to compile
TORCHRUN_S = 40
GATEWAY_DEMO_S = 100  # Ray, two models' replicas, and a second random model built once (skipped where Ray is not)
# The GPU tests, by file: the tests written for the GPU first, then the stages' tokens against Hugging Face. On an
# H200: test_cuda 78-89 s, test_sync 6 s, test_07_cuda_graphs 21 s, test_all_stages 72 s alone with a warm Triton
# cache; cold (07's kernels compiled and tuned afresh, in float32), test_all_stages did not finish stage 07 in 100 s
# (review-gpu-2026-12, section 2): it gets 240 s, and stage 10's and the bfloat16 GPU cases on top.
TEST_FILES_S = {"test_cuda.py": 110, "test_sync.py": 30, "test_07_cuda_graphs.py": 60, "test_all_stages.py": 240,
                "test_fused_kernels.py": 45, "test_11_quantization.py": 20}
GATEWAY_TESTS_S = 120  # the gateway's GPU tests: Ray started, two replicas of a model sharing the GPU (own part)
KERNEL_TESTS = "test_attention.py"  # the kernel grid: the kernels part, not the correctness part
TEST_TIMEOUT_S = 180  # one test at most, where pytest-timeout is installed (and under its file's timeout)
TEST_STACKS_S = 10  # a test's timeout ends this long before its file's: its stacks print before the file is stopped
# Triton, for every part: its autotuning printed (how long each tuning took, what it chose: slow or stuck?), and one
# cache for the whole run, autotuning results kept in it, so that the next window can carry it (TRITON_CACHE).
TRITON_ENV = {"TRITON_PRINT_AUTOTUNING": "1", "TRITON_CACHE_AUTOTUNING": "1"}
# The speed part. A step profile: a demo's start-up (~20 s), then 3 sizes x 2 paths x 21 steps and 6 profiled steps.
STEP_PROFILE_S = 55
STEP_BATCH_SIZES, STEP_REPEATS = ("1", "16", "64"), "20"
# The quantized stage's modes at batch 1 and 64, once a stage has a quantize.py (skipped, its time kept, until then).
QUANTIZED_FILE, QUANTIZED_BATCH_SIZES, QUANTIZED_S = "quantize.py", ("1", "64"), 30
QUANTIZED_MODES = ("int4", "int8")  # on random weights (no GGUF) int4's blocks are made at load
# A served sweep: a server's start-up (~20 s), a warm-up, then 64 requests of 64 tokens one at a time and 64 at once.
# 64 tokens (the standard sweep's): at 16 the c = 64 level's steps were mostly mixed prefill steps (mean execute
# 26.5 ms on 07, H200), not the decode steps its target is about. With graphs a token takes ~1.7-1.9 ms at c = 1
# (H200): 64 x (25 + 63 x 1.9) ms = 9 s.
SWEEP_LEVELS, SWEEP_REQUESTS, SWEEP_TOKENS = ("1", "64"), "64", "64"
SWEEP_S = 55  # ~30 s for 07, ~40 s for 10 (its core a process of its own, spawned)
# The stage before graphs: ~21 ms a token at c = 1 (06, H200), so 64 requests of 64 tokens one at a time would take
# 90 s: its c = 1 level runs 16 of them (1,008 intervals, plenty for a p50) in a command of its own.
EAGER_C1_REQUESTS, EAGER_C1_S, EAGER_C64_S = "16", 60, 45
# nano-vllm's workload (the peer part): 133,966 output tokens (142,827 in) at 256 sequences. The stage: start-up with
# 256 sequences' buckets captured, then ~1,040 steps (09 on an H200: 9.2 s + 14.8 s); transformers: its model, its
# cache (and graphs with flash-attention), then the same tokens, stopped at its time limit, the finished ones counted.
# First a complete comparison on the 64-sequence draw, then the 256-sequence draw.
THROUGHPUT_DRAWS = (64, 256)
THROUGHPUT_S = {64: 60, 256: 80}
PEER_LIMIT_S = {64: 60, 256: 90}  # transformers' --time-limit; its command gets start-up and stop on top
PEER_STARTUP_S = 50
THROUGHPUT_DTYPE = "bfloat16"
# The spec part: stage 08 against 07 (spec_bench --quick: c = 1 and 4, extractive and chat answers). On the real
# model (scripts/gguf_parts.py joins its GGUF there) answers copy their prompt; on random weights they do not, and
# the result is labelled so.
SPEC_S = 150

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
    """A stage that serves through a gateway of replicas (12 on), not one server process."""
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
        if is_gateway(folder):  # its demo: in the gateway part (gateway_tests)
            continue
        demo = python("-m", folder, "--demo", "--device", "cuda", "--model", model)
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
    """The test file of each gateway stage (tests/test_12_gateway.py): run only where Ray is."""
    return [f"test_{folder}.py" for folder in stage_folders() if is_gateway(folder)]


def cuda_test_files() -> list[str]:
    """The test files that hold cuda-marked tests, those TEST_FILES_S names first, in its order; the kernel grid
    and the gateway's files (see gateway_tests) left out."""
    found = {p.name for p in (REPO / "tests").glob("test_*.py") if has_cuda_tests(p)}
    found -= {KERNEL_TESTS, *gateway_test_files()}
    named = [name for name in TEST_FILES_S if name in found]
    return [*named, *sorted(found - set(named))]


def test_timeout(file_timeout_s: int) -> int:
    """One test's timeout in a file of ``file_timeout_s``: TEST_TIMEOUT_S at most, and TEST_STACKS_S under the
    file's, so that a stuck test is stopped by pytest-timeout (which prints every thread's stack) before the file's
    command is stopped (which prints nothing)."""
    return max(1, min(TEST_TIMEOUT_S, file_timeout_s - TEST_STACKS_S))


def pytest_command(file_timeout_s: int, *args: str) -> list[str]:
    """``pytest -m cuda`` with every test's outcome on its own line, its output as it comes (Triton's autotuning
    lines among it), every test's duration, and, where pytest-timeout is installed, a timeout per test that dumps
    the stacks (the thread method: it works in any thread and prints them all)."""
    per_test = ["--timeout", str(test_timeout(file_timeout_s)), "-o", "timeout_method=thread"] \
        if importlib.util.find_spec("pytest_timeout") else []
    return python("-m", "pytest", "-m", "cuda", "-v", "-s", "--durations=0", "-p", "no:cacheprovider", *per_test,
                  *args)


def gateway_tests(model: str) -> list[Check]:
    """The gateway's demo and its GPU tests (replicas sharing one GPU, each within its memory budget): where Ray
    imports, and once the file has cuda-marked tests; else skipped, saying why in one line. A part of their own:
    beside the other stages' demos, or the correctness part's files, they would not fit one command."""
    checks = []
    for folder in stage_folders():
        if is_gateway(folder):  # two models' replicas on this one GPU, each sizing its pool from its share
            demo = python("-m", folder, "--demo", "--device", "cuda", "--model", model, "--replica-gpus", "0.25")
            checks.append(Check(f"{folder} demo", demo, GATEWAY_DEMO_S, skip=no_ray()))  # four replicas, a quarter each
    for name in gateway_test_files():
        why = no_ray() or (None if has_cuda_tests(REPO / "tests" / name) else f"tests/{name} has no GPU test yet")
        checks.append(Check(f"pytest -m cuda {name} (replicas sharing the GPU)",
                            pytest_command(GATEWAY_TESTS_S, f"tests/{name}"), GATEWAY_TESTS_S,
                            {"LLM_COURSE_MODEL": model}, skip=why))
    return checks


def correctness(model: str) -> list[Check]:
    """Each file of GPU tests, with its timeout from TEST_FILES_S (a file the table does not name yet gets an even
    share of what the named ones leave of the part's budget)."""
    files = cuda_test_files()
    others = [name for name in files if name not in TEST_FILES_S]
    left = PART_BUDGET_S - sum(TEST_FILES_S[name] for name in files if name in TEST_FILES_S)
    timeouts = {name: TEST_FILES_S.get(name) or left // len(others) for name in files}
    return [Check(f"pytest -m cuda {name}", pytest_command(timeouts[name], f"tests/{name}"), timeouts[name],
                  {"LLM_COURSE_MODEL": model}) for name in files]


def kernel_versions() -> dict[str, list[str]]:
    """The attention kernels' versions: for each distinct ``triton_attention.py``, the first stage with it and the
    stages that share it, newest version first."""
    return dict(reversed(versions_of("triton_attention.py").items()))


def kernels(model: str) -> list[Check]:
    """The kernel grid once per version of the Triton kernels, newest first, KERNELS_BUDGET_S shared evenly: the
    tests of the first stage with that version, and the whole-model tests of every stage that shares it
    (test_stage03_..., test_stage04_...), as `make test STAGE=NN` selects them."""
    versions = kernel_versions()
    each = KERNELS_BUDGET_S // len(versions)
    return [Check(f"pytest -m cuda {KERNEL_TESTS}, {first}",
                  pytest_command(each, f"tests/{KERNEL_TESTS}", "-k", selected), each, {"LLM_COURSE_MODEL": model})
            for first, sharing in versions.items()
            for selected in [" or ".join([first, *(f"stage{folder[:2]}" for folder in sharing)])]]


def config_has(folder: str, name: str) -> bool:
    """The stage's EngineConfig has the field ``name`` (read from its config.py: the plan needs no import)."""
    path = REPO / folder / "config.py"
    return path.is_file() and re.search(rf"^\s+{name}\s*:", path.read_text(), re.MULTILINE) is not None


def server_variants(folder: str) -> list[tuple[str, list[str]]]:
    """The ways the speed part serves ``folder``: its defaults, and where it has them, speculation off (a step that
    speculates waits for its tokens: no overlap), then speculation off and overlap disabled (the synchronous loop
    the overlap is measured against). Each as (a suffix of the result's name, the server's flags)."""
    variants: list[tuple[str, list[str]]] = [("", [])]
    if config_has(folder, "speculative"):
        variants.append(("_speculative_off", ["--speculative", "off"]))
        if config_has(folder, "disable_overlap"):
            variants.append(("_speculative_off_sync", ["--speculative", "off", "--disable-overlap"]))
    return variants


def quantized_stage() -> str | None:
    """The first stage with a QUANTIZED_FILE, or None: none exists yet."""
    return next((folder for folder in stage_folders() if (REPO / folder / QUANTIZED_FILE).is_file()), None)


def step_profile(folder: str, model: str, out: Path, sizes: tuple[str, ...], timeout_s: int,
                 quantization: str = "") -> Check:
    mode = ["--quantization", quantization] if quantization else []
    return Check(f"{folder} decode step (batch {', '.join(sizes)}){' ' + quantization if quantization else ''}",
                 python("-m", "common.step_profile", "--stage", folder[:2], "--device", "cuda", "--model", model,
                        "--batch-sizes", *sizes, "--repeats", STEP_REPEATS, *mode, "--out", str(out)), timeout_s)


def sweep(folder: str, model: str, out: Path, levels: tuple[str, ...], requests: str, timeout_s: int,
          suffix: str = "", flags: tuple[str, ...] = ()) -> Check:
    """The served sweep at ``levels``, 64 output tokens a request, into ``<folder>_c1_c64<suffix>.json``."""
    name = f"{folder}_c{'_c'.join(levels)}{suffix}"
    server = [f"--server-args={shlex.join(flags)}"] if flags else []
    label = f" {shlex.join(flags)}" if flags else ""
    return Check(f"{folder} served (concurrency {' and '.join(levels)}){label}",
                 python("-m", "common.bench", "--stage", folder[:2], "--device", "cuda", "--model", model,
                        "--levels", *levels, "--requests", requests, "--max-tokens", SWEEP_TOKENS, "--name", name,
                        *server, "--out", str(out)), timeout_s)


def speed(model: str, out: Path) -> list[Check]:
    """The decode step of the first stage with graphs and of the latest (and the quantized stage's, once there is
    one); the served sweep (concurrency 1 and 64, 64 tokens a request) of the stage before graphs, the first with
    them and the latest, the latest in each of server_variants. Every result into ``out``."""
    graphs, latest = first_with_graphs(), latest_server()
    before = servers()[servers().index(graphs) - 1]
    steps = [step_profile(folder, model, out, STEP_BATCH_SIZES, STEP_PROFILE_S)
             for folder in dict.fromkeys([graphs, latest])]
    quantized = quantized_stage()
    if quantized:  # its modes other than the float one the step profile above measured
        steps += [step_profile(quantized, model, out, QUANTIZED_BATCH_SIZES, QUANTIZED_S, mode)
                  for mode in QUANTIZED_MODES]
    else:  # the hook: its time is kept in the budget, so that the part still fits once the stage exists
        steps += [Check(f"quantized stage's {mode} (batch {', '.join(QUANTIZED_BATCH_SIZES)})", [], QUANTIZED_S,
                        skip=f"no stage has a {QUANTIZED_FILE} yet") for mode in QUANTIZED_MODES]
    eager = [sweep(before, model, out, SWEEP_LEVELS[:1], EAGER_C1_REQUESTS, EAGER_C1_S),
             sweep(before, model, out, SWEEP_LEVELS[1:], SWEEP_REQUESTS, EAGER_C64_S)]
    served = [sweep(folder, model, out, SWEEP_LEVELS, SWEEP_REQUESTS, SWEEP_S, suffix, tuple(flags))
              for folder in dict.fromkeys([graphs, latest])
              for suffix, flags in (server_variants(folder) if folder == latest else [("", [])])]
    return [*steps, *eager, *served]


def peer(model: str, out: Path) -> list[Check]:
    """nano-vllm's throughput workload on the latest stage's offline engine and on transformers' continuous batching
    in its best configuration here (common/throughput.py resolves and records it), the 64-sequence draw first (a
    complete comparison on both sides), then the 256-sequence draw; transformers stopped at its time limit."""
    latest = latest_server()
    checks = []
    for n in THROUGHPUT_DRAWS:
        suffix = "" if n == THROUGHPUT_DRAWS[-1] else f"_{n}"
        workload = ["--stage", latest[:2], "--device", "cuda", "--dtype", THROUGHPUT_DTYPE, "--model", model,
                    "--num-seqs", str(n), "--out", str(out)]
        checks += [Check(f"{latest} throughput ({n} sequences of nano-vllm's workload, offline)",
                         python("-m", "common.throughput", *workload, "--name", f"throughput_{latest}{suffix}"),
                         THROUGHPUT_S[n]),
                   Check(f"transformers throughput ({n} sequences, continuous batching, at most {PEER_LIMIT_S[n]} s)",
                         python("-m", "common.throughput", *workload, "--peer", "transformers",
                                "--time-limit", str(PEER_LIMIT_S[n]), "--name", f"throughput_transformers{suffix}"),
                         PEER_STARTUP_S + PEER_LIMIT_S[n])]
    return checks


def spec(model: str, out: Path, kind: str) -> list[Check]:
    """Stage 08 against 07 (the first stage that speculates against the one before it): its spec_bench, quick."""
    speculates = next((f for f in servers() if (REPO / f / "spec_bench.py").is_file()), None)
    label = "" if kind != RANDOM_KIND else " (random weights: n-gram mechanics, not answers that copy)"
    command = python("-m", f"{speculates}.spec_bench", "--quick", "--device", "cuda", "--dtype", THROUGHPUT_DTYPE,
                     "--model", model, "--out", str(out)) if speculates else []
    return [Check(f"{speculates} against the stage before it{label}", command, SPEC_S,
                  skip=None if speculates else "no stage has a spec_bench.py")]


def budget(part: str) -> int:
    """The most a part may take, its timeouts' sum at most."""
    return KERNELS_BUDGET_S if part == "kernels" else PART_BUDGET_S


def plan(part: str, model: str, out: Path, kind: str = "given") -> list[Check]:
    """A part's commands for ``model`` (``kind``: what it is, see pick_model), results into ``out``."""
    return {"smoke": lambda: smoke(model), "correctness": lambda: correctness(model),
            "gateway": lambda: gateway_tests(model), "kernels": lambda: kernels(model),
            "speed": lambda: speed(model, out), "peer": lambda: peer(model, out),
            "spec": lambda: spec(model, out, kind)}[part]()


def out_dir(gpu: str | None) -> Path:
    """Where a GPU's results go: results/cuda/<its name as a folder>/ (NO_GPU_NAME's in a dry run)."""
    return RESULTS / "cuda" / (gpu_slug(gpu) if gpu else NO_GPU_NAME)


def mirror_file(out: Path) -> Path | None:
    """Where ``out`` is packed when $OUT is set (a lent machine sends back what is there, but at most 8 files, and
    none more than two folders down): one archive, ``$OUT/results-<out's name>.tgz``, holding ``out`` at its path
    in the repository (``results/cuda/<gpu>/...``: unpacked at the repository's root, it lands where it belongs)."""
    target = os.environ.get("OUT")
    return Path(target) / f"results-{out.name}.tgz" if target else None


def archive_name(out: Path) -> str:
    try:
        return str(out.resolve().relative_to(REPO))
    except ValueError:
        return out.name


def mirror(out: Path) -> None:
    """Pack ``out`` under $OUT, when set (after every command: what is finished comes back if the lease ends),
    through a temporary file, so that the archive there is always a whole one."""
    target = mirror_file(out)
    if target is None or not out.is_dir():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    with tarfile.open(partial, "w:gz") as archive:
        archive.add(out, arcname=archive_name(out))
    partial.replace(target)


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
        env = {**TRITON_ENV, **os.environ, **check.env, "PYTHONUNBUFFERED": "1"}  # the caller's Triton settings win
        process = subprocess.Popen(check.command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
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


def run_part(part: str, checks: list[Check], out: Path, context: dict, limit_s: float | None = None) -> bool:
    """Run a part's checks within its budget (``budget``, or ``limit_s`` where less: what a window has left);
    write <part>.log and <part>.json, packed under $OUT after each command when it is set; True if every check
    passed or was skipped for a reason (a check that failed, ran out of time or found no time left fails the
    part)."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{part}.log"
    log.write_text(f"make gpu-check PART={part}: {json.dumps(context)}\n")
    limit = budget(part) if limit_s is None else min(budget(part), limit_s)
    print(f"===== {part}: {len(checks)} commands, {limit:.0f} s at most; results in {out}"
          + (f", packed into {mirror_file(out)}" if mirror_file(out) else ""), flush=True)
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
    if part in ("speed", "peer"):
        lines = speed_summary(out, started)
        (out / f"{part}-summary.txt").write_text("\n".join(lines) + "\n")
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


def replayed_ms(steps: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Each stage's replayed decode step (ms) by batch size, from its step profile, by stage number (a sweep's
    record names its stage "07", a step profile's "07_cuda_graphs")."""
    return {str(record["stage"])[:2]: {row["batch_size"]: row["static_ms"] for row in record.get("steps", [])}
            for record in steps}


def nearest(by_batch: dict[int, float], n: int) -> float | None:
    return by_batch[min(by_batch, key=lambda b: abs(b - n))] if by_batch else None


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def step_lines(steps: list[dict[str, Any]]) -> list[str]:
    lines = ["Decode step (median ms; GPU kernels per step, from the profiler)",
             f"  {'stage':20} {'batch':>5} {'eager':>8} {'replayed':>9} {'faster':>7} {'kernels e/r':>15}"]
    for record in steps:
        profiles = record.get("profiles", {})
        for row in record.get("steps", []):
            n = row["batch_size"]
            kernels = [profiles.get(f"{path}_{n}", {}).get("gpu_kernel_launches") for path in ("eager", "static")]
            counted = "/".join("-" if k is None else str(k) for k in kernels)
            lines.append(f"  {record['stage']:20} {n:>5} {row['eager_ms']:>8.2f} {row['static_ms']:>9.2f} "
                         f"{ratio(row['eager_ms'], row['static_ms']):>7} {counted:>15}")
    return lines


def sweep_lines(sweeps: list[dict[str, Any]], replayed: dict[str, dict[int, float]]) -> list[str]:
    """Per sweep and level: the ITL p50 against the step the server measured (``llm_decode_step_seconds``, the
    level's ``decode_step_ms``) and against the stage's replayed step at the nearest batch size."""
    lines = ["Served, 64 tokens a request (ITL p50 against the step: the server's metric, the replayed one)",
             f"  {'sweep':44} {'c':>3} {'ITL p50':>8} {'step':>7} {'ITL/step':>8} {'/replay':>7} {'tok/s':>6}"]
    for record in sweeps:
        stage = str(record.get("stage") or record["name"])[:2]
        for level in record["levels"]:
            c, itl = level["concurrency"], (level.get("itl_s") or {}).get("p50")
            itl_ms, step_ms = None if itl is None else 1000 * itl, level.get("decode_step_ms")
            replay = nearest(replayed.get(stage, {}), c)
            lines.append(f"  {record['name'][:44]:44} {c:>3} {'-' if itl_ms is None else f'{itl_ms:.2f}':>8} "
                         f"{'-' if step_ms is None else f'{step_ms:.2f}':>7} {ratio(itl_ms, step_ms):>8} "
                         f"{ratio(itl_ms, replay):>7} {level['output_tokens_per_s']:>6.0f}")
    return lines


def throughput_lines(throughput: list[dict[str, Any]]) -> list[str]:
    """Each run's tokens/s, then per draw the stage against transformers, with transformers' label (the attention it
    ran) and whether it stopped at its time limit (then its rate counts only the sequences that finished)."""
    lines = ["Throughput, nano-vllm's workload (output tokens / wall time)"]
    for record in throughput:
        rate = record.get("tokens_per_s")
        done = "" if record.get("complete") else " (stopped before the end)"
        lines.append(f"  {record['name'][:36]:36} {record['output_tokens']:>8} tokens in "
                     f"{record['seconds'] or 0:>7.1f} s: {rate or 0:>8.0f} tokens/s{done}")
    draws: dict[Any, dict[str, dict[str, Any]]] = {}
    for record in throughput:
        side = "peer" if record["name"].startswith("throughput_transformers") else "stage"
        draws.setdefault((record.get("workload") or {}).get("num_seqs"), {})[side] = record
    for n, sides in draws.items():
        stage, peer_record = sides.get("stage"), sides.get("peer")
        if not (stage and peer_record and stage.get("complete")):
            continue
        cut = "" if peer_record.get("complete") else ", transformers stopped at its limit: finished sequences only"
        lines.append(f"  {n} sequences: {stage['name'].removeprefix('throughput_')} / transformers "
                     f"{ratio(stage.get('tokens_per_s'), peer_record.get('tokens_per_s'))}, "
                     f"{peer_record.get('label', '')}{cut}")
    return lines


def speed_summary(out: Path, since: float = 0) -> list[str]:
    """One screen: the decode steps (ms, kernels per step), the served sweeps (ITL p50 against the step) and the
    throughput workload (tokens/s, the stage against transformers), from the records written into ``out`` since
    ``since`` (the speed part's and the peer part's)."""
    steps = read_records(out, "*_decode_steps.json", since)
    sweeps = [r for r in read_records(out, "*.json", since) if "levels" in r and "workload" in r]
    throughput = read_records(out, "throughput_*.json", since)
    lines = [*(step_lines(steps) if steps else []), *(sweep_lines(sweeps, replayed_ms(steps)) if sweeps else []),
             *(throughput_lines(throughput) if throughput else [])]
    return lines or ["(the speed part wrote no results)"]


def print_plan(parts: list[str], model: str, out: Path, kind: str = "given") -> None:
    """What each part would run, with its timeouts and their sum: nothing runs, and no GPU is needed."""
    print(f"every command's environment adds {' '.join(f'{k}={v}' for k, v in TRITON_ENV.items())}")
    for part in parts:
        checks = plan(part, model, out, kind)
        planned = sum(c.timeout_s for c in checks)
        print(f"{part}: {len(checks)} commands, {planned} s of timeouts (at most {budget(part)} s: "
              f"{'fits' if planned <= budget(part) else 'DOES NOT FIT'})")
        for check in checks:
            env = "".join(f"{k}={shlex.quote(v)} " for k, v in check.env.items())
            status = f"{check.timeout_s:>4} s skipped ({check.skip})" if check.skip else f"{check.timeout_s:>4} s"
            print(f"  {status}  {check.name}: {env}{shlex.join(check.command)}")
    where = mirror_file(out)
    print(f"  results in {out}" + (f", packed into {where}" if where else " (and packed under $OUT/ when it is set)"))


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
        return random_model_dir(), RANDOM_KIND


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
    parser.add_argument("--budget", type=float, metavar="S",
                        help="each part's budget at most S seconds (a window's time left: later commands not started)")
    args = parser.parse_args(argv)
    parts = list(PARTS) if args.part == "all" else [args.part]
    if args.install_wheels:
        return install_wheels(args.install_wheels, args.site)
    if args.dry_run:
        print_plan(parts, args.model or "MODEL", args.out or out_dir(None), "given" if args.model else RANDOM_KIND)
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
    passed = [run_part(part, plan(part, str(model), out, kind), out, context, args.budget) for part in parts]
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
