"""The course's stages, in one place. Every test that runs over stages takes its list from here, so a
new stage joins each component test of the modules it has (sampler, block manager, scheduler,
attention, model, server) by being listed once."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

STAGES = ["01_naive", "02_streaming", "03_paged_kv", "04_continuous_batching", "05_prefix_cache", "06_chunked_prefill",
          "07_cuda_graphs", "08_speculative", "09_tensor_parallel"]
FASTAPI_STAGES = STAGES[1:]  # the OpenAI server with streaming; stage 01 is a Flask app


def stages_with(module: str) -> list[str]:
    """The stages whose folder has ``module``.py, in course order."""
    return [folder for folder in STAGES if (REPO / folder / f"{module}.py").is_file()]


def changed_stages_with(*modules: str) -> list[str]:
    """The stages that have ``modules`` (.py files) and whose copy of any of them differs from the previous
    stage's. A byte-identical copy is the same code (test_stage_diffs holds every copy to that), so the
    tests of a costly component (the attention kernels under the Triton interpreter) run once per version
    of it, not once per stage."""
    kept, previous = [], None
    for folder in stages_with(modules[0]):
        sources = [(REPO / folder / f"{module}.py").read_bytes() for module in modules]
        if sources != previous:
            kept.append(folder)
        previous = sources
    return kept


def graded_first(folders: list[str], exercise: str) -> list:
    """``folders`` as pytest params, the first (the stage that introduces the code) grading ``exercise``."""
    return [pytest.param(folders[0], marks=pytest.mark.exercise(exercise)), *folders[1:]]
