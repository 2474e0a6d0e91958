"""The CPU's counterpart of a CUDA graph, tried: stage 07's decode step under ``torch.compile`` (inductor's
C++ backend) against the same step eager, at a few bucket sizes.

    python -m 07_cuda_graphs.compile_bench          # -> results/cpu/07_cuda_graphs_compile.json

(``--stage NN`` compiles a later stage's step instead, into ``results/cpu/NN_name_compile.json``.)

Each way compiles the step once per bucket (``dynamic=False``: one graph per shape, as with CUDA graphs):

- ``plain``: the forward pass as it is. The reference attention reads the sequences' lengths on the CPU
  (``.tolist()``, to group rows of similar length), so dynamo breaks the graph there: every layer's
  attention splits the step into separately compiled pieces.
- ``opaque_attention``: the reference ``write_kv`` and decode attention registered as custom operators
  (``torch.library.custom_op``), which dynamo calls without looking inside: one graph per step, the
  attention an external call in it (vLLM compiles around its attention the same way).
- ``freezing``: the same, with inductor's freezing: the weights become constants, prepacked for oneDNN.

For each: the step's median time against eager (logits included, as in ``step_bench``), the
first call's time (tracing and compiling: what start-up would pay per bucket), and how far the hidden
states move from eager's (fusing the small operators changes the order of some float32 sums).
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

import torch

from common.bench import RESULTS, dumps, git_state, machine_info, stage_folder
from common.weights import DEFAULT_MODEL

from .step_bench import bucket_of, decode_step, stage_parts, time_ms

FOLDER = __package__  # 07_cuda_graphs: the stage compiled unless --stage names a later one
MODES = ["plain", "opaque_attention", "freezing"]


def make_attention_opaque(attention: ModuleType) -> None:
    """Register the stage's reference K/V write and decode attention (from its ``attention`` module) as custom
    operators, and put them where ``paged_attention`` looks them up: dynamo then treats each as one call with a
    known output shape."""
    write_kv, decode = attention.write_kv, attention.decode_attention_reference

    @torch.library.custom_op("course::decode_attention", mutates_args=())
    def decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        return decode(q, k_cache, v_cache, block_tables, seq_lens, scale)

    @decode_op.register_fake
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale):  # the output's shape, for tracing
        return torch.empty_like(q)

    @torch.library.custom_op("course::write_kv", mutates_args=("k_cache", "v_cache"))
    def write_op(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    @write_op.register_fake
    def _(k, v, k_cache, v_cache, slot_mapping):
        return None

    attention.write_kv, attention.decode_attention_reference = write_op, decode_op


def measure(engine: Any, step_input: type, mode: str, batch_sizes: list[int], context: int,
            repeats: int) -> list[dict[str, Any]]:
    """Compile the static decode step one way, and time it against eager at each batch size."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()  # nothing compiled by an earlier mode is reused
    inductor_config.freezing = mode == "freezing"
    runner, device = engine.runner, engine.device
    compiled = torch.compile(runner.forward_static, dynamic=False)
    rows = []
    for batch_size in batch_sizes:
        step = decode_step(step_input, batch_size, context, engine.kv_cache.shape.block_size)
        size = bucket_of(batch_size, runner.sizes)
        eager_ms = time_ms(lambda: runner.execute(step), device, repeats)  # noqa: B023 (called now)
        runner.buffers.load(step, size)
        start = time.perf_counter()
        compiled(size)
        first_call_s = time.perf_counter() - start
        hidden = runner.buffers.hidden[:batch_size].clone()
        runner.forward_static(size)
        difference = (hidden - runner.buffers.hidden[:batch_size]).abs().max().item()

        def run_compiled() -> torch.Tensor:
            runner.buffers.load(step, size)  # noqa: B023 (called now)
            compiled(size)  # noqa: B023
            return engine.model.compute_logits(runner.buffers.hidden[:batch_size])  # noqa: B023

        compiled_ms = time_ms(run_compiled, device, repeats)
        rows.append({"mode": mode, "batch_size": batch_size, "bucket": size, "eager_ms": eager_ms,
                     "compiled_ms": compiled_ms, "speedup": eager_ms / compiled_ms, "first_call_s": first_call_s,
                     "max_abs_difference": difference,
                     "max_abs_hidden": runner.buffers.hidden[:batch_size].abs().max().item()})
        print(f"{mode:16s} batch {batch_size:3d}: eager {eager_ms:7.1f} ms, compiled {compiled_ms:7.1f} ms "
              f"({eager_ms / compiled_ms:.2f}x); first call {first_call_s:.1f} s; hidden states differ by up to "
              f"{difference:.1e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {FOLDER}.compile_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", help=f"the stage to compile, 07 or later (default: {FOLDER[:2]}, this one)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    args = parser.parse_args(argv)
    folder = stage_folder(args.stage) if args.stage else FOLDER
    Engine, EngineConfig, StepInput = stage_parts(folder)  # noqa: N806 (classes)
    engine = Engine(EngineConfig(model=args.model, device="cpu", dtype="float32", max_num_seqs=max(args.batch_sizes)))
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for mode in [mode for mode in MODES if mode in args.modes]:  # plain first: the others patch attention
            if mode == "opaque_attention" or (mode == "freezing" and "opaque_attention" not in args.modes):
                make_attention_opaque(importlib.import_module(f"{folder}.attention"))
            rows += measure(engine, StepInput, mode, args.batch_sizes, args.context, args.repeats)
    result = {"name": f"{folder}_compile", "stage": folder, "device": "cpu", "dtype": "float32",
              "context": args.context, "machine": machine_info("cpu"), "command": shlex.join(sys.orig_argv),
              **git_state(), "date": datetime.now(UTC).isoformat(timespec="seconds"), "steps": rows}
    out = RESULTS / "cpu" / f"{result['name']}.json"
    out.write_text(dumps(result) + "\n")
    print(f"Wrote {out}")


if __name__ == "__main__":
    main()
