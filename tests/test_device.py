"""Device selection (common/device.py), the one rule every stage uses: ``auto`` falls back to the CPU
quietly, ``cuda`` on a machine without CUDA fails at once with one line that says what to do."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from common.device import DeviceUnavailable, pick_device, pick_dtype

from .stages import REPO, has


def test_auto_falls_back_to_the_cpu_and_cuda_insists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(DeviceUnavailable, match="--device cpu or auto"):
        pick_device("cuda")
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_stage_asked_for_cuda_without_it_says_so_in_one_line():
    run = subprocess.run([sys.executable, "-m", "02_streaming", "--device", "cuda", "--demo"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda: CUDA is not usable here")


def test_the_gpu_check_without_cuda_says_so_in_one_line_and_runs_nothing(monkeypatch, capsys, tmp_path):
    from common import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "run", lambda *a, **k: pytest.fail("a check ran without CUDA"))
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().out.count("\n") == 1 and not any(tmp_path.iterdir())


def test_the_gpu_check_covers_every_stage_with_both_attentions_and_benchmarks_from_04(monkeypatch, tmp_path):
    """What `make gpu-check` would run, recorded instead of run (the commands themselves need a GPU)."""
    from common import gpu_check

    ran: list[tuple[str, dict]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a pretend GPU")
    monkeypatch.setattr(gpu_check, "pick_model", lambda name: (tmp_path, "pretend"))
    monkeypatch.setattr(gpu_check, "run", lambda name, command, log, env=None, timeout_s=0:
                        ran.append((name, env or {})) or {"name": name, "exit": 0})
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    names = [name for name, _ in ran]
    assert names[0] == "GPU suite" and ran[0][1]["LLM_COURSE_MODEL"] == str(tmp_path)
    for folder in gpu_check.stage_folders():
        both = (REPO / folder / "triton_attention.py").is_file()  # the Triton kernels and the reference
        expected = [f"{folder} demo (triton)", f"{folder} demo (torch)"] if both else [f"{folder} demo (auto)"]
        assert [n for n in names if n.startswith(f"{folder} demo")] == expected
        assert (f"{folder} benchmark" in names) == has(folder, "batching")  # a stage that serves many at once
    assert (tmp_path / "summary.json").is_file()
