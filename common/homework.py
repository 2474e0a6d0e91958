"""Homework: make a student copy of a stage from its solution markers, and grade a copy with the tests.

A stage's reference code marks each exercise the nbgrader way::

        ### BEGIN SOLUTION 1.2
        ...reference code...
        ### END SOLUTION

``make`` copies the stage folder and replaces each marked region with
``raise NotImplementedError("Exercise 1.2: see EXERCISES.md")`` at the marker's indentation.
``grade`` runs the tests marked ``@pytest.mark.exercise("1.2")`` against a copy (the tests import
stages from ``$STAGE_ROOT``) and prints a score per exercise.

    python -m common.homework make  --stage 01 --out homework
    python -m common.homework grade --stage 01 --dir homework

This module is also the pytest plugin that ``grade`` loads into its pytest run (``-p common.homework``):
it keeps only the stage's graded tests and writes each test's outcome to a JSON file.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION (?P<id>\d+\.\d+)\s*$")
END = re.compile(r"^\s*### END SOLUTION\s*$")
TITLE = re.compile(r"^## Exercise (?P<id>\d+\.\d+): (?P<title>.+)$", re.MULTILINE)


# --- a stage's solution regions ----------------------------------------------------------------


def stage_dir(stage: int, root: Path = REPO) -> Path:
    """The folder of stage ``stage`` under ``root``, e.g. root/01_naive."""
    matches = sorted(root.glob(f"{stage:02d}_*/__init__.py"))
    if not matches:
        raise SystemExit(f"error: no stage {stage:02d}_* folder in {root}")
    return matches[0].parent


def stub_source(source: str, path: Path, stage: int | None = None) -> tuple[str, list[str]]:
    """Replace the solution regions of one file with their stubs; return the new source and the ids stubbed.

    With ``stage``, only that stage's regions (ids ``stage.k``) become stubs. A file a stage copied
    from an earlier one keeps that stage's markers, so that the copy stays byte-identical to its
    original; in this stage's student copy those regions become plain code (the markers go, the
    solution stays: it is an earlier stage's homework, done).
    """
    out: list[str] = []
    ids: list[str] = []
    region: str | None = None
    stubbed = False  # whether the open region is being replaced by its stub
    for number, line in enumerate(source.splitlines(keepends=True), start=1):
        if begin := BEGIN.match(line):
            if region is not None:
                raise ValueError(f"{path}:{number}: BEGIN SOLUTION inside region {region}")
            region = begin["id"]
            stubbed = stage is None or int(region.split(".")[0]) == stage
            if stubbed:
                ids.append(region)
                out.append(f'{begin["indent"]}raise NotImplementedError("Exercise {region}: see EXERCISES.md")\n')
        elif END.match(line):
            if region is None:
                raise ValueError(f"{path}:{number}: END SOLUTION without BEGIN")
            region = None
        elif region is None or not stubbed:
            out.append(line)
    if region is not None:
        raise ValueError(f"{path}: region {region} has no END SOLUTION")
    student = "".join(out)
    ast.parse(student, filename=str(path))  # raises SyntaxError if a region does not leave valid Python
    return student, ids


def stub_stage(folder: Path) -> tuple[dict[str, str], list[str]]:
    """Each .py file of a stage folder with this stage's regions stubbed, and their exercise ids (in order)."""
    number = int(folder.name[:2])
    sources: dict[str, str] = {}
    ids: list[str] = []
    for path in sorted(folder.glob("*.py")):
        sources[path.name], found = stub_source(path.read_text(), path, number)
        ids += found
    if len(set(ids)) != len(ids):
        raise ValueError(f"{folder}: an exercise id marks more than one region: {ids}")
    return sources, sorted(ids, key=lambda i: int(i.split(".")[1]))


def exercise_titles(folder: Path) -> dict[str, str]:
    """Titles from the stage's EXERCISES.md headings: ``## Exercise 1.2: top-p sampling``."""
    path = folder / "EXERCISES.md"
    return {m["id"]: m["title"].strip() for m in TITLE.finditer(path.read_text())} if path.exists() else {}


# --- make -------------------------------------------------------------------------------------


def make(stage: int, out: Path, force: bool = False) -> Path:
    """Write the student copy of ``stage`` to ``out/NN_name`` and return that folder."""
    source = stage_dir(stage)
    target = out / source.name
    if target.exists() and not force:
        raise SystemExit(f"error: {target} already exists (your work?); move it away, or pass --force")
    sources, ids = stub_stage(source)
    if not ids:
        raise SystemExit(f"error: {source} has no ### BEGIN SOLUTION regions")
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name, student in sources.items():
        (target / name).write_text(student)
    return target


# --- grade ------------------------------------------------------------------------------------


@dataclass
class Score:
    exercise: str
    title: str
    passed: int
    total: int

    @property
    def ok(self) -> bool:
        return self.total > 0 and self.passed == self.total


@dataclass
class Grade:
    scores: list[Score]
    problems: list[str]  # what fails the grade by itself, e.g. a test module that could not be imported

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.scores) and not self.problems


def graded_test_files(stage: int) -> list[Path]:
    """The test files that name one of the stage's exercises (``"4.1"``, ...): only they are collected, since
    collecting the whole suite takes longer than running a stage's graded tests."""
    exercise_id = re.compile(rf"""["']{stage}\.\d+["']""")
    return [path for path in sorted((REPO / "tests").glob("test_*.py")) if exercise_id.search(path.read_text())]


def run_graded_tests(stage: int, root: Path) -> tuple[int, list[dict[str, str]]]:
    """Run the stage's graded tests with STAGE_ROOT=root in a pytest subprocess: its exit code and outcomes."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [
            sys.executable, "-m", "pytest", *map(str, graded_test_files(stage)),
            "-p", "common.homework", f"--grade-stage={stage}", f"--grade-report={report}", "-p", "pytest_timeout",
            "-p", "no:cacheprovider", "-o", "addopts=", "-q", "--tb=line", "-rfE",
        ]
        # Only the plugins above: loading every installed one (schemathesis, hypothesis ...) costs seconds a run.
        env = {**os.environ, "STAGE_ROOT": str(root.resolve()), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        exit_code = subprocess.run(command, cwd=REPO, env=env, check=False).returncode
        return exit_code, json.loads(report.read_text()) if report.exists() else []


def grade(stage: int, root: Path) -> Grade:
    """Score each exercise of ``stage`` in the copy under ``root`` (the repository root grades the reference)."""
    reference = stage_dir(stage)
    if not (root / reference.name).is_dir():
        raise SystemExit(f"error: no {root / reference.name}; make it with `make homework STAGE={stage:02d}`")
    _, ids = stub_stage(reference)
    titles = exercise_titles(reference)
    exit_code, tests = run_graded_tests(stage, root)
    problems = [f"{t['nodeid']} grades exercise {t['exercise']}, which {reference.name} does not mark"
                for t in tests if t["exercise"] not in ids]
    if exit_code not in (0, 1):  # 0: all passed, 1: some failed; anything else: the run itself went wrong
        problems.append(f"pytest stopped with exit code {exit_code} (see its output above)")
    scores = [
        Score(i, titles.get(i, ""), sum(t["outcome"] == "passed" for t in tests if t["exercise"] == i),
              sum(t["exercise"] == i for t in tests))
        for i in ids
    ]
    return Grade(scores, problems)


def print_grade(result: Grade) -> None:
    width = max((len(s.title) for s in result.scores), default=0)
    print()
    for s in result.scores:
        verdict = f"{s.passed}/{s.total} passed" if s.total else "no graded tests"
        print(f"Exercise {s.exercise:<5} {s.title:<{width}}  {verdict}")
    for problem in result.problems:
        print(f"error: {problem}")
    scores = result.scores
    print(f"Total: {sum(s.ok for s in scores)}/{len(scores)} exercises complete, "
          f"{sum(s.passed for s in scores)}/{sum(s.total for s in scores)} tests passed")


# --- the pytest plugin that `grade` loads -----------------------------------------------------


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("homework")
    group.addoption("--grade-stage", type=int, help="run only the tests marked exercise('N.k') of stage N")
    group.addoption("--grade-report", help="write each graded test's outcome to this JSON file")


def pytest_configure(config: Any) -> None:
    stage, report = config.getoption("grade_stage"), config.getoption("grade_report")
    if stage is not None:
        config.pluginmanager.register(Grader(stage, Path(report) if report else None), "homework-grader")


class Grader:
    """Keeps the stage's graded tests only, records each one's outcome, writes them out at the end."""

    def __init__(self, stage: int, report: Path | None) -> None:
        self.prefix = f"{stage}."
        self.report = report
        self.tests: dict[str, dict[str, str]] = {}  # nodeid -> {"exercise": "1.2", "outcome": "passed"}

    @staticmethod
    def exercise(item: Any) -> str:
        marker = item.get_closest_marker("exercise")
        return str(marker.args[0]) if marker else ""

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        keep = [item for item in items if self.exercise(item).startswith(self.prefix)]
        config.hook.pytest_deselected(items=[item for item in items if not self.exercise(item).startswith(self.prefix)])
        items[:] = keep
        self.tests = {item.nodeid: {"exercise": self.exercise(item), "outcome": "not run"} for item in keep}

    def pytest_runtest_logreport(self, report: Any) -> None:
        """A test passes when its call passed and no phase (setup, call, teardown) failed."""
        test = self.tests.get(report.nodeid)
        if test is None:
            return
        if report.failed:
            test["outcome"] = "failed"
        elif report.when == "call" and test["outcome"] != "failed":
            test["outcome"] = "passed" if report.passed else "skipped"

    def pytest_sessionfinish(self) -> None:
        if self.report is not None:
            tests = [{"nodeid": nodeid, **test} for nodeid, test in self.tests.items()]
            self.report.write_text(json.dumps(tests, indent=1))


# --- command line -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.homework", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make_cmd = commands.add_parser("make", help="write a student copy of a stage, its exercises replaced by stubs")
    make_cmd.add_argument("--stage", type=int, required=True, help="stage number, e.g. 01")
    make_cmd.add_argument("--out", type=Path, default=Path("homework"), help="folder to write NN_name/ into")
    make_cmd.add_argument("--force", action="store_true", help="overwrite an existing copy (and the work in it)")
    grade_cmd = commands.add_parser("grade", help="run a stage's graded tests against a copy; score each exercise")
    grade_cmd.add_argument("--stage", type=int, required=True, help="stage number, e.g. 01")
    grade_cmd.add_argument("--dir", type=Path, default=Path("homework"),
                           help="folder that holds NN_name/ (the repository root grades the reference)")
    args = parser.parse_args(argv)

    if args.command == "make":
        target = make(args.stage, args.out, args.force)
        print(f"Wrote {target}. The exercises: {target / 'EXERCISES.md'}. "
              f"Grade them with: make grade STAGE={args.stage:02d} DIR={args.out}")
        return 0
    result = grade(args.stage, args.dir)
    print_grade(result)
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
