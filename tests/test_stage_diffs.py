"""Copy-forward without drift: each stage is the previous one plus one lesson, so a file a stage does not
change must stay byte-identical to the previous stage's. The manifest below says, per stage, which of
the previous stage's files its lesson changes; any other difference fails here the day it appears.
(New files are free: they are the lesson. `diff -ruN PREVIOUS STAGE` shows them all.)"""

from __future__ import annotations

import filecmp
import itertools

import pytest

from .stages import REPO, STAGES

# The files each stage changes, relative to the stage before it (the README, EXERCISES.md and the
# package's own identity, __init__.py and __main__.py, always change).
ALWAYS = {"README.md", "EXERCISES.md", "__init__.py", "__main__.py"}
MAY_CHANGE = {
    "02_streaming": {"engine.py", "sampler.py", "server.py"},  # streaming; the complete OpenAI API
    "03_paged_kv": {"config.py", "engine.py", "metrics.py", "server.py"},  # the paged KV cache
    "04_continuous_batching": {"attention.py", "config.py", "engine.py", "metrics.py", "sampler.py", "sequence.py"},
    # the prefix cache: shared, counted, evictable blocks; a cache hit at admission; what users see of it
    "05_prefix_cache": {"block_manager.py", "config.py", "engine.py", "metrics.py", "scheduler.py", "sequence.py",
                        "server.py"},
    # chunked prefill: a token budget per step, decodes first; one pass for decode rows and prompt chunks
    "06_chunked_prefill": {"attention.py", "config.py", "engine.py", "model_runner.py", "scheduler.py",
                           "sequence.py"},
    # CUDA graphs: decode steps from static buffers in buckets, captured on CUDA; padding rows that do nothing
    "07_cuda_graphs": {"attention.py", "config.py", "engine.py", "model_runner.py", "triton_attention.py"},
    # speculative decoding: room for guesses, k + 1 rows a sequence, verification, rejected blocks back, counters
    "08_speculative": {"block_manager.py", "config.py", "engine.py", "metrics.py", "model_runner.py", "scheduler.py",
                       "sequence.py", "server.py"},
    # tensor parallelism: parallel layers loading their slices, ranks started and stopped, steps broadcast
    "09_tensor_parallel": {"config.py", "engine.py", "model.py", "model_runner.py"},
}


def files(folder: str) -> set[str]:
    return {p.name for p in (REPO / folder).iterdir() if p.is_file() and p.suffix in (".py", ".md")}


@pytest.mark.parametrize(("previous", "current"), list(itertools.pairwise(STAGES)), ids=STAGES[1:])
def test_a_stage_changes_only_its_lesson_files(previous, current):
    assert current in MAY_CHANGE, f"add {current} to MAY_CHANGE in this file"
    allowed = ALWAYS | MAY_CHANGE[current]
    shared = files(previous) & files(current)
    changed = {name for name in shared if not filecmp.cmp(REPO / previous / name, REPO / current / name, shallow=False)}
    assert changed - allowed == set(), (
        f"{current} differs from {previous} in files its lesson does not change; copy them forward unchanged "
        f"(or, if the lesson needs it, add them to MAY_CHANGE)")
    assert files(previous) <= files(current), f"{current} dropped {sorted(files(previous) - files(current))}"
    assert MAY_CHANGE[current] <= changed, f"{sorted(MAY_CHANGE[current] - changed)} no longer differ: tidy MAY_CHANGE"
