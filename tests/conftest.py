"""Shared fixtures: the embedded model, a Hugging Face reference, stages and live servers."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import io
import json
import os
import re
import runpy
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING
from unittest.mock import patch

import pytest
import torch

from common.trace import NO_TRACE, Tracer
from common.weights import DEFAULT_MODEL, resolve_model

if TYPE_CHECKING:
    from common.limits import Limits

    from .servers import LiveServer

# Collecting tests imports this file, so it imports no server, client or fuzzing library (FastAPI, openai,
# hypothesis ...): the fixtures that need one import it. `pytest -m cuda` then collects on a GPU machine that has
# only PyTorch, Triton and transformers (see common/gpu_check.py).

if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # `make test` runs two pytest workers side by side:
    share = max(1, (os.cpu_count() or 1) // int(workers))  # each its share of the cores,
    torch.set_num_threads(share)
    # and so does every process a test starts (a stage's server, a notebook's kernel, a rank, a Ray replica): two
    # workers that each start a process using every core would run four threads on two cores.
    os.environ["OMP_NUM_THREADS"] = str(share)

# Without a GPU, the Triton kernels (stage 03 on) run in Triton's interpreter: set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def patch_triton_language_once_per_launch() -> None:
    """Triton's interpreter swaps the language's functions (``tl.load`` ...) for interpreted ones when a kernel
    launches, in the modules the kernel's globals name (``triton.language``, ``triton.language.core``), and undoes it
    when the launch ends. It does the swap again at every call of a ``@triton.jit`` helper inside the kernel: for a
    helper that names the same modules this changes nothing, yet takes a fifth of the interpreted kernels' time (the
    course's kernels call a helper in every step of their loops). Such a call skips it; a helper that names other
    modules (Triton's own ``tl.sum``, ``tl.cdiv``: ``core``) still swaps them, as before."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    swap, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    swapped: set[int] = set()  # the modules swapped in the launch under way (the interpreter runs one at a time)

    @functools.cache
    def languages(fn) -> frozenset[int]:
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in (tl, tl.core))

    def swap_once(fn):
        if languages(fn) <= swapped:
            return None  # a helper's call inside a launch: its return value is not used
        scope = swap(fn)
        swapped.update(languages(fn))
        return scope

    def launch_and_swap_back(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)  # swaps (swap_once), runs, and undoes the swap
        finally:
            swapped.clear()

    interpreter._patch_lang = swap_once
    interpreter.GridExecutor.__call__ = launch_and_swap_back


if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
    patch_triton_language_once_per_launch()


def share_one_tls_context() -> None:
    """Every request of the suite is plain HTTP to a server on this machine, yet each httpx client builds a TLS
    context and loads the CA bundle into it (25 ms of CPU), and the tests make thousands of clients (each
    ``httpx.post``, each poll of /metrics, each OpenAI client): they share one context, made once."""
    for name in ("httpx", "httpx2"):  # httpx2: the OpenAI SDK's copy of httpx
        if importlib.util.find_spec(name):  # (a GPU machine may have neither: see above)
            transports = importlib.import_module(f"{name}._transports.default")
            transports.create_ssl_context = functools.cache(transports.create_ssl_context)


share_one_tls_context()


# --- how `make test` shares the tests between its workers (pytest-xdist) ------------------------------------------
# A worker takes a group of tests whole and runs it in order: by default a group is a test file, so that a module's
# fixtures (the gateway's Ray fleet, a tiny checkpoint) are made once. The longest files go first (a long one started
# last would leave the other worker idle at the end), and files whose tests share nothing costly are cut smaller:
# into a group per test (None), or per stage that the tests' parameters name (its engine and fixtures made once).
LONGEST_FIRST = ["test_12_gateway.py", "test_notebooks.py", "test_09_tensor_parallel.py", "test_homework.py",
                 "test_fuzz.py", "test_attention.py", "test_all_stages.py", "test_hardening.py", "test_openai_api.py",
                 "test_bench.py"]
SPLIT_BY = {"test_notebooks.py": None, "test_fuzz.py": None, "test_all_stages.py": None, "test_homework.py": "stage"}
STAGE_IN_PARAMETERS = re.compile(r"\[.*?\b(?:stage(\d\d)|(\d\d)_[a-z])")  # [03_paged_kv-cpu], [stage08]


def group_of(nodeid: str) -> str:
    """The group of the test ``nodeid``: its file, the test alone, or its file and the stage it names."""
    file = nodeid.split("::")[0].rsplit("/", 1)[-1]
    if file not in SPLIT_BY:
        return file
    if SPLIT_BY[file] is None:
        return nodeid
    found = STAGE_IN_PARAMETERS.search(nodeid)
    return f"{file}:{found[1] or found[2]}" if found else file


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # a hook of pytest-xdist, which a GPU machine may not have
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """With ``--dist loadgroup``: xdist's scheduler of whole groups (LoadScopeScheduling), by ``group_of``."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


# `make test-fast` (-m "exercise or not e2e") leaves out what runs a whole model, a server or a process: a test is
# end to end when it needs the course model's folder, a stage's engine or server (engineNN, serverNN, or one of them
# by parameter), runs the attention kernels in Triton's interpreter, grades a student copy, or is marked e2e in its
# file (a process of its own).
E2E_FILES = {"test_notebooks.py", "test_fuzz.py"}
E2E_FIXTURES = re.compile(r"model_dir|(engine|server)(\d\d)?|traced_server|kernels|student")


def is_end_to_end(item: pytest.Item) -> bool:
    return (item.path.name in E2E_FILES or item.get_closest_marker("e2e") is not None
            or any(E2E_FIXTURES.fullmatch(name) for name in getattr(item, "fixturenames", ())))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first, each test's e2e mark; tests marked ``cuda`` skipped, saying so, without a GPU."""
    rank = {file: i for i, file in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order
    for item in items:
        if is_end_to_end(item):
            item.add_marker(pytest.mark.e2e)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: `pytest -m cuda` (or `make gpu-check`) on a GPU machine")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


REPO = Path(__file__).resolve().parent.parent
# A student copy of the stages (see `make homework`) is tested by pointing STAGE_ROOT at it.
STAGE_ROOT = Path(os.environ.get("STAGE_ROOT", REPO)).resolve()


def stage(package: str, module: str) -> ModuleType:
    """Import ``module`` of a stage folder, e.g. stage("02_streaming", "engine").

    The folder comes from STAGE_ROOT when it has one, else from the repository. The package is loaded
    from its path, not through sys.path, which pytest reorders (it puts the repository first)."""
    if package not in sys.modules:
        root = STAGE_ROOT if (STAGE_ROOT / package / "__init__.py").is_file() else REPO
        spec = importlib.util.spec_from_file_location(package, root / package / "__init__.py")
        sys.modules[package] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[package])
    return importlib.import_module(f"{package}.{module}")


def cli_help(package: str) -> str:
    """What ``python -m <package> --help`` prints, from the stage's own ``__main__`` run in this process (a process
    of its own would spend its time importing PyTorch again)."""
    stage(package, "engine")  # the package, from where stage() takes it; then its __main__ as a script
    printed = io.StringIO()
    with patch.object(sys, "argv", [package, "--help"]), redirect_stdout(printed), pytest.raises(SystemExit) as end:
        runpy.run_module(f"{package}.__main__", run_name="__main__")
    assert end.value.code == 0
    return printed.getvalue()


# --- the model and the reference ---------------------------------------------------------------


@pytest.fixture(scope="session")
def model_dir() -> Path:
    # LLM_COURSE_MODEL: another model folder for the whole suite (`make gpu-check` passes a random-weight one).
    return resolve_model(os.environ.get("LLM_COURSE_MODEL", DEFAULT_MODEL))  # converts the embedded GGUF once


@pytest.fixture(scope="session")
def hf(model_dir: Path):
    """Hugging Face transformers on the same weights, float32: the reference every stage must match."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def hf_bf16(model_dir: Path):
    """The same, in bfloat16: the reference of a stage run in bfloat16."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True).eval()


REFERENCES = Path(os.environ.get("LLM_COURSE_CACHE", Path.home() / ".cache" / "llm-course")) / "references"


def model_key(model_dir: Path) -> str:
    """Names one set of weights: the folder's config and the size and time of each weight file."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


class References:
    """Results of Hugging Face's model that many tests compare with: each computed once per model, then kept on disk
    (a JSON file per model and kind under ~/.cache/llm-course/references), so that every stage, and every later run,
    compares with it without running it again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cache: dict[str, list[int]] = json.loads(path.read_text()) if path.is_file() else {}

    def get(self, key: str, compute: Callable[[], list[int]]) -> list[int]:
        if key not in self.cache:
            self.cache[key] = compute()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(self.cache))
            temporary.replace(self.path)  # atomic: a concurrent run never reads half a file
        return self.cache[key]


@pytest.fixture(scope="session")
def references(model_dir: Path) -> Callable[[str], References]:
    """references(kind) -> the References of that kind for the suite's model."""
    return functools.cache(lambda kind: References(REFERENCES / f"{kind}-{model_key(model_dir)}.json"))


@pytest.fixture(scope="session")
def hf_greedy(request: pytest.FixtureRequest, references):
    """hf_greedy(prompt_ids, n) -> the new token ids of ``generate(do_sample=False)``, EOS included (kept on disk)."""
    return greedy_reference(references("greedy"), lambda: request.getfixturevalue("hf")[0])


@pytest.fixture(scope="session")
def hf_greedy_bf16(request: pytest.FixtureRequest, references):
    """``hf_greedy`` of Hugging Face's model in bfloat16."""
    return greedy_reference(references("greedy-bfloat16"), lambda: request.getfixturevalue("hf_bf16"))


def greedy_reference(greedy: References, load: Callable[[], torch.nn.Module]) -> Callable[[list[int], int], list[int]]:
    """hf_greedy's answers from ``greedy`` (on disk), computed by the model ``load()`` gives where one is missing."""
    def run(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        def generate() -> list[int]:
            model = load()  # loaded only when a reference is missing
            ids = torch.tensor([prompt_ids])
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False)
            return out[0, len(prompt_ids):].tolist()

        return greedy.get(f"{max_new_tokens}:{','.join(map(str, prompt_ids))}", generate)

    return run


@pytest.fixture(scope="session")
def hf_next_logprobs(request: pytest.FixtureRequest):
    """hf_next_logprobs(ids) -> [V]: Hugging Face's log-probabilities of the token after ``ids`` (float32, CPU),
    for the rare test that must tell a genuine near-tie from a wrong token. ``dtype=torch.bfloat16``: its model's in
    bfloat16 (the logits made float32 before the softmax)."""

    def run(ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        model = request.getfixturevalue("hf")[0] if dtype == torch.float32 else request.getfixturevalue("hf_bf16")
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)

    return run


# --- engines and live servers --------------------------------------------------------------------


# The speculation policy's step costs (stage 08 on), read from a committed step_bench file instead of timed at each
# start (about 5 s an engine of the course model): every test engine plans alike, however busy the machine.
# test_08_speculative's own test of the timing passes step_costs="".
STEP_COSTS = REPO / "results" / "cpu" / "07_cuda_graphs_decode_steps.json"


def engine_config(folder: str, model_dir: Path, device: str = "cpu", dtype: str = "float32", **config):
    """A stage's EngineConfig on ``model_dir``, float32 unless asked, its other fields as given (on a CPU, the
    speculation policy's step costs from STEP_COSTS unless given; from stage 11 on, unquantized unless given)."""
    config_class = stage(folder, "config").EngineConfig
    fields = {field.name for field in dataclasses.fields(config_class)}
    if device == "cpu" and "step_costs" in fields:
        config.setdefault("step_costs", str(STEP_COSTS))
    if "quantization" in fields:  # stage 11 on: float weights, Hugging Face's own, unless a test asks for others
        config.setdefault("quantization", "none")
    return config_class(model=str(model_dir), device=device, dtype=dtype, **config)


def make_engine(folder: str, model_dir: Path, device: str = "cpu", dtype: str = "float32", **config):
    """A stage's Engine on ``engine_config``'s config."""
    return stage(folder, "engine").Engine(engine_config(folder, model_dir, device, dtype, **config))


@pytest.fixture(scope="session")
def engine01(model_dir: Path):
    return make_engine("01_naive", model_dir)


@contextmanager
def serve_stage(folder: str, engine, limits: Limits | None = None, tracer: Tracer = NO_TRACE) -> Iterator[LiveServer]:
    """A FastAPI stage (02 on) serving ``engine`` on a free port; ``server.engine`` is its AsyncEngine (from stage 10
    on, whose core is a process of its own, the client of that core's loop run on a thread: ``tests/cores.py``)."""
    from .cores import core_on_a_thread
    from .servers import start_fastapi
    from .stages import has

    steps_traced = {"tracer": tracer} if folder >= "04" else {}  # a batching stage traces its steps too
    if has(folder, "overlap"):  # the lesson that moved the engine's loop into a core process of its own
        async_engine = core_on_a_thread(folder, engine, **steps_traced)
    else:
        async_engine = stage(folder, "async_engine").AsyncEngine(engine, **steps_traced)
    app = stage(folder, "server").create_app(async_engine, "smollm2-135m-instruct", limits, tracer)
    with start_fastapi(app) as server:
        server.engine = async_engine
        yield server


@pytest.fixture(scope="session")
def server01(engine01) -> Iterator[LiveServer]:
    from .servers import start_flask

    app = stage("01_naive", "server").create_app(engine01, "smollm2-135m-instruct")
    with start_flask(app) as server:
        yield server


def stage_fixtures(folder: str, **config):
    """The session-wide engine (``engineNN``) of a FastAPI stage, its EngineConfig's other fields as given, and
    its live server (``serverNN``): tests that use one stage's name them, tests over stages look them up."""
    number = folder[:2]

    @pytest.fixture(scope="session", name=f"engine{number}")
    def engine(model_dir: Path):
        return make_engine(folder, model_dir, **config)

    @pytest.fixture(scope="session", name=f"server{number}")
    def server(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
        with serve_stage(folder, request.getfixturevalue(f"engine{number}")) as live:
            yield live

    return engine, server


engine02, server02 = stage_fixtures("02_streaming")
# From 03 on, a pool of 64 MiB: about 1,450 tokens of SmolLM2's cache, plenty for the tests and small enough to fill.
engine03, server03 = stage_fixtures("03_paged_kv", kv_cache_mb=64)
engine04, server04 = stage_fixtures("04_continuous_batching", kv_cache_mb=64)
engine05, server05 = stage_fixtures("05_prefix_cache", kv_cache_mb=64)
# Stage 06 with its smallest budget for 64 sequences: the server tests' prompts of several requests get chunked.
engine06, server06 = stage_fixtures("06_chunked_prefill", kv_cache_mb=64, max_num_batched_tokens=64)
engine07, server07 = stage_fixtures("07_cuda_graphs", kv_cache_mb=64, max_num_batched_tokens=64)
engine08, server08 = stage_fixtures("08_speculative", kv_cache_mb=64, max_num_batched_tokens=64)
# Stage 09 with one rank, like every stage before it; test_09_tensor_parallel starts the engines of several.
engine09, server09 = stage_fixtures("09_tensor_parallel", kv_cache_mb=64, max_num_batched_tokens=64)
engine10, server10 = stage_fixtures("10_overlap_scheduling", kv_cache_mb=64, max_num_batched_tokens=64)
engine11, server11 = stage_fixtures("11_quantization", kv_cache_mb=64, max_num_batched_tokens=64)
# Stage 12's engine is stage 11's, unchanged: the every-stage test runs it too (its server is tested through
# the gateway, in test_12_gateway).
engine12, server12 = stage_fixtures("12_gateway", kv_cache_mb=64, max_num_batched_tokens=64)
