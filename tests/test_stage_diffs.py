"""Copy-forward without drift: each stage is the previous one plus one lesson, so what a stage's lesson does
not change must stay as the previous stage has it. tests/stages.py's TABLE says, per stage, which of the
previous stage's files its lesson changes and, in each, which top-level definitions; any other difference
fails here the day it appears. (New files are free: they are the lesson. `diff -ruN PREVIOUS STAGE` shows
them all; `python -m tests.stages --why` lists the definitions that differ, `--write` rewrites TABLE.)

Two checks per stage: a file outside the lesson must be byte-identical; in a file the lesson changes, each
top-level definition must be as the previous stage has it (compared by ``ast.dump``: every name, value and
docstring, but no comment or line number) unless the table names it. Definitions are functions, classes
(as a whole, their docstrings included), module-level variables, the module docstring (``__doc__``), the
imports (``<imports>``) and any other top-level code (``<statements>``)."""

from __future__ import annotations

import itertools

import pytest

from .stages import ALWAYS, BY_FOLDER, STAGES, TOOLING, changed_files, files, lesson_changes, stage_folders

PAIRS = list(itertools.pairwise(STAGES))


def test_the_table_lists_every_stage_folder():
    assert STAGES == stage_folders(), "add each stage folder, in course order, to TABLE in tests/stages.py"


@pytest.mark.parametrize(("previous", "current"), PAIRS, ids=STAGES[1:])
def test_a_stage_changes_only_its_lesson_files(previous, current):
    lesson = set(BY_FOLDER[current].changes)
    changed = changed_files(previous, current)
    assert changed - ALWAYS - lesson == set(), (
        f"{current} differs from {previous} in files its lesson does not change; copy them forward unchanged "
        f"(or, if the lesson needs it, add them to {current}'s changes in tests/stages.py)")
    dropped = files(previous) - files(current)
    assert dropped <= TOOLING, f"{current} dropped {sorted(dropped - TOOLING)}"
    assert lesson <= changed, f"{sorted(lesson - changed)} no longer differ: tidy {current}'s changes"


@pytest.mark.parametrize("harness", sorted(TOOLING))
def test_a_benchmark_harness_lives_only_beside_the_lesson_it_measures(harness):
    """A later stage measures itself with the teaching stage's harness and ``--stage NN``, not with a copy."""
    holders = [folder for folder in STAGES if harness in files(folder)]
    assert len(holders) == 1, f"{harness} is in {holders}: keep the first, and run it with --stage NN"


@pytest.mark.parametrize(("previous", "current"), PAIRS, ids=STAGES[1:])
def test_a_stage_changes_only_its_lesson_definitions(previous, current):
    allowed = BY_FOLDER[current].may_change
    actual = {f"{file}:{name}": how for file, changed in lesson_changes(previous, current).items()
              for name, how in changed.items()}
    unlisted = {name: how for name, how in actual.items() if name not in allowed}
    assert not unlisted, (
        f"{current} changes definitions of {previous} that its lesson does not list:\n"
        + "\n".join(f"  {name}: {how}" for name, how in sorted(unlisted.items()))
        + f"\ncopy them forward unchanged (or, if the lesson needs it, add them to {current}'s changes in "
          "tests/stages.py: `python -m tests.stages --write`)")
    stale = sorted(allowed - actual.keys())
    assert not stale, f"{current}: {stale} no longer differ from {previous}: tidy its changes (`--write`)"
