"""Stage 09 measured: the step time and the time in collectives at N = 1, 2 and 3 ranks, and memory per rank.

    python -m 09_tensor_parallel.tp_bench             # writes results/cpu/09_tensor_parallel.json (a few minutes)
    python -m 09_tensor_parallel.tp_bench --quick     # fewer repeats and sizes, into results/quick/ (CI)
    python -m 09_tensor_parallel.tp_bench --stage 10  # a later stage's engine, into results/cpu/NN_name.json

Two models. SmolLM2-135M itself splits only 1 or 3 ways (9 query heads, 3 KV heads), so beside it runs a
random-weight *twin* with its hidden size, layers, MLP and vocabulary but 12 query heads of 48 dimensions
and 6 KV heads: the same work per token within a few percent, and it splits 1, 2 or 3 ways.

For each model and N, one engine with N ranks runs hand-made steps through ``runner.execute`` on rank 0
(what the engine does each step: broadcast, every rank's forward pass, the logits gathered): decode steps
of 1 and 16 sequences with 256 tokens of context each, and a 256-token prefill. Rank 0's
``torch.distributed`` calls are wrapped to time the step's collectives (the all-reduces, the gather and
the step's broadcast): that time is communication *and* waiting for the slowest rank. Separately, N fresh
processes time all-reduces alone, the latency the README's model uses.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.bench import RESULTS, git_state, machine_info, stage_folder
from common.net import free_port
from common.weights import DEFAULT_MODEL, resolve_model

STAGE = __package__  # 09_tensor_parallel: the stage measured unless --stage names a later one
CONTEXT = 256  # tokens of context of each decoding sequence, and of the prefill
COLLECTIVES = ("all_reduce", "gather", "broadcast_object_list")
TWIN = {"num_attention_heads": 12, "num_key_value_heads": 6, "head_dim": 48}  # SmolLM2's shapes otherwise


# --- a model of the step: when tensor parallelism pays -------------------------------------------------


# An H100 SXM: HBM bandwidth, NVLink bandwidth per direction, and an all-reduce's fixed cost for small messages
# within one machine (NCCL's order of magnitude; vLLM's custom all-reduce gets closer to 5 us). Assumed, not measured.
H100 = {"hbm_bytes_per_s": 3.35e12, "link_bytes_per_s": 450e9, "all_reduce_latency_s": 10e-6}
# Two models (bfloat16): bytes of weights, layers, hidden size.
LLAMA_8B = {"weight_bytes": 16.1e9, "layers": 32, "hidden": 4096}
LLAMA_70B = {"weight_bytes": 141e9, "layers": 80, "hidden": 8192}


def predicted_decode_ms(model: dict[str, float], gpu: dict[str, float], ranks: int, batch: int) -> float:
    """A decode step's time on ``ranks`` GPUs, from two terms. Each rank reads its 1/N of the weights once
    (a small-batch decode step is bound by memory bandwidth, not arithmetic); and 2 all-reduces per layer of
    [batch, hidden] bfloat16, each its fixed latency plus 2 (N - 1) / N of its bytes over the link (a ring)."""
    weights = model["weight_bytes"] / ranks / gpu["hbm_bytes_per_s"]
    if ranks == 1:
        return 1000 * weights
    message = batch * model["hidden"] * 2  # bytes of one all-reduce
    per_all_reduce = gpu["all_reduce_latency_s"] + 2 * (ranks - 1) / ranks * message / gpu["link_bytes_per_s"]
    return 1000 * (weights + 2 * model["layers"] * per_all_reduce)


def build_twin(model_dir: Path, out: Path) -> Path:
    """A random-weight copy of the model with 12 query heads and 6 KV heads, and the model's tokenizer."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    for key, value in TWIN.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for path in model_dir.glob("tokenizer*"):
        (out / path.name).write_bytes(path.read_bytes())
    return out


class CollectiveClock:
    """Wraps rank 0's ``torch.distributed`` collectives: how many ran, and how long rank 0 spent in them."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.seconds, self.count = dist, 0.0, 0
        self.originals = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, original in self.originals.items():
            setattr(dist, name, self.timed(original))

    def timed(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.count += 1
        return run

    def reset(self) -> None:
        self.seconds, self.count = 0.0, 0

    def restore(self) -> None:
        for name, original in self.originals.items():
            setattr(self.dist, name, original)


def decode_step(step_input: type, batch: int, block_size: int) -> Any:
    """``batch`` sequences of CONTEXT tokens each, every one decoding its next token, in blocks of its own."""
    blocks_each = -(-CONTEXT // block_size)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(batch)]
    position = CONTEXT - 1
    slots = [table[position // block_size] * block_size + position % block_size for table in tables]
    return step_input([17] * batch, [position] * batch, slots, list(range(batch + 1)), [CONTEXT] * batch, tables,
                      list(range(batch)), [], [0] * batch)


def prefill_step(step_input: type, block_size: int) -> Any:
    table = list(range(-(-CONTEXT // block_size)))
    slots = [table[i // block_size] * block_size + i % block_size for i in range(CONTEXT)]
    return step_input([(7 * i) % 1000 for i in range(CONTEXT)], list(range(CONTEXT)), slots, [0, CONTEXT], [CONTEXT],
                      [table], [CONTEXT - 1], [], [0])


def measure_engine(folder: str, model: Path, size: int, repeats: int, batches: list[int]) -> dict[str, Any]:
    """Stage ``folder``'s engine at ``size`` ranks: memory per rank and, per kind of step, its median time and rank
    0's time in collectives."""
    import torch

    EngineConfig = importlib.import_module(f"{folder}.config").EngineConfig  # noqa: N806 (classes)
    Engine = importlib.import_module(f"{folder}.engine").Engine  # noqa: N806
    StepInput = importlib.import_module(f"{folder}.model_runner").StepInput  # noqa: N806

    engine = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32", kv_cache_mb=512,
                                 max_num_seqs=max(batches), tensor_parallel_size=size, speculative="off"))
    clock = CollectiveClock() if size > 1 else None
    try:
        steps = {f"decode {b}": decode_step(StepInput, b, engine.config.block_size) for b in batches}
        steps[f"prefill {CONTEXT}"] = prefill_step(StepInput, engine.config.block_size)
        result: dict[str, Any] = {
            "weights_mib": engine.model.num_weight_bytes / 2**20,
            "kv_bytes_per_token": engine.kv_cache.shape.bytes_per_token,
            "kv_heads_per_rank": engine.kv_cache.shape.num_kv_heads,
            "threads_per_rank": torch.get_num_threads(),
            "steps": {},
        }
        for name, step in steps.items():
            times, in_collectives, counts = [], [], []
            for i in range(repeats + 2):  # two warm-up runs
                if clock:
                    clock.reset()
                start = time.perf_counter()
                engine.ranks.send(step)  # every other rank runs the same step
                engine.runner.execute(step)
                if i >= 2:
                    times.append(time.perf_counter() - start)
                    in_collectives.append(clock.seconds if clock else 0.0)
                    counts.append(clock.count if clock else 0)
            result["steps"][name] = {"ms": 1000 * statistics.median(times),
                                     "collectives_ms": 1000 * statistics.median(in_collectives),
                                     "collectives": counts[0]}
            print(f"  N={size} {name:>12}: {result['steps'][name]['ms']:7.1f} ms, of which "
                  f"{result['steps'][name]['collectives_ms']:6.1f} ms in {counts[0]} collectives on rank 0", flush=True)
        return result
    finally:
        if clock:
            clock.restore()
        engine.shutdown()


def _all_reduce_rank(rank: int, size: int, port: int, hidden: int, tokens: list[int], out: str) -> None:
    """One of ``size`` fresh processes: the median time of an all-reduce of [T, hidden] float32, for each T."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    medians = {}
    for count in tokens:
        x = torch.randn(count, hidden)
        for _ in range(20):
            dist.all_reduce(x)
        times = []
        for _ in range(200):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        medians[str(count)] = 1e6 * statistics.median(times)
    if rank == 0:
        Path(out).write_text(json.dumps(medians))
    dist.destroy_process_group()


def all_reduce_latency(size: int, hidden: int, tokens: list[int]) -> dict[str, float]:
    """Microseconds per all-reduce among ``size`` processes on this machine, by number of rows."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "latency.json")
        mp.spawn(_all_reduce_rank, args=(size, free_port(), hidden, tokens, out), nprocs=size)
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {STAGE}.tp_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--stage", help=f"the stage to measure, 09 or later (default: {STAGE[:2]}, this one)")
    parser.add_argument("--quick", action="store_true", help="2 repeats, batch 1 only, into results/quick/")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, help="folder for the JSON (default results/cpu/)")
    args = parser.parse_args(argv)
    folder = stage_folder(args.stage) if args.stage else STAGE
    repeats, batches = (2, [1]) if args.quick else (args.repeats, [1, 16])
    model_dir = resolve_model(DEFAULT_MODEL)
    results: dict[str, Any] = {"machine": machine_info("cpu"), **git_state(), "context": CONTEXT, "models": {},
                               "all_reduce_us": {}}
    with tempfile.TemporaryDirectory() as tmp:
        twin = build_twin(model_dir, Path(tmp) / "twin")
        for label, model, sizes in (("SmolLM2-135M", model_dir, [1, 3]),
                                    ("twin: 12 query heads, 6 KV heads", twin, [1, 2, 3])):
            print(f"{label}:", flush=True)
            results["models"][label] = {str(n): measure_engine(folder, model, n, repeats, batches) for n in sizes}
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    for size in (2, 3):
        results["all_reduce_us"][str(size)] = all_reduce_latency(size, hidden, [1, 16, CONTEXT])
        print(f"all-reduce among {size} processes, us by rows: {results['all_reduce_us'][str(size)]}", flush=True)
    out_dir = args.out or (RESULTS / "quick" / "cpu" if args.quick else RESULTS / "cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{folder}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"Wrote {path}")


if __name__ == "__main__":
    main()
