"""nano-vllm's throughput benchmark on a stage's offline engine, or on transformers' continuous batching.

    python -m common.throughput --stage 09 --device cuda --dtype bfloat16            # the stage's Engine
    python -m common.throughput --stage 09 --device cuda --dtype bfloat16 --peer transformers
    python -m common.throughput --device cpu --num-seqs 4 --min-len 8 --max-len 16   # a smoke test on a CPU

The workload is nano-vllm's ``bench.py``: ``random.seed(0)``, then 256 prompts of 100 to 1,024 token ids drawn
uniformly from [0, 10000], then for each an output length uniform in 100 to 1,024; sampled at temperature 0.6,
EOS ignored, so every sequence produces exactly its output length. Throughput is the output tokens over the wall
time of one call that runs them all, after a warm-up request (start-up, graph capture and warm-up not counted).

* the stage: its ``Engine.generate_offline`` (every prompt added, then ``step()`` until none is left), built from
  its ``EngineConfig`` with the stage's defaults, but ``max_num_seqs`` 256 unless ``--max-num-seqs`` says
  otherwise (nano-vllm's own is 512: every sequence in one batch). ``--engine-arg field=value`` sets any other.
* ``--peer transformers``: the same prompts and lengths through transformers' continuous batching on the same
  weights and dtype, the manager ``generate_batch`` runs (``continuous_batching_context_manager``: warm-up and
  graph capture there, not timed) with one ``add_request`` per sequence, each with its own ``max_new_tokens``
  (``generate_batch`` takes one for all), EOS disabled (``eos_token_id=-1``). Its best configuration here:
  ``--attn-implementation auto`` (the default) takes the fastest attention that imports on this machine,
  flash-attention 3 (``flash_attn_interface``), then 2 (``flash_attn``), else paged SDPA, whose step builds a mask
  over the whole packed batch (a result without flash-attention is labelled "against paged SDPA"). The
  continuous-batching fields are options (``--cb-num-blocks``, ``--cb-block-size``, ``--cb-max-batch-tokens``,
  ``--cb-max-requests-per-batch``, ``--cb-cuda-graphs``, ``--cb-async-batching``), each given to transformers'
  ``ContinuousBatchingConfig`` under its name in the installed version, and only where that version has the
  field; the record holds what was asked, what the manager resolved it to, and the attention used.
  ``--time-limit S`` stops it after S seconds of measuring, counting the tokens of the finished sequences.

It writes ``throughput_<NN_name>.json`` (or ``throughput_transformers.json``) into ``--out`` (default:
``results/cuda/<gpu>/`` on a GPU, ``results/<device>/`` elsewhere) with the workload, the engine's settings, the
start-up time, the tokens, the seconds and the tokens/s, the GPU's name, the torch, triton and transformers
versions and the commit. Stopped by SIGTERM (a time limit), it first writes what it had: ``"complete": false``,
the tokens finished so far over the time so far.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import random
import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .gpu_env import REPO, environment, results_dir, version
from .weights import DEFAULT_MODEL

# nano-vllm's bench.py
NUM_SEQS, MIN_LEN, MAX_LEN, MAX_TOKEN_ID, TEMPERATURE, SEED = 256, 100, 1024, 10000, 0.6, 0
CPU_TOKEN_BUDGET, CUDA_TOKEN_BUDGET = 256, 8192  # the stages' step budget (config.py), for transformers' too
MAX_NUM_SEQS = 256  # the stage's batch: every sequence at once, as nano-vllm's max_num_seqs (512) allows
WARM_UP = ([1, 2, 3, 4, 5, 6, 7, 8], 4)  # one short request before the clock starts: prompt ids, tokens
PEERS = ("transformers",)
# The peer's environment: the model is a local folder, and nothing is fetched from the Hub (transformers 5 looks for
# a flash-attention kernel there when the flash_attn package is missing; offline it falls back to SDPA at once).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
# transformers' attention implementations for continuous batching, fastest first, with the module each needs:
# flash-attention's kernels read the paged cache through a block table (its decode fast path, graphs, async
# batching). Without them, "sdpa" is paged SDPA: a mask over the whole packed batch every step, no graphs.
FLASH_ATTENTION = (("flash_attention_3", "flash_attn_interface"), ("flash_attention_2", "flash_attn"))
PAGED_SDPA = "sdpa"
ATTENTION_CHOICES = ("auto", *(name for name, _ in FLASH_ATTENTION), PAGED_SDPA)
SDPA_LABEL = "against paged SDPA (no flash-attention here)"
# Our option -> the ContinuousBatchingConfig field it sets, by the names versions of transformers gave it (5.23:
# page_size; earlier: block_size). An option whose field this version lacks is recorded, not passed.
CB_FIELDS = {"num_blocks": ("num_blocks",), "block_size": ("page_size", "block_size"),
             "max_batch_tokens": ("max_batch_tokens",), "max_requests_per_batch": ("max_requests_per_batch",),
             "cuda_graphs": ("use_cuda_graph",), "async_batching": ("use_async_batching",),
             # the attention chosen here, not a Hub kernel it would look for (offline: none)
             "auto_switch_to_flash": ("auto_switch_to_flash",)}
PAGE = 256  # transformers' default block size (tokens): the cache is sized for the workload in these
SDPA_BATCH_TOKENS = 2048  # paged SDPA's mask costs (query tokens) x (the batch's KV tokens): fewer per step


@dataclass(frozen=True)
class Workload:
    """Each sequence's prompt ids and output length, and how they were drawn."""

    prompts: list[list[int]]
    max_tokens: list[int]
    params: dict[str, Any]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def describe(self) -> dict[str, Any]:
        return {**self.params, "prompt_tokens": sum(map(len, self.prompts)), "output_tokens": self.output_tokens}


def workload(num_seqs: int = NUM_SEQS, min_len: int = MIN_LEN, max_len: int = MAX_LEN,
             max_token_id: int = MAX_TOKEN_ID, seed: int = SEED) -> Workload:
    """nano-vllm's draws, in its order: every prompt (its length, then its ids), then every output length."""
    rng = random.Random(seed)  # the same stream as random.seed(seed) and the module's randint
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    max_tokens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return Workload(prompts, max_tokens, {"num_seqs": num_seqs, "min_len": min_len, "max_len": max_len,
                                          "max_token_id": max_token_id, "seed": seed, "temperature": TEMPERATURE,
                                          "ignore_eos": True, "source": "nano-vllm bench.py"})


@dataclass
class Progress:
    """What a run has done so far: read when it is stopped before the end."""

    started: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    finished_sequences: int = 0
    startup_s: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    def seconds(self) -> float | None:
        if self.started is None:
            return None
        return (self.finished or time.perf_counter()) - self.started


# --- the stage ---------------------------------------------------------------------------------------


def stage_folder(stage: str) -> str:
    """'9' or '09' -> '09_tensor_parallel'."""
    matches = sorted(p.parent.name for p in REPO.glob(f"{int(stage):02d}_*/__main__.py"))
    if not matches:
        raise SystemExit(f"error: no stage {stage} in {REPO}")
    return matches[0]


def latest_stage() -> str:
    """The latest stage that is one server (the gateway's stage serves a fleet of them), e.g. '09'."""
    folders = sorted(p.parent.name for p in REPO.glob("[0-9][0-9]_*/__main__.py")
                     if not (p.parent / "gateway.py").exists())
    return folders[-1][:2]


def parse_value(text: str) -> Any:
    """An --engine-arg value: JSON where it parses (numbers, true, false), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def run_stage(folder: str, model: str, device: str, dtype: str, work: Workload, progress: Progress,
              max_num_seqs: int = MAX_NUM_SEQS, **engine_args: Any) -> list[list[int]]:
    """The workload through ``folder``'s Engine, offline; ``progress`` holds the settings, the start-up time and,
    step by step, the tokens produced. Returns each sequence's output ids."""
    config_type = importlib.import_module(f"{folder}.config").EngineConfig
    engine_type = importlib.import_module(f"{folder}.engine").Engine
    sampling = importlib.import_module(f"{folder}.sampler").SamplingParams
    config = config_type(model=model, device=device, dtype=dtype, max_num_seqs=max_num_seqs, **engine_args)
    progress.settings = {"engine": f"{folder}.engine.Engine.generate_offline", **dataclasses.asdict(config)}
    start = time.perf_counter()
    engine = engine_type(config)
    try:
        step = engine.step

        def counted(*args: Any, **kwargs: Any) -> Any:  # the tokens so far, for a run stopped before the end
            result = step(*args, **kwargs)
            if progress.started is not None:
                progress.output_tokens += sum(len(output.token_ids) for output in result.outputs)
                progress.finished_sequences += sum(bool(output.finished) for output in result.outputs)
            return result

        engine.step = counted  # generate_offline calls self.step()
        warm_prompt, warm_tokens = WARM_UP
        engine.generate_offline([warm_prompt], sampling(max_tokens=warm_tokens, temperature=TEMPERATURE,
                                                        ignore_eos=True))
        progress.startup_s = time.perf_counter() - start
        params = [sampling(max_tokens=n, temperature=TEMPERATURE, ignore_eos=True) for n in work.max_tokens]
        progress.started = time.perf_counter()
        outputs = engine.generate_offline(work.prompts, params)
        progress.finished = time.perf_counter()
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
    progress.output_tokens = sum(map(len, outputs))
    progress.finished_sequences = len(outputs)
    return outputs


# --- transformers' continuous batching ---------------------------------------------------------------


def importable(module: str) -> bool:
    """The module imports here (a flash-attention wheel built for another torch fails on import, not on lookup)."""
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or an OSError/RuntimeError from a compiled extension
        return False
    return True


def resolve_attention(asked: str, device: str, can_import: Callable[[str], bool] = importable) -> str:
    """The attention implementation to load the peer with: ``asked`` unless it is "auto"; then the fastest
    flash-attention that imports (only on CUDA: its kernels are CUDA's), else paged SDPA."""
    if asked != "auto":
        return asked
    if device == "cuda":
        for name, module in FLASH_ATTENTION:
            if can_import(module):
                return name
    return PAGED_SDPA


def cb_options(attention: str, device: str, work: Workload, given: dict[str, Any]) -> dict[str, Any]:
    """The continuous-batching options (CB_FIELDS' keys) for ``attention``: the cache sized for the whole workload
    (every sequence at once, in PAGE-token blocks) and every sequence in one batch; on CUDA, paged SDPA with fewer
    query tokens a step and neither graphs nor async batching (its mask would be padded to the graphs' sizes),
    flash-attention with the stage's token budget and transformers' own choice of graphs and async batching (on,
    without a mask). On a CPU, the CPU stages' budget: left to itself the manager's warm-up takes minutes there.
    ``given`` overrides any of them (None: not given; "auto": left to transformers)."""
    block = given.get("block_size") or PAGE
    options: dict[str, Any] = {
        "num_blocks": sum(-(-(len(p) + n) // block) for p, n in zip(work.prompts, work.max_tokens, strict=True)),
        "block_size": block, "max_requests_per_batch": len(work.prompts), "auto_switch_to_flash": False,
        "max_batch_tokens": CPU_TOKEN_BUDGET if device != "cuda" else
        SDPA_BATCH_TOKENS if attention == PAGED_SDPA else CUDA_TOKEN_BUDGET,
        "cuda_graphs": False if device == "cuda" and attention == PAGED_SDPA else None,
        "async_batching": False if device == "cuda" and attention == PAGED_SDPA else None}
    return options | {key: None if value == "auto" else value for key, value in given.items() if value is not None}


def cb_fields(options: dict[str, Any], known: set[str]) -> tuple[dict[str, Any], list[str]]:
    """``options`` as fields of this transformers' ContinuousBatchingConfig (``known``: its field names), None left
    to transformers; and the options it has no field for (recorded, not passed)."""
    fields, missing = {}, []
    for option, value in options.items():
        name = next((field for field in CB_FIELDS[option] if field in known), None)
        if name is None:
            missing.append(option)
        elif value is not None:
            fields[name] = value
    return fields, missing


def plain(value: Any) -> Any:
    """A resolved config field as JSON can hold it (a compile config, a tuple of booleans: their repr)."""
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


def resolved_config(manager: Any) -> dict[str, Any] | str:
    """The configuration the manager resolved (memory, graphs, async batching...), read after its warm-up; the
    attribute is transformers 5.2x's, so where it is not there the record says so instead of failing the run."""
    config = getattr(manager, "continuous_batching_config", None)
    if config is None or not dataclasses.is_dataclass(config):
        return "not readable in this version of transformers"
    return {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


def run_transformers(model: str, device: str, dtype: str, work: Workload, progress: Progress,
                     attention: str = "auto", given: dict[str, Any] | None = None,
                     time_limit_s: float | None = None) -> dict[str, list[int]]:
    """The workload through transformers' continuous batching manager on the same weights: what
    ``generate_batch`` does, but each request with its own ``max_new_tokens``, with ``attention`` (resolved by
    resolve_attention) and the continuous-batching options of cb_options. Returns each finished request's ids, by
    request id: all of them, unless ``time_limit_s`` ran out first."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    start = time.perf_counter()
    resolved = resolve_attention(attention, device)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype), local_files_only=True,
                                              attn_implementation=resolved)
    hf = hf.to(device).eval()
    generation = GenerationConfig(do_sample=True, temperature=TEMPERATURE, max_new_tokens=max(work.max_tokens),
                                  eos_token_id=-1, pad_token_id=hf.config.pad_token_id or 0)
    asked = cb_options(resolved, device, work, given or {})
    cache, missing = cb_fields(asked, {f.name for f in dataclasses.fields(ContinuousBatchingConfig)})
    options: dict[str, Any] = {"generation_config": generation, "block": True, "timeout": 5,
                               "continuous_batching_config": ContinuousBatchingConfig(**cache)}
    try:  # sizes the manager's cache and batch for the workload, as generate_batch does (transformers 5)
        from transformers.generation.continuous_batching.utils import WorkloadHints

        options["workload_hints"] = WorkloadHints(max_prompt_length=max(map(len, work.prompts)),
                                                  max_generated_length=max(work.max_tokens),
                                                  num_requests=len(work.prompts))
    except ImportError:
        pass
    progress.settings = {"engine": "transformers continuous batching (continuous_batching_context_manager, "
                                   "add_request per sequence)", "transformers": version("transformers"),
                         "attention": {"asked": attention, "resolved": resolved, "flash_attention_imports": {
                             name: importable(module) for name, module in FLASH_ATTENTION}},
                         "label": SDPA_LABEL if resolved == PAGED_SDPA else f"against {resolved}",
                         "cb_options": asked, "cb_config_asked": cache, "cb_options_without_a_field": missing,
                         "time_limit_s": time_limit_s, "attn_implementation": hf.config._attn_implementation,
                         "generation_config": {"do_sample": True, "temperature": TEMPERATURE, "eos_token_id": -1}}
    outputs: dict[str, list[int]] = {}
    with hf.continuous_batching_context_manager(**options) as manager:
        progress.settings["attn_implementation_used"] = hf.config._attn_implementation
        warm_prompt, warm_tokens = WARM_UP
        collect(manager, {manager.add_request(warm_prompt, request_id="warm-up", max_new_tokens=warm_tokens)}, {})
        progress.settings["cb_config_resolved"] = resolved_config(manager)
        progress.startup_s = time.perf_counter() - start
        progress.started = time.perf_counter()
        ids = [manager.add_request(prompt, request_id=f"seq-{i}", max_new_tokens=n)
               for i, (prompt, n) in enumerate(zip(work.prompts, work.max_tokens, strict=True))]
        deadline = None if time_limit_s is None else progress.started + time_limit_s
        collect(manager, set(ids), outputs, progress, deadline)
        progress.finished = time.perf_counter()
        for request_id in set(ids) - outputs.keys():  # past the time limit: nothing left running at the exit
            manager.cancel_request(request_id)
    return {i: outputs[i] for i in ids if i in outputs}


def collect(manager: Any, ids: set[str], outputs: dict[str, list[int]], progress: Progress | None = None,
            deadline: float | None = None) -> None:
    """Wait for every request of ``ids`` to finish, its generated ids into ``outputs``; at ``deadline`` (a
    time.perf_counter()) stop waiting, with what finished by then."""
    while len(outputs.keys() & ids) < len(ids):
        if deadline is not None and time.perf_counter() >= deadline:
            return
        wait = 1.0 if deadline is None else max(0.01, min(1.0, deadline - time.perf_counter()))
        result = manager.get_result(timeout=wait)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped before every request finished")
            continue
        if not result.is_finished():
            continue
        if result.error:
            raise RuntimeError(f"request {result.request_id}: {result.error}")
        outputs[result.request_id] = list(result.generated_tokens)
        if progress is not None and result.request_id in ids:
            progress.output_tokens += len(result.generated_tokens)
            progress.finished_sequences += 1


# --- the record --------------------------------------------------------------------------------------


def record(name: str, device: str, dtype: str, model: str, work: Workload, progress: Progress,
           complete: bool) -> dict[str, Any]:
    seconds = progress.seconds()
    return {"name": name, "device": device, "dtype": dtype, "model": model, **environment(device),
            "command": shlex.join(sys.orig_argv), "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "workload": work.describe(), "settings": progress.settings, "complete": complete,
            "startup_s": progress.startup_s, "seconds": seconds, "output_tokens": progress.output_tokens,
            "finished_sequences": progress.finished_sequences,
            "tokens_per_s": progress.output_tokens / seconds if seconds else None,
            **({"label": progress.settings["label"]} if "label" in progress.settings else {})}


def write(result: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result['name']}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path


def on_sigterm(save: Callable[[], Path]) -> None:
    """At SIGTERM (a time limit), write what was measured so far, then exit."""
    def stop(signum: int, frame: Any) -> None:
        print(f"Stopped: wrote {save()}", flush=True)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def switch(text: str) -> bool | str:
    """A --cb-cuda-graphs / --cb-async-batching value: on, off, or auto (transformers decides)."""
    values = {"on": True, "off": False, "auto": "auto"}
    if text not in values:
        raise argparse.ArgumentTypeError(f"{text!r}: on, off or auto")
    return values[text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.throughput", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--stage", default=latest_stage(), help="the stage (default: the latest, %(default)s)")
    parser.add_argument("--peer", choices=PEERS, help="measure this instead of the stage, on the same weights")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--num-seqs", type=int, default=NUM_SEQS)
    parser.add_argument("--min-len", type=int, default=MIN_LEN, help="shortest prompt and output (default 100)")
    parser.add_argument("--max-len", type=int, default=MAX_LEN, help="longest prompt and output (default 1024)")
    parser.add_argument("--max-token-id", type=int, default=MAX_TOKEN_ID,
                        help="prompt ids are uniform in [0, this] (default 10000; capped below the vocabulary)")
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS, help="the stage's largest batch")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="FIELD=VALUE",
                        help="another EngineConfig field of the stage, e.g. speculative=off (repeatable)")
    parser.add_argument("--out", type=Path, help="folder for the JSON (default: results/cuda/<gpu>/ on a GPU)")
    parser.add_argument("--name", help="the result's name (default: throughput_<stage folder> or throughput_<peer>)")
    peer = parser.add_argument_group("--peer transformers")
    peer.add_argument("--attn-implementation", choices=ATTENTION_CHOICES, default="auto",
                      help="auto: flash-attention 3, else 2, whichever imports here (on CUDA), else paged SDPA")
    peer.add_argument("--time-limit", type=float, metavar="S",
                      help="stop after S seconds of measuring, counting the tokens of the finished sequences")
    for option, kind, meaning in [("num-blocks", int, "KV cache blocks (default: the whole workload's)"),
                                  ("block-size", int, f"tokens a block (default {PAGE})"),
                                  ("max-batch-tokens", int, f"tokens a step (default: {CUDA_TOKEN_BUDGET} with "
                                                            f"flash-attention, {SDPA_BATCH_TOKENS} with paged SDPA)"),
                                  ("max-requests-per-batch", int, "requests a step (default: every sequence)"),
                                  ("cuda-graphs", switch, "on, off or auto (default: off with paged SDPA)"),
                                  ("async-batching", switch, "on, off or auto (default: off with paged SDPA)")]:
        peer.add_argument(f"--cb-{option}", type=kind, help=meaning)
    args = parser.parse_args(argv)

    from .bench import device_and_dtype
    from .cli import model_dir_or_exit

    device, dtype = device_and_dtype(args.device, args.dtype)
    model = str(model_dir_or_exit(args.model))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    work = workload(args.num_seqs, args.min_len, args.max_len, min(args.max_token_id, vocab - 1))
    folder = stage_folder(args.stage)
    name = args.name or f"throughput_{args.peer or folder}"
    out = args.out or results_dir(device)
    progress = Progress()
    on_sigterm(lambda: write(record(name, device, dtype, model, work, progress, complete=False), out))
    print(f"{name}: {len(work.prompts)} sequences, {work.describe()['prompt_tokens']} prompt tokens, "
          f"{work.output_tokens} output tokens, on {device} in {dtype}", flush=True)
    if args.peer == "transformers":
        for key, value in OFFLINE_ENV.items():
            os.environ.setdefault(key, value)
        given = {option: getattr(args, f"cb_{option}") for option in CB_FIELDS if hasattr(args, f"cb_{option}")}
        finished = run_transformers(model, device, dtype, work, progress, args.attn_implementation, given,
                                    args.time_limit)
        outputs = [finished.get(f"seq-{i}", []) for i in range(len(work.prompts))]
    else:
        engine_args = dict(arg.split("=", 1) for arg in args.engine_arg)
        outputs = run_stage(folder, model, device, dtype, work, progress, args.max_num_seqs,
                            **{key.replace("-", "_"): parse_value(value) for key, value in engine_args.items()})
    unfinished = [i for i, ids in enumerate(outputs) if not ids]  # stopped at the time limit
    wrong = [i for i, (ids, n) in enumerate(zip(outputs, work.max_tokens, strict=True)) if ids and len(ids) != n]
    result = record(name, device, dtype, model, work, progress, complete=not wrong and not unfinished)
    if wrong:
        result["wrong_lengths"] = wrong
    if unfinished:
        result["unfinished_at_time_limit"] = len(unfinished)
    path = write(result, out)
    label = f" {progress.settings['label']}" if "label" in progress.settings else ""
    print(f"{name}: {result['output_tokens']} tokens in {result['seconds']:.2f} s: "
          f"{result['tokens_per_s'] or 0:.1f} tokens/s (start-up {result['startup_s']:.1f} s)"
          f"{f', {len(unfinished)} unfinished at the time limit' if unfinished else ''}{label}; wrote {path}",
          flush=True)
    if wrong:
        print(f"error: {len(wrong)} sequences did not produce their output length (EOS not ignored?)", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
