"""The course's stages, in one place. Every test that runs over stages takes its list from here, so a
new stage joins each component test of the modules it has (sampler, block manager, scheduler,
attention, model, server) by being listed once."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

STAGES = ["01_naive", "02_streaming", "03_paged_kv", "04_continuous_batching"]
FASTAPI_STAGES = STAGES[1:]  # the OpenAI server with streaming; stage 01 is a Flask app


def stages_with(module: str) -> list[str]:
    """The stages whose folder has ``module``.py, in course order."""
    return [folder for folder in STAGES if (REPO / folder / f"{module}.py").is_file()]


def graded_first(folders: list[str], exercise: str) -> list:
    """``folders`` as pytest params, the first (the stage that introduces the code) grading ``exercise``."""
    return [pytest.param(folders[0], marks=pytest.mark.exercise(exercise)), *folders[1:]]
