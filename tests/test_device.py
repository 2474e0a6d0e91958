"""Device selection (common/device.py), the one rule every stage uses: ``auto`` falls back to the CPU
quietly, ``cuda`` on a machine without CUDA fails at once with one line that says what to do."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from common.device import DeviceUnavailable, build_off_the_main_thread, pick_device, pick_dtype

from .stages import REPO


def test_auto_falls_back_to_the_cpu_and_cuda_insists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(DeviceUnavailable, match="--device cpu or auto"):
        pick_device("cuda")
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16


@pytest.mark.e2e  # a whole model or a process: left out of `make test-fast`
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_stage_asked_for_cuda_without_it_says_so_in_one_line():
    run = subprocess.run([sys.executable, "-m", "02_streaming", "--device", "cuda", "--demo"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda: CUDA is not usable here")


def test_build_off_the_main_thread_builds_on_a_thread_that_has_ended():
    """What it builds comes back; it was built on another thread, which is gone (and its OpenMP pool with it)."""
    built_on: list[threading.Thread] = []

    def make() -> torch.Tensor:
        built_on.append(threading.current_thread())
        return torch.ones(4) @ torch.ones(4)

    assert build_off_the_main_thread(make).item() == 4.0
    assert built_on[0] is not threading.current_thread() and not built_on[0].is_alive()


def test_build_off_the_main_thread_raises_what_the_build_raised():
    def fail() -> None:
        raise DeviceUnavailable("--device cuda: CUDA is not usable here")

    with pytest.raises(DeviceUnavailable, match="not usable"):  # so each __main__'s one-line error still works
        build_off_the_main_thread(fail)
