"""The homework tooling: a student copy has every solution region replaced by a stub and still imports;
graded, it fails every exercise, while the reference passes every one."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from common import homework

from .stages import STAGES as ALL_STAGES

REPO = Path(__file__).resolve().parent.parent
STAGES = [int(folder[:2]) for folder in ALL_STAGES]
SCORE_LINE = re.compile(r"^Exercise (\d+\.\d+) .* (\d+)/(\d+) passed$", re.MULTILINE)


@pytest.fixture(scope="module", params=STAGES, ids=lambda s: f"stage{s:02d}")
def student(request, tmp_path_factory) -> tuple[int, Path]:
    """(stage, folder that holds the student copy NN_name/)."""
    out = tmp_path_factory.mktemp("homework")
    homework.make(request.param, out)
    return request.param, out


def test_every_region_becomes_one_stub(student):
    stage, out = student
    reference = homework.stage_dir(stage)
    copy = out / reference.name
    _, ids = homework.stub_stage(reference)
    assert len(ids) >= 3
    sources = "".join(path.read_text() for path in copy.glob("*.py"))
    assert "### BEGIN SOLUTION" not in sources and "### END SOLUTION" not in sources
    for exercise in ids:
        assert sources.count(f'raise NotImplementedError("Exercise {exercise}: see EXERCISES.md")') == 1
    assert sources.count("raise NotImplementedError(") == len(ids)
    copied = sorted(p.name for p in reference.iterdir() if p.name != "__pycache__")
    assert sorted(p.name for p in copy.iterdir()) == copied
    assert set(homework.exercise_titles(copy)) == set(ids)  # EXERCISES.md has a section for each exercise


def test_the_student_copy_imports(student):
    """Every module of the copy imports, from the copy: here, with the reference's package set aside meanwhile (a
    process of its own would spend most of its time importing PyTorch again)."""
    stage, out = student
    name = homework.stage_dir(stage).name
    modules = sorted(p.stem for p in (out / name).glob("*.py") if p.stem != "__init__")
    ours = lambda module: module == name or module.startswith(f"{name}.")  # noqa: E731
    reference = {module: sys.modules.pop(module) for module in list(sys.modules) if ours(module)}
    sys.path.insert(0, str(out))
    try:
        files = [importlib.import_module(f"{name}.{module}").__file__ for module in modules]
    finally:
        sys.path.remove(str(out))
        for module in [module for module in sys.modules if ours(module)]:
            del sys.modules[module]
        sys.modules.update(reference)
    assert all(file.startswith(str(out)) for file in files), files


def grade(stage: int, root: Path, capsys) -> tuple[int, dict[str, tuple[int, int]]]:
    """Run the CLI's grade; return its exit status and {exercise: (passed, total)} from its table."""
    status = homework.main(["grade", "--stage", str(stage), "--dir", str(root)])
    table = capsys.readouterr().out
    return status, {m[1]: (int(m[2]), int(m[3])) for m in SCORE_LINE.finditer(table)}


def test_grading_the_student_copy_fails_every_exercise(student, capsys):
    stage, out = student
    status, scores = grade(stage, out, capsys)
    assert status == 1
    assert set(scores) == set(homework.stub_stage(homework.stage_dir(stage))[1])
    assert all(passed == 0 and total > 0 for passed, total in scores.values()), scores


# The newest stage only: every stage's graded tests already pass on the reference in the main suite (they are
# ordinary tests there), and the student copies above show that every stage's exercises are found and graded.
# This adds the grade command's verdict on a passing copy, which is the same code for every stage.
@pytest.mark.e2e  # a whole model or a process: left out of `make test-fast`
@pytest.mark.parametrize("stage", STAGES[-1:], ids=lambda s: f"stage{s:02d}")
def test_grading_the_reference_passes_every_exercise(stage, capsys):
    status, scores = grade(stage, REPO, capsys)
    assert status == 0
    assert set(scores) == set(homework.stub_stage(homework.stage_dir(stage))[1])
    assert all(passed == total > 0 for passed, total in scores.values()), scores


def test_make_refuses_to_overwrite_a_copy(student):
    stage, out = student
    with pytest.raises(SystemExit, match="already exists"):
        homework.make(stage, out)


def test_a_region_must_leave_valid_python():
    source = "x = (\n    ### BEGIN SOLUTION 1.1\n    1 +\n    ### END SOLUTION\n    2)\n"
    with pytest.raises(SyntaxError):
        homework.stub_source(source, Path("broken.py"))
    with pytest.raises(ValueError, match="no END SOLUTION"):
        homework.stub_source("def f():\n    ### BEGIN SOLUTION 1.1\n    return 1\n", Path("open.py"))


def test_an_earlier_stages_region_stays_as_plain_code():
    """Stage 03 copies stage 02's files with their markers (byte-identical copies); stage 03's homework
    stubs only its own regions and keeps the earlier solution, without the markers."""
    source = ("def a():\n    ### BEGIN SOLUTION 2.4\n    return 2\n    ### END SOLUTION\n\n"
              "def b():\n    ### BEGIN SOLUTION 3.1\n    return 3\n    ### END SOLUTION\n")
    student, ids = homework.stub_source(source, Path("copied.py"), stage=3)
    assert ids == ["3.1"]
    assert student == ('def a():\n    return 2\n\ndef b():\n'
                       '    raise NotImplementedError("Exercise 3.1: see EXERCISES.md")\n')
