"""What a learner reads agrees with the code and the committed files: the stage numbers and names the prose uses, the
ports it tells them to use, the notebooks' titles, and the result files' own record of what made them.

A stage is renumbered when one is inserted before it; these checks are what keeps every line that names it true
afterwards. They read files only (no model, no server) and take well under a second."""

from __future__ import annotations

import functools
import importlib
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STAGES = sorted(path.name for path in REPO.glob("[0-9][0-9]_*") if (path / "__main__.py").exists())
NUMBER = {name.split("_", 1)[1]: int(name[:2]) for name in STAGES}  # "gateway" -> 12
LATEST = max(NUMBER.values())
PORTS = {int(name[:2]): importlib.import_module(name).PORT for name in STAGES}  # each stage's default --port


def prose_files() -> list[Path]:
    """Every file a learner reads: the top-level guides, each stage's lesson and exercises, the results' READMEs."""
    files = [REPO / name for name in ("README.md", "TROUBLESHOOTING.md", "GLOSSARY.md", "CONTRIBUTING.md")]
    files += [REPO / stage / name for stage in STAGES for name in ("README.md", "EXERCISES.md")]
    files += sorted((REPO / "results").glob("**/README.md"))
    return [path for path in files if path.exists()]


def notebook_markdown(path: Path) -> list[str]:
    """The markdown cells of a notebook, each as one string."""
    cells = json.loads(path.read_text())["cells"]
    return ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown"]


def texts() -> list[tuple[str, str]]:
    """(where, text) for every prose file and every notebook's markdown."""
    found = [(str(path.relative_to(REPO)), path.read_text()) for path in prose_files()]
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        found += [(f"{path.relative_to(REPO)} cell {i}", text) for i, text in enumerate(notebook_markdown(path))]
    return found


def matches(pattern: re.Pattern) -> list[tuple[str, re.Match]]:
    """Every match of ``pattern`` in what a learner reads, as ``where:line`` and the match; a space in the pattern
    (written ``\\s+``) also matches a line break, which hid "Stage\\n10" from the last renumbering."""
    found = []
    for where, text in texts():
        for match in pattern.finditer(text):
            found.append((f"{where}:{text.count(chr(10), 0, match.start()) + 1}", match))
    return found


# A stage's folder name, as prose writes it: `12_gateway`, `10_overlap_scheduling.json`, `python -m 09_tensor_parallel`.
STAGE_NAME = re.compile(r"\b(\d\d)_(" + "|".join(sorted(NUMBER, key=len, reverse=True)) + r")\b")


def test_every_stage_folder_named_in_the_prose_has_its_number():
    """`10_gateway` (a module that no longer exists) or `05_tensor_parallel` would send a learner to no folder."""
    wrong = [f"{where}: {match.group(0)} (the stage is {NUMBER[match.group(2)]:02d}_{match.group(2)})"
             for where, match in matches(STAGE_NAME) if int(match.group(1)) != NUMBER[match.group(2)]]
    assert not wrong, "\n".join(wrong)


# The whole course's range, said in words: "the stages in order, 01 to 10", "`01_naive/` ... `10_...`". (A range
# of some stages, "01-06", is not the course's.)
RANGE = re.compile(r"in\s+order,?\s+01\s+to\s+(\d\d)\b|01_naive/?`?\s*\.\.\.\s*`?(\d\d)_")


def test_the_course_range_ends_at_the_latest_stage():
    wrong = [f"{where}: {match.group(0)} (the latest stage is {LATEST:02d})"
             for where, match in matches(RANGE) if int(next(g for g in match.groups() if g)) != LATEST]
    assert not wrong, "\n".join(wrong)


# What each stage is, in the words prose uses for it: "stage 10's gateway" is wrong once the gateway is 12.
TOPICS = {"gateway": "gateway", "Ray fleet": "gateway", "Ray Serve": "gateway",
          "overlap scheduling": "overlap_scheduling", "tensor parallelism": "tensor_parallel",
          "speculative decoding": "speculative", "CUDA graphs": "cuda_graphs",
          "chunked prefill": "chunked_prefill", "prefix cache": "prefix_cache", "continuous batching":
          "continuous_batching", "paged KV cache": "paged_kv"}
STAGE_TOPIC = re.compile(r"\b[Ss]tage\s+(\d\d)(?:'s)?,?\s+(?:with\s+its\s+|its\s+|the\s+|is\s+|adds\s+|teaches\s+)?("
                         + "|".join(topic.replace(" ", r"\s+") for topic in sorted(TOPICS, key=len, reverse=True))
                         + r")\b")


def test_a_stage_named_with_its_topic_has_the_topics_number():
    wrong = []
    for where, match in matches(STAGE_TOPIC):
        topic = " ".join(match.group(2).split())
        if int(match.group(1)) != NUMBER[TOPICS[topic]]:
            said = " ".join(match.group(0).split())
            wrong.append(f"{where}: {said!r} ({topic} is stage {NUMBER[TOPICS[topic]]:02d})")
    assert not wrong, "\n".join(wrong)


def test_each_notebook_is_titled_by_its_own_stage():
    """A notebook's title (its first heading) names its own stage first: notebook 11 titled "Stage 10 against stage 09"
    is the renumbering's leftover."""
    wrong = []
    for path in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        title = next(line for line in notebook_markdown(path)[0].splitlines() if line.startswith("#"))
        named = re.findall(r"\b[Ss]tage (\d\d)\b", title)
        if named and int(named[0]) != int(path.name[:2]):
            wrong.append(f"{path.name}: {title!r}")
    assert not wrong, "\n".join(wrong)


# `python -m 09_tensor_parallel --port 8012`: a port the prose starts a stage on.
STARTED_ON = re.compile(r"python -m (\d\d)_\w+(?: [^\n|]*?)? --port (\d+)")


def test_no_stage_is_started_on_another_stages_default_port():
    """An example that starts stage 09 on 8012 collides with a running gateway (and teaches the wrong default)."""
    wrong = []
    for where, match in matches(STARTED_ON):
        stage, port = int(match.group(1)), int(match.group(2))
        owner = next((s for s, p in PORTS.items() if p == port), None)
        if owner is not None and owner != stage:
            wrong.append(f"{where}: stage {stage:02d} on {port}, stage {owner:02d}'s default port")
    assert not wrong, "\n".join(wrong)


def test_a_code_block_talks_to_the_port_it_started_its_server_on():
    """A block that starts a server on ``--port P`` and then sends requests to another port sends them to nothing (or
    to whatever else listens there)."""
    wrong = []
    for where, text in texts():
        for block in re.finditer(r"```[^\n]*\n(.*?)```", text, re.S):
            started = {int(port) for port in re.findall(r"python -m \d\d_\w+[^\n]*? --port (\d+)", block.group(1))}
            if len(started) != 1:
                continue
            line = text.count("\n", 0, block.start()) + 1
            for port in map(int, re.findall(r"(?:localhost|127\.0\.0\.1):(\d+)", block.group(1))):
                if port not in started:
                    wrong.append(f"{where}:{line}: a block that starts a server on {started.pop()} talks to {port}")
                    break
    assert not wrong, "\n".join(wrong)


def test_the_gateways_probe_port_is_quoted_as_it_is():
    """The liveness probe listens on ``--port`` + 1: a line that sends a probe to a port names that one."""
    gateway = NUMBER["gateway"]
    probe = PORTS[gateway] + 1
    wrong = []
    for where, text in texts():
        for n, line in enumerate(text.splitlines(), start=1):
            if re.search(r"health-port|liveness|probe port", line):
                for port in map(int, re.findall(r"\b(80\d\d)\b", line)):
                    if port != probe:
                        wrong.append(f"{where}:{n}: {port} (the probe port is {probe})")
    assert not wrong, "\n".join(wrong)


def result_files() -> list[Path]:
    return sorted(path for path in (REPO / "results").glob("**/*.json") if re.match(r"\d\d_", path.name))


@pytest.mark.parametrize("path", result_files(), ids=lambda path: str(path.relative_to(REPO / "results")))
def test_a_result_file_names_the_stage_and_the_module_that_made_it(path):
    """A result file's ``stage`` is the stage its name says, and its ``command`` runs a module that exists."""
    data = json.loads(path.read_text())
    records = data if isinstance(data, list) else [data]
    for record in records:
        if not isinstance(record, dict):
            continue
        stage = str(record.get("stage", path.name[:2]))  # a number ("10", 10) or a folder ("07_cuda_graphs")
        # The file's own stage, or the neighbour its name says it measured (10_..._stage09.json, ..._ab09_1.json)
        measured = {int(path.name[:2]), *map(int, re.findall(r"(?:stage|ab)(\d\d)", path.name))}
        assert int(stage[:2]) in measured, f"{path.name}: stage {stage}"
        for module in re.findall(r"python -m ([\w.]+)", str(record.get("command", ""))):
            parts = module.split(".")
            candidates = [REPO.joinpath(*parts).with_suffix(".py"), REPO.joinpath(*parts) / "__main__.py"]
            assert any(candidate.exists() for candidate in candidates), f"{path.name}: no module {module}"


# --- the numbers quoted beside a result file ---------------------------------------------------------------------
# A number in the prose comes from a committed file, and the prose names the file beside it. The check reads a
# paragraph (joined across its line breaks) in clauses (split at ";" and at each sentence's end); a clause that names
# a result file (`results/cpu/x.json`, `x.json`, or `_suffix.json` after a file whose stage it shares) has each of
# its decimal numbers checked against every value of every result file its paragraph names, at its printed rounding
# and in the units prose converts to (s to ms, a share to %, bytes to MiB). Ratios ("1.5x", "1.1-1.7x", "2.7 times")
# and shares ("80%") are worked out from two values, so they are not looked up; neither are whole numbers (counts).
RESULT_FILES = {str(path.relative_to(REPO)): path for path in (REPO / "results").glob("**/*.json")}
RESULTS_BY_NAME: dict[str, list[str]] = {}  # x.json -> every results/.../x.json
for _name, _path in RESULT_FILES.items():
    RESULTS_BY_NAME.setdefault(_path.name, []).append(_name)
FILE_REFERENCE = re.compile(r"`((?:results/)?[\w./-]*?[\w-]+\.json|_[\w-]+)`")
DECIMAL = re.compile(r"(?<![\w.,/-])(\d{1,3}(?:,\d{3})+\.\d+|\d+\.\d+)"  # 1,234.5 or 0.76, not 1.2.3 or v2.13
                     r"(?![\w.]|-[\d.]+\s*x\b|\s*(?:x\b|%|-fold|times\b))")  # not a ratio or a share
CLAUSE_END = re.compile(r";|(?<=[.!?:])\s+(?=[A-Z*(`])")
UNITS = (1, 1000, 1e-3, 100, 1e-6, 1e-9, 2**-20, 2**-30)  # as is, s -> ms, ms -> s, share -> %, bytes -> MB, MiB, GiB


def numbers_of(value: object) -> list[float]:
    if isinstance(value, dict):
        return [number for item in value.values() for number in numbers_of(item)]
    if isinstance(value, list):
        return [number for item in value for number in numbers_of(item)]
    return [float(value)] if isinstance(value, int | float) and not isinstance(value, bool) else []


@functools.cache
def values_in(name: str) -> tuple[float, ...]:
    return tuple(numbers_of(json.loads(RESULT_FILES[name].read_text())))


def result_files_named(text: str) -> list[str]:
    """The committed result files ``text`` names, in order; a suffix (`_hop.json`, `_ab10_1`) after
    `results/cpu/12_gateway_x.json` is the file of the same stage and folder: `results/cpu/12_gateway_hop.json`."""
    found: list[str] = []
    for reference in FILE_REFERENCE.findall(text):
        name = reference.rsplit("/", 1)[-1]
        if reference.startswith("_") and found:
            folder, before = found[-1].rsplit("/", 1)
            stage = next((stage for stage in STAGES if before.startswith(stage)), "")
            name = f"{folder}/{stage}{reference.removesuffix('.json')}.json"
            found += [name] if stage and name in RESULT_FILES else []
        elif reference in RESULT_FILES:
            found.append(reference)
        elif not reference.startswith("results/"):
            found += RESULTS_BY_NAME.get(name, [])
    return found


def shown(number: str, values: tuple[float, ...]) -> bool:
    """Whether ``number`` (as printed, "1,234.5") is one of ``values`` at its rounding, in one of the UNITS."""
    x, decimals = float(number.replace(",", "")), len(number.split(".")[1])
    tolerance = 0.5 * 10**-decimals + 1e-9
    return any(abs(value * unit - x) <= tolerance for value in values for unit in UNITS)


def quoted_numbers() -> list[tuple[str, str, list[str], str]]:
    """(where, number, the files its paragraph names, its clause) for each decimal quoted beside a result file."""
    quoted = []
    for where, text in texts():
        for paragraph in re.split(r"\n\s*\n", text):
            flat = " ".join(paragraph.split())
            files = result_files_named(flat)
            for clause in CLAUSE_END.split(flat) if files else []:
                if result_files_named(clause):
                    quoted += [(where, number, files, clause)
                               for number in DECIMAL.findall(FILE_REFERENCE.sub("", clause))]
    return quoted


def test_the_numbers_quoted_beside_a_result_file_are_in_the_files_it_names():
    """"604 ms (`results/cpu/x.json`)" must be a value of x.json: a number from an older run, a figure worked out
    by hand, or one from a file the paragraph does not name, sends a learner to a file that does not say it."""
    quoted = quoted_numbers()
    assert len(quoted) > 50, "the check finds the prose's numbers"
    missing = [f"{where}: {number} is in none of {files}: {clause[:160]}" for where, number, files, clause in quoted
               if not shown(number, tuple(value for name in files for value in values_in(name)))]
    assert not missing, "\n".join(missing)
