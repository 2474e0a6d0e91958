"""Stage 11 measured: the weights' bytes, one step's linear layers by rows, decoding against stage 10, and what
quantizing costs in the model's answers.

    python -m 11_quantization.quant_bench            # results/cpu/11_quantization_offline.json
    python -m 11_quantization.quant_bench --quick    # fewer rows and tokens, one round, into results/quick/ (CI)
    python -m 11_quantization.quant_bench --stage 12 # a later stage's engine in this stage's place

Three parts, one process, float32 activations on a CPU:

1. **Linears**: every matrix product of one step (each decoder layer's four, and the output projection) on the
   real weights in each mode, timed at 1 to 256 rows: where the quantized kernels win (few rows: reading fewer
   bytes) and where they stop winning (many rows: the arithmetic counts).
2. **Decoding**: the same greedy, fixed-length batch through stage 10's engine and this stage's in each mode,
   taking turns within each round (the machine's drift falls on all alike), speculation off so that a step's rows
   are its sequences: tokens per second at 1 and 16 sequences.
3. **Quality**: Hugging Face's float32 model against the same model on each mode's dequantized weights, both
   teacher-forced along the float model's greedy answer to the standard prompts: how often the two agree on the
   next token, and the mean KL divergence of the quantized distribution from the float one over those steps. (This
   is the weights' cost; the engine adds bfloat16 rounding of each layer's input and output, which a bfloat16
   model pays too.)
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from datetime import UTC, datetime
from typing import Any

import torch

from common.bench import RESULTS, git_state, machine_info, stage_folder
from common.weights import DEFAULT_MODEL, resolve_model

STAGE = __package__  # 11_quantization: the stage measured unless --stage names a later one
BEFORE = "10_overlap_scheduling"
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):", "1. Apples\n2.", "The three laws of thermodynamics"]
# The standard prompts of the tests (tests/prompts.py): the quality part's answers start from them.
TEXT_PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):", "1. Apples\n2.", "日本の首都は"]
CHAT_PROMPTS = ["Translate to Chinese: I love my cat.", "What is the capital of France?"]


def make_engine(folder: str, model: str, **config: Any):
    """A stage's engine on a CPU, float32, speculation off, with its defaults but ``config``."""
    engine_config = importlib.import_module(f"{folder}.config").EngineConfig
    return importlib.import_module(f"{folder}.engine").Engine(engine_config(
        model=model, device="cpu", dtype="float32", speculative="off", **config))


def time_linears(model: torch.nn.Module, folder: str, rows: int, repeats: int = 3) -> float:
    """Milliseconds for every matrix product of one step of ``rows`` rows, the best of ``repeats``."""
    linear = importlib.import_module(f"{folder}.matmul").linear
    layers = [m for m in model.modules() if hasattr(m, "shards") and type(m).__name__.endswith("ParallelLinear")]
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    inputs = {width: torch.randn(rows, width) for width in {layer.weight.shape[1] for layer in layers}}

    def step() -> None:
        for layer in layers:
            layer(inputs[layer.weight.shape[1]])
        linear(torch.randn(rows, model.config.hidden_size), head)

    step()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - started)
    return round(1000 * best, 2)


def decode(engine, folder: str, num_seqs: int, max_tokens: int, tag: str) -> float:
    """Tokens per second of ``num_seqs`` greedy requests of ``max_tokens`` each, added at once, stepped to the end."""
    params = importlib.import_module(f"{folder}.sampler").SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                         ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"{tag}-{i}", engine.encode(f"{i}: {PROMPTS[i % len(PROMPTS)]}"), params)
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return round(num_seqs * max_tokens / (time.perf_counter() - started), 2)


def quality(model_dir: str, weights: dict[str, dict[str, torch.Tensor]], prompts: list[list[int]],
            max_tokens: int) -> dict:
    """Per mode: top-1 agreement and mean KL(float || quantized) along the float model's greedy answers."""
    from transformers import AutoModelForCausalLM

    def load() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()

    reference = load()
    with torch.inference_mode():
        answers = [reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=max_tokens, do_sample=False)[0] for ids in prompts]
        floats = [reference(answer[None]).logits[0, len(ids) - 1:-1].log_softmax(-1)
                  for ids, answer in zip(prompts, answers, strict=True)]  # [steps, V] each
    found = {}
    for mode, dequantized in weights.items():
        quantized = load()
        quantized.load_state_dict(dequantized, strict=False)
        with torch.inference_mode():
            theirs = [quantized(answer[None]).logits[0, len(ids) - 1:-1].log_softmax(-1)
                      for ids, answer in zip(prompts, answers, strict=True)]
        p, q = torch.cat(floats), torch.cat(theirs)  # [steps, V] log-probabilities: float, quantized
        agreement = float((p.argmax(-1) == q.argmax(-1)).float().mean())
        kl = float((p.exp() * (p - q)).sum(-1).mean())  # KL(float || quantized), per step, averaged
        found[mode] = {"steps": p.shape[0], "top1_agreement": round(agreement, 4), "mean_kl_nats": float(f"{kl:.3g}")}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {STAGE}.quant_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--stage", help=f"the stage to measure, 11 or later (default: {STAGE[:2]}, this one)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--quick", action="store_true", help="rows 1 and 16, 8 tokens, one round, into results/quick/")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    folder = stage_folder(args.stage) if args.stage else STAGE
    rows, max_tokens, rounds = ((1, 16), 8, 1) if args.quick else (ROWS, args.max_tokens, args.rounds)
    model = str(resolve_model(args.model))
    machine = machine_info("cpu")  # before the engines load: the load average is the machine's, not ours
    engines = {"stage 10": (BEFORE, make_engine(BEFORE, model))}
    modes = importlib.import_module(f"{folder}.quantize").MODES  # none, int8, int4
    engines |= {f"stage {folder[:2]}, {mode}": (folder, make_engine(folder, model, quantization=mode))
                for mode in modes}
    memory = {name: {"weight_bytes": engine.model.num_weight_bytes, "kv_cache_bytes": engine.kv_cache.num_bytes}
              for name, (_, engine) in engines.items()}
    linears = {name: {n: time_linears(engine.model, stage, n) for n in rows}
               for name, (stage, engine) in engines.items() if stage == folder}
    print(f"linears (ms per step): {linears}")
    runs = []
    for round_ in range(rounds):
        for num_seqs in args.seqs:
            for name, (stage, engine) in engines.items():
                tokens_per_s = decode(engine, stage, num_seqs, max_tokens, f"r{round_}-{num_seqs}")
                runs.append({"engine": name, "round": round_, "seqs": num_seqs, "tokens_per_s": tokens_per_s})
                print(f"round {round_} {name}: {runs[-1]}")
    median = {f"{name}, {n} seqs": round(statistics.median(r["tokens_per_s"] for r in runs
                                                           if r["engine"] == name and r["seqs"] == n), 2)
              for n in args.seqs for name in engines}
    weights = {mode: engine.model.dequantized_weights() for name, (stage, engine) in engines.items()
               if stage == folder and (mode := name.rsplit(", ", 1)[1]) != "none"}
    first = engines["stage 10"][1]
    prompts = [first.encode(p) for p in TEXT_PROMPTS] + [first.encode_chat([{"role": "user", "content": p}])
                                                          for p in CHAT_PROMPTS]
    for _, engine in engines.values():
        engine.shutdown()
    found = quality(model, weights, prompts, max_tokens)
    print(f"quality against float32: {found}")
    out = RESULTS / ("quick" if args.quick else "") / "cpu" / f"{folder}_offline.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "name": out.stem, "stage": folder, "before": BEFORE, "model": args.model, "device": "cpu", "dtype": "float32",
        "workload": {"rows": list(rows), "seqs": args.seqs, "max_tokens": max_tokens, "rounds": rounds,
                     "prompts": PROMPTS, "quality_prompts": TEXT_PROMPTS + CHAT_PROMPTS, "speculative": "off"},
        "machine": machine, **git_state(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": f"python -m {STAGE}.quant_bench" + (f" --stage {args.stage}" if args.stage else "")
                   + (" --quick" if args.quick else ""),
        "memory_bytes": memory, "linears_ms_per_step": linears, "median_tokens_per_s": median,
        "quality_against_float32": found, "runs": runs}, indent=1) + "\n")
    print(f"median tokens/s: {median}\nWrote {out}")


if __name__ == "__main__":
    main()
