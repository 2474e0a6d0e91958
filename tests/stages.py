"""The course's stages, in one table. Every test that runs over stages takes its list from here, and every
test that treats stages differently asks what a stage can do (``has``, ``stages_having``), never where its
name sorts; so a new stage is one entry in TABLE: it joins each component test of the modules it has
(sampler, block manager, scheduler, attention, model, server), the tests of each capability it has, and
test_stage_diffs's check that it changes only what its lesson lists.

What each lesson changes is listed from the tree, not by hand: ``python -m tests.stages --write`` rewrites
TABLE with each stage's changed definitions as they are now (``--changed`` prints it instead, ``--why`` says
how each definition changed; a stage folder TABLE lacks gets an entry to fill in: its lesson and ``adds``).
Read the rewritten lists before committing them: every name there is a difference the lesson owns."""

from __future__ import annotations

import argparse
import ast
import filecmp
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

import pytest

REPO = Path(__file__).resolve().parent.parent

# What a stage can do, by the lesson that brings it; a stage keeps every earlier stage's capabilities.
CAPABILITIES = {
    "streaming": "02: tokens streamed as they come, by a generator per request; the OpenAI server (FastAPI)",
    "paged_kv": "03: a pool of fixed-size KV blocks (block manager, kv_cache_mb), attention that reads them",
    "batching": "04: one continuous batch: add_request / step, a scheduler, a sampler over a batch of rows",
    "prefix_cache": "05: shared, counted, evictable blocks; a cache hit at admission; n > 1 shares the prompt's",
    "chunking": "06: a token budget per step, mixing decode rows and prompt chunks (no step is prefill-only)",
    "static_buffers": "07: decode steps from static buffers in buckets, replayed as CUDA graphs",
    "speculation": "08: speculative decoding: k guesses per sequence, verified in one pass",
    "ranks": "09: tensor parallelism over several ranks (processes), steps broadcast from rank 0",
    "overlap": "10: overlap scheduling: step N + 1 launched before step N's tokens are read, placeholders resolved on "
               "the device; steps that cannot overlap run synchronously and are counted",
    "quantization": "11: weights kept and multiplied in fewer bytes: int4 in blocks (the GGUF's own), int8 per row; "
                    "--quantization, the pool given what the weights freed",
    "gateway": "12: many stage 11 servers as one endpoint on Ray Serve: routing by model, difficulty and prefix; "
               "autoscaling on queue depth",
}
IMPORTS, DOCSTRING, OTHER = "<imports>", "__doc__", "<statements>"  # the pseudo-definitions of a module


@dataclass(frozen=True)
class Stage:
    """One stage: its folder, what its lesson adds, and what that lesson may change in the previous stage's
    files (new files are free). ``changes`` maps each changed file to its top-level definitions that may
    differ: function, class and variable names, ``__doc__`` (the module docstring), ``<imports>`` and
    ``<statements>`` (any other top-level code). README.md, EXERCISES.md, __init__.py and __main__.py
    (the package's identity) always change and are not listed."""

    folder: str
    adds: frozenset[str] = frozenset()  # capabilities; ``capabilities`` holds these and every earlier stage's
    lesson: str = ""
    changes: Mapping[str, frozenset[str]] = field(default_factory=dict, hash=False)
    capabilities: frozenset[str] = frozenset()  # filled in by course()

    def __post_init__(self) -> None:
        object.__setattr__(self, "adds", frozenset(self.adds))
        object.__setattr__(self, "changes",
                           MappingProxyType({name: frozenset(defs) for name, defs in self.changes.items()}))

    @property
    def may_change(self) -> frozenset[str]:
        """The definitions the lesson may change, as ``file.py:Name``."""
        return frozenset(f"{file}:{name}" for file, names in self.changes.items() for name in names)


def course(*stages: Stage) -> tuple[Stage, ...]:
    """The stages in course order, each with its capabilities: what its lesson adds and all it had before."""
    have: frozenset[str] = frozenset()
    table = []
    for entry in stages:
        unknown = entry.adds - CAPABILITIES.keys()
        assert not unknown, f"{entry.folder}: unknown capabilities {sorted(unknown)}; describe them in CAPABILITIES"
        have |= entry.adds
        table.append(replace(entry, capabilities=have))
    return tuple(table)


TABLE = course(
    Stage("01_naive",
          lesson="one request at a time, the whole answer at once; a Flask app"),
    Stage("02_streaming", adds={"streaming"},
          lesson="streaming; the complete OpenAI API",
          changes={
              "engine.py": ("__doc__", "<imports>", "Engine", "EngineStopped", "GenerationResult", "InvalidRequest",
                            "find_stop", "kv_cache_bytes"),
              "sampler.py": ("__doc__", "SamplingParams", "TokenLogprobs", "apply_penalties", "compute_logprobs",
                             "sample"),
              "server.py": ("__doc__", "<imports>", "NOT_IN_STAGE_01", "client_gone", "collect", "create_app",
                            "error_of", "refuse_unsupported", "respond", "sse_response", "usage_of"),
          }),
    Stage("03_paged_kv", adds={"paged_kv"},
          lesson="the paged KV cache",
          changes={
              "async_engine.py": ("<imports>", "AsyncEngine"),
              "config.py": ("EngineConfig",),
              "engine.py": ("__doc__", "<imports>", "Engine", "WARM_UP_TOKENS"),
              "metrics.py": ("<imports>", "Metrics"),
              "server.py": ("__doc__", "create_app"),
              "stats.py": ("__doc__", "EngineStats", "KVBlockStats"),
          }),
    Stage("04_continuous_batching", adds={"batching"},
          lesson="continuous batching: a scheduler, one batch of every running sequence",
          changes={
              "async_engine.py": ("<imports>", "AbortRequest", "AddRequest", "AsyncEngine", "InboxMessage", "Shutdown",
                                  "put_all"),
              "attention.py": ("<imports>", "AttentionMetadata", "DecodeGroup", "decode_attention_reference",
                               "decode_groups", "extend_attention_reference", "gather_kv", "length_groups",
                               "paged_attention", "write_kv"),
              "config.py": ("EngineConfig",),
              "engine.py": ("__doc__", "<imports>", "Engine", "WARM_UP_TOKENS"),
              "metrics.py": ("Metrics",),
              "sampler.py": ("__doc__", "apply_penalties", "apply_top_k", "apply_top_p", "compute_logprobs",
                             "logits_to_probs", "race_noise", "sample", "to_device"),
              "sequence.py": ("__doc__", "<imports>", "FinishReason", "Request", "RequestOutput", "Sequence",
                              "SequenceStatus", "StepKind", "StepResult"),
              "stats.py": ("__doc__", "EngineStats"),
          }),
    Stage("05_prefix_cache", adds={"prefix_cache"},
          lesson="the prefix cache: shared, counted, evictable blocks; a cache hit at admission; what users see of it",
          changes={
              "async_engine.py": ("AsyncEngine",),
              "block_manager.py": ("__doc__", "<imports>", "BlockManager"),
              "config.py": ("EngineConfig",),
              "engine.py": ("__doc__", "<imports>", "Engine", "make_index", "sample_seed"),
              "metrics.py": ("Metrics",),
              "output_processor.py": ("OutputProcessor",),
              "scheduler.py": ("__doc__", "Batch", "Scheduler"),
              "sequence.py": ("Request", "RequestOutput", "Sequence"),
              "server.py": ("__doc__", "<imports>", "by_choice", "create_app", "sse_response", "usage_of"),
              "stats.py": ("EngineStats", "KVBlockStats", "PrefixCacheStats"),
          }),
    Stage("06_chunked_prefill", adds={"chunking"},
          lesson="chunked prefill: a token budget per step, decodes first; one pass for decode rows and prompt chunks",
          changes={
              "attention.py": ("extend_attention_reference",),
              "config.py": ("CPU_TOKEN_BUDGET", "CUDA_TOKEN_BUDGET", "EngineConfig"),
              "engine.py": ("__doc__", "<imports>", "Engine", "token_budget"),
              "executor.py": ("__doc__", "<imports>", "Executor", "InFlight", "score_prompt"),
              "model_runner.py": ("__doc__", "ModelRunner"),
              "scheduler.py": ("__doc__", "Batch", "Scheduler"),
              "sequence.py": ("Sequence",),
          }),
    Stage("07_cuda_graphs", adds={"static_buffers"},
          lesson="CUDA graphs: decode steps from static buffers in buckets, captured on CUDA; padding rows that do "
                 "nothing; fused kernels for the small operators between the products",
          changes={
              "attention.py": ("__doc__", "decode_attention_reference", "length_groups", "paged_attention"),
              "config.py": ("EngineConfig",),
              "model.py": ("__doc__", "<imports>", "Attention", "DecoderLayer", "LlamaModel", "MLP", "RMSNorm",
                           "apply_rotary"),
              "model_runner.py": ("__doc__", "<imports>", "ModelRunner", "StaticBuffers", "bucket_for", "carve",
                                  "graph_batch_sizes", "input_layout", "log", "pad_block_tables", "run_dummy_step",
                                  "start_runner"),
              "triton_attention.py": ("__doc__", "_extend_kernel", "_merge_splits_kernel", "extend_attention",
                                      "query_rows_bucket"),
          }),
    Stage("08_speculative", adds={"speculation"},
          lesson="speculative decoding: room for guesses, k + 1 rows a sequence, verification, rejected blocks back, "
                 "counters",
          changes={
              "async_engine.py": ("AsyncEngine",),
              "block_manager.py": ("BlockManager",),
              "config.py": ("EngineConfig",),
              "engine.py": ("__doc__", "<imports>", "Engine"),
              "executor.py": ("__doc__", "<imports>", "Executor", "InFlight"),
              "metrics.py": ("Metrics",),
              "model_runner.py": ("__doc__", "<imports>", "Bucket", "COST_CONTEXT", "COST_GUESSING_SEQS",
                                  "COST_REPEATS", "COST_ROWS", "COST_ROWS_EACH", "ModelRunner", "StaticBuffers",
                                  "captures_graphs", "cost_rows", "dummy_step", "sequence_slots", "start_runner",
                                  "verification_sizes"),
              "output_processor.py": ("__doc__", "OutputProcessor"),
              "sampler.py": ("__doc__", "sample"),
              "scheduler.py": ("__doc__", "<imports>", "Sampled", "Scheduler"),
              "sequence.py": ("<imports>", "RequestOutput", "Sequence", "StepResult"),
              "server.py": ("__doc__", "create_app"),
              "stats.py": ("EngineStats", "SpeculationStats"),
          }),
    Stage("09_tensor_parallel", adds={"ranks"},
          lesson="tensor parallelism: parallel layers loading their slices, ranks started and stopped, steps broadcast",
          changes={
              "async_engine.py": ("AsyncEngine", "RANK_CHECK_S"),
              "config.py": ("EngineConfig",),
              "engine.py": ("__doc__", "<imports>", "Engine", "check_tensor_parallel"),
              "executor.py": ("__doc__", "<imports>", "Executor", "InFlight"),
              "model.py": ("__doc__", "<imports>", "Attention", "DecoderLayer", "LlamaForCausalLM", "LlamaModel", "MLP",
                           "ModelConfig", "load_safetensors"),
              "model_runner.py": ("__doc__", "<imports>", "ModelRunner", "start_runner"),
          }),
    Stage("10_overlap_scheduling", adds={"overlap"},
          lesson="overlap scheduling: the engine core in its own process, one message a turn; launch step N + 1, then "
                 "process step N; placeholders resolved on the device",
          changes={
              "async_engine.py": ("__doc__", "<imports>", "AbortRequest", "AddRequest", "AsyncEngine", "Core",
                                  "CoreFailedToStart", "InboxMessage", "RANK_CHECK_S", "STOP_S", "Shutdown", "deliver",
                                  "detokenize", "run_core"),
              "config.py": ("EngineConfig",),
              "engine.py": ("__doc__", "<imports>", "Engine", "EngineStopped", "HOST_WEIGHT", "InvalidRequest",
                            "SyncReason"),
              "executor.py": ("__doc__", "<imports>", "CLOSE_S", "DeviceOutput", "DeviceQueue", "DeviceWork",
                              "Executor", "InFlight", "PromptScoring", "run", "sampled_runs", "score_prompt", "to_host",
                              "uses_device_thread"),
              "metrics.py": ("Metrics",),
              "model_runner.py": ("ModelRunner", "resolve_placeholders"),
              "output_processor.py": ("__doc__", "OutputProcessor"),
              "policy.py": ("SpeculationCost", "plan_guesses"),
              "sampler.py": ("compute_logprobs", "logprob_tensors", "unpack_logprobs"),
              "scheduler.py": ("__doc__", "Scheduler"),
              "sequence.py": ("__doc__", "Request", "Sequence", "StepResult", "placeholder"),
              "server.py": ("__doc__", "<imports>"),
              "speculative.py": ("next_tokens",),
              "stats.py": ("__doc__", "EngineStats", "OverlapStats"),
          }),
    Stage("11_quantization", adds={"quantization"},
          lesson="quantized weights: the linear layers in int4 blocks (the file's own) or int8 per row, multiplied by "
                 "torch's quantized kernels; the pool given the bytes they freed",
          changes={
              "config.py": ("EngineConfig",),
              "core.py": ("describe",),
              "engine.py": ("<imports>", "Engine"),
              "kv_cache.py": ("budget_bytes",),
              "matmul.py": ("<imports>", "linear"),
              "model.py": ("__doc__", "<imports>", "LlamaForCausalLM"),
              "model_runner.py": ("start_runner",),
              "parallel.py": ("<imports>", "VocabParallelEmbedding"),
              "stats.py": ("EngineStats", "MemoryStats"),
              "worker.py": ("<imports>", "run_worker"),
          }),
    Stage("12_gateway", adds={"gateway"},
          lesson="the gateway: stage 11's engine unchanged on Ray Serve replicas; routing by model, difficulty and "
                 "prefix; autoscaling on queue depth",
          changes={
          }),
)
BY_FOLDER = {entry.folder: entry for entry in TABLE}
STAGES = [entry.folder for entry in TABLE]
# Always-changing files (see Stage): identity and prose, not code a lesson carries forward.
ALWAYS = frozenset({"README.md", "EXERCISES.md", "__init__.py", "__main__.py"})
# The benchmark harnesses: tooling, not lesson. A later stage may leave one behind (the gateway's stage, whose engine is
# stage 10's byte for byte, carries none: stage 10's measure that engine); one it keeps stays byte-identical.
TOOLING = frozenset({"step_bench.py", "compile_bench.py", "spec_bench.py", "tp_bench.py", "overlap_bench.py",
                     "quant_bench.py"})


def check_capability(capability: str) -> None:
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown capability {capability!r}: one of {sorted(CAPABILITIES)}")


def has(folder: str, capability: str) -> bool:
    """Whether stage ``folder`` can do ``capability`` (one of CAPABILITIES)."""
    check_capability(capability)
    if folder not in BY_FOLDER:
        raise KeyError(f"{folder} is not in TABLE (tests/stages.py): `python -m tests.stages --write` adds it")
    return capability in BY_FOLDER[folder].capabilities


def stages_having(capability: str) -> list[str]:
    """The stages that can do ``capability``, in course order."""
    return [folder for folder in STAGES if has(folder, capability)]


# The OpenAI server with streaming (stage 01 is a Flask app), served by one process. Stage 12 serves stage 11's app,
# unchanged, on each replica behind its gateway: test_12_gateway holds the gateway to stage 11's answers.
FASTAPI_STAGES = [folder for folder in stages_having("streaming") if not has(folder, "gateway")]


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


# --- what a stage changes ------------------------------------------------------------------------------


def files(folder: str) -> set[str]:
    """The stage's own sources and prose (.py and .md files)."""
    return {p.name for p in (REPO / folder).iterdir() if p.is_file() and p.suffix in (".py", ".md")}


def changed_files(previous: str, current: str) -> set[str]:
    """The files both stages have whose bytes differ."""
    return {name for name in files(previous) & files(current)
            if not filecmp.cmp(REPO / previous / name, REPO / current / name, shallow=False)}


def assigned_names(target: ast.expr) -> list[str] | None:
    """The names an assignment's target binds (``a``, ``a, (b, *c)``); None for an attribute or subscript."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Starred):
        return assigned_names(target.value)
    if isinstance(target, ast.Tuple | ast.List):
        names = [assigned_names(element) for element in target.elts]
        return None if None in names else [name for group in names for name in group]
    return None


def top_level_names(node: ast.stmt) -> list[str]:
    """The definitions one top-level statement makes: a function's or class's name, each variable it
    assigns, ``<imports>`` for imports (also under ``if TYPE_CHECKING:``), else ``<statements>``."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [IMPORTS]
    if isinstance(node, ast.If) and all(isinstance(n, ast.Import | ast.ImportFrom) for n in node.body + node.orelse):
        return [IMPORTS]
    if isinstance(node, ast.Assign):
        names = [assigned_names(target) for target in node.targets]
        return [OTHER] if None in names else [name for group in names for name in group]
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return assigned_names(node.target) or [OTHER]
    return [OTHER]


def definitions(source: str) -> dict[str, list[ast.AST]]:
    """A module's top-level definitions by name (see top_level_names), each with the statements that make it.
    ``__doc__`` is the module docstring's node."""
    tree = ast.parse(source)
    found: dict[str, list[ast.AST]] = {}
    body = tree.body
    if ast.get_docstring(tree, clean=False) is not None:
        found[DOCSTRING], body = [body[0]], body[1:]
    for node in body:
        for name in top_level_names(node):
            found.setdefault(name, []).append(node)
    return found


def dumps(nodes: Iterable[ast.AST]) -> list[str]:
    """Nodes as ast.dump gives them: every name, value and docstring, no line numbers, no comments."""
    return [ast.dump(node) for node in nodes]


def class_detail(before: ast.ClassDef, after: ast.ClassDef) -> str:
    """Which parts of a class differ: its docstring, its header (bases, decorators), its members by name."""
    parts = []
    if ast.get_docstring(before, clean=False) != ast.get_docstring(after, clean=False):
        parts.append("docstring")
    if dumps([*before.bases, *before.keywords, *before.decorator_list]) != \
            dumps([*after.bases, *after.keywords, *after.decorator_list]):
        parts.append("header")
    members = [{}, {}]
    for side, cls in zip(members, (before, after), strict=True):
        body = cls.body[1:] if ast.get_docstring(cls, clean=False) is not None else cls.body
        for node in body:
            for name in top_level_names(node):
                side.setdefault(name, []).append(ast.dump(node))
    parts += [name for name in sorted(members[0].keys() | members[1].keys()) if members[0].get(name) !=
              members[1].get(name)]
    return ", ".join(parts)


def changed_definitions(previous: str, current: str, file: str) -> dict[str, str]:
    """The top-level definitions of ``file`` that differ between two stages, each with how: added, removed,
    or changed (for a class: which of its parts)."""
    before, after = (definitions((REPO / folder / file).read_text()) for folder in (previous, current))
    changed = {}
    for name in sorted(before.keys() | after.keys()):
        if name not in after:
            changed[name] = "removed"
        elif name not in before:
            changed[name] = "added"
        elif dumps(before[name]) != dumps(after[name]):
            old, new = before[name], after[name]
            classes = len(old) == len(new) == 1 and all(isinstance(n[0], ast.ClassDef) for n in (old, new))
            changed[name] = f"changed: {class_detail(old[0], new[0])}" if classes else "changed"
    return changed


def lesson_changes(previous: str, current: str) -> dict[str, dict[str, str]]:
    """What ``current`` changes in ``previous``'s code: each changed .py file (but the ALWAYS ones) with its
    changed definitions (an empty dict: only comments or layout differ)."""
    return {file: changed_definitions(previous, current, file)
            for file in sorted(changed_files(previous, current) - ALWAYS) if file.endswith(".py")}


def stage_folders() -> list[str]:
    """The stage folders on disk (``NN_name`` packages), in course order."""
    return sorted(p.parent.name for p in REPO.glob("[0-9][0-9]_*/__init__.py"))


def string_source(text: str, indent: int, width: int) -> list[str]:
    """``text`` as a Python string literal, split at spaces into adjacent literals that fit ``width``."""
    lines, line = [], ""
    for word in text.split(" "):
        if line and indent + len(line) + len(word) + 3 > width:  # the quotes and a comma
            lines.append(line)
            line = ""
        line += word + " "
    lines.append(line[:-1])
    return [f'"{part}"' for part in lines]


def entry_source(folder: str, previous: str | None, width: int = 120) -> list[str]:
    """``folder``'s entry of TABLE as Python source: its folder, capabilities and lesson as the table has
    them (a placeholder for a stage the table lacks), its changes as the tree has them."""
    known = BY_FOLDER.get(folder)
    adds = sorted(known.adds) if known else []
    lesson = known.lesson if known else "TODO: the lesson, in a line"
    out = [f'    Stage("{folder}"' + (", adds={" + ", ".join(f'"{a}"' for a in adds) + "}" if adds else "") + ","]
    pieces = string_source(lesson, len("          lesson="), width)
    out.append("          lesson=" + pieces[0])
    out += ["                 " + piece for piece in pieces[1:]]
    if previous is None:
        out[-1] += "),"
        return out
    out[-1] += ","
    out.append("          changes={")
    order = {DOCSTRING: 0, IMPORTS: 1, OTHER: 2}
    for file, changed in lesson_changes(previous, folder).items():
        head = f'              "{file}": ('
        names = [f'"{name}"' for name in sorted(changed, key=lambda n: (order.get(n, 3), n))]
        line, lines = head, []
        for i, name in enumerate(names):
            last = i == len(names) - 1
            piece = name + (("," if len(names) == 1 else "") + ")," if last else ", ")
            if line != head and len(line) + len(piece.rstrip()) > width:
                lines.append(line.rstrip())
                line = " " * len(head)
            line += piece
        lines.append(line if names else head + "),")
        out += lines
    out.append("          }),")
    return out


def table_source(width: int = 120) -> str:
    """TABLE as Python source, from the stage folders on disk and what each changes in the one before."""
    lines = ["TABLE = course("]
    folders = stage_folders()
    for previous, folder in zip([None, *folders], folders, strict=False):
        lines += entry_source(folder, previous, width)
    return "\n".join([*lines, ")"])


def write_table() -> None:
    """Rewrite TABLE in this file from the tree (the lessons and capabilities as they are)."""
    path = Path(__file__)
    source = path.read_text()
    start = source.index("\nTABLE = course(\n") + 1
    end = source.index("\n)\n", start) + 2
    path.write_text(source[:start] + table_source() + source[end:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.stages", description=__doc__.splitlines()[0])
    parser.add_argument("--changed", action="store_true",
                        help="print TABLE with each stage's changes as the tree has them (the definitions that "
                             "differ from the previous stage's), to paste over TABLE in tests/stages.py")
    parser.add_argument("--write", action="store_true", help="rewrite TABLE in tests/stages.py so (see --changed)")
    parser.add_argument("--why", action="store_true", help="say how each changed definition changed")
    args = parser.parse_args(argv)
    if args.write:
        write_table()
    elif args.changed:
        print(table_source())
    elif args.why:
        for previous, current in itertools.pairwise(stage_folders()):
            print(f"# {current} (against {previous})")
            for file, changed in lesson_changes(previous, current).items():
                for name, how in changed.items():
                    print(f"{file}:{name}  {how}")
                if not changed:
                    print(f"{file}  comments or layout only")
    else:
        for entry in TABLE:
            print(f"{entry.folder:24} {', '.join(sorted(entry.capabilities)) or '-'}")


if __name__ == "__main__":
    main()
