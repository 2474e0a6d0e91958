"""Benchmark a stage (or any OpenAI-compatible server) with the course's standard sweep.

    python -m common.bench --stage 02            # start stage 02's server, sweep, stop it
    python -m common.bench --stage 02 --quick    # the short CI version (also: QUICK=1)
    python -m common.bench --url http://127.0.0.1:8000 --model NAME --name vllm   # a running server
    python -m common.bench --stage 05 --shared-prefix-tokens   # a 1000-token system prompt in every request
    python -m common.bench --stage 04 --request-rate 0.5 1 2 4   # an open loop: Poisson arrivals at each rate

The sweep sends 64 requests at each concurrency level 1, 4, 8, 16, 32, 64, each asking for 64
tokens with greedy decoding and EOS ignored, so every stage does exactly the same work. The result
goes to ``results/<device>/<name>.json`` with the machine, the command and the git commit, and the
standard figure (see ``common/plots.py``) goes beside it, overlaid on the previous stage's result
when that file is there too. Quick runs go to ``results/quick/`` (git-ignored), so they never
overwrite the committed full results.

``--shared-prefix-tokens [N]`` runs the shared-prefix workload instead: the same N-token system prompt
(1000 if N is left out) in front of every request, then a short prompt that changes from one request to
the next, the traffic a prefix cache (stage 05) is for. Its result's name gets ``_shared_prefix``
(``_shared_prefix_N`` for another N), so it never overwrites the standard sweep's file, and the
figure overlays the previous stage's result for the same workload only.

``--request-rate R [R ...]`` runs an open loop instead (see common/loadgen.py): at each rate, the same
number of requests, each sent at its arrival time (Poisson by default, seeded; ``--arrivals fixed`` for
exactly 1/R apart) whether or not the earlier ones have finished, as users do. A closed loop waits for
an answer before it sends the next request, so it never sees a queue build up; an open loop above the
server's capacity does. Per rate it reports TTFT, ITL and end-to-end percentiles, the achieved rate,
and the goodput: requests per second that met both latency targets (``--slo-ttft-ms``, ``--slo-itl-ms``).
The highest rate at which at least ``--slo-share`` of the requests met them is the *sustainable rate*.
A stage started here runs with ``--trace`` (stages 02 on), and each request's time in the server's queue,
which the client cannot see, is read from its trace. The result is ``<name>_rates.json`` (never the
closed loop's file) with its figure: latency against the offered rate, the knee where the queue starts.
``--rescore FILE [FILE ...]`` judges saved open-loop results against other targets without measuring again:
the records are kept, and the targets are a choice about the service.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from .cli import served_name
from .loadgen import (
    DEFAULT_SHARED_PREFIX_TOKENS,
    PROMPTS,
    Arrivals,
    LevelResult,
    RateResult,
    RequestRecord,
    Slo,
    Workload,
    probe_streaming,
    run_rates,
    run_sweep,
    shared_prefix,
    sustainable_rate,
    warm_up,
)
from .net import free_port
from .plots import plot_rates, plot_results
from .trace import read_traces
from .weights import DEFAULT_MODEL

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"


@dataclass
class Sweep:
    levels: list[int]
    requests_per_level: int
    max_tokens: int


FULL = Sweep(levels=[1, 4, 8, 16, 32, 64], requests_per_level=64, max_tokens=64)
QUICK = Sweep(levels=[1, 4], requests_per_level=8, max_tokens=16)

# The open loop's latency targets: those of the course's reading on an inference server's anatomy (seed article
# "Anatomy of an LLM Inference Server", its key metrics: TTFT < 500 ms, ITL < 50 ms); 90% of requests within them.
SLO_TTFT_MS, SLO_ITL_MS, SLO_SHARE = 500.0, 50.0, 0.9
RATES_SUFFIX = "_rates"  # an open-loop result's name: never the closed loop's file
TRACED_FROM = 2  # the first stage that takes --trace


@dataclass
class RateSweep:
    """An open-loop sweep: ``Sweep.requests_per_level`` requests at each offered rate (requests per second)."""

    rates: list[float]
    arrivals: Arrivals
    seed: int
    max_concurrency: int | None  # None: no cap on the requests in flight, a pure open loop
    slo: Slo
    slo_share: float  # the share of requests that must meet the SLO for a rate to count as sustained


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m common.bench", description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--stage", help="stage number, e.g. 02: start its server on a free loopback port")
    target.add_argument("--url", help="root URL of an OpenAI-compatible server that is already running")
    target.add_argument("--rescore", type=Path, nargs="+", metavar="FILE",
                        help="open-loop results (_rates.json) to judge again against --slo-ttft-ms, --slo-itl-ms and "
                             "--slo-share, from their raw records: each file and its figure are rewritten (with "
                             "several files, rates.png beside the first shows them all); nothing is sent")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"model to serve (--stage) or to name in requests (--url); default {DEFAULT_MODEL}")
    parser.add_argument("--name", help="label for the result file and the figure (default: the stage folder)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="device the stage runs on; with --url, the device to file the result under")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: float32 on CPU, bfloat16 on CUDA (the stages' rule)")
    parser.add_argument("--quick", action="store_true", default=os.environ.get("QUICK", "") in ("1", "true", "yes"),
                        help=f"short sweep for CI: levels {QUICK.levels}, {QUICK.requests_per_level} requests, "
                             f"{QUICK.max_tokens} tokens, written under results/quick/ (also: QUICK=1)")
    parser.add_argument("--no-stream", action="store_true",
                        help="send non-streaming requests (found out by itself when the server answers 400)")
    parser.add_argument("--extra-body", type=json.loads, default={},
                        help="JSON object merged into every request body; a null removes a field, e.g. "
                             "'{\"ignore_eos\": null}' for a server that rejects fields it does not know")
    parser.add_argument("--shared-prefix-tokens", type=int, nargs="?", const=DEFAULT_SHARED_PREFIX_TOKENS, default=0,
                        metavar="N", help="put the same system prompt of about N tokens (default "
                        f"{DEFAULT_SHARED_PREFIX_TOKENS}) in front of every prompt, to measure a prefix cache; "
                        "the result's name gets _shared_prefix appended (also: make bench PREFIX=1)")
    parser.add_argument("--server-args", type=shlex.split, default=[], metavar="ARGS",
                        help="more arguments for the stage's server, as one string, e.g. --server-args=--enforce-eager "
                             "(with --stage)")
    parser.add_argument("--levels", type=int, nargs="+", help="override the concurrency levels")
    parser.add_argument("--requests", type=int, help="override the requests per level (per rate with --request-rate)")
    parser.add_argument("--max-tokens", type=int, help="override the output tokens per request")
    parser.add_argument("--out", type=Path, help="folder for the JSON and PNG (default: results/<device>/)")
    parser.add_argument("--compare", type=Path, nargs="*", default=[],
                        help="more result JSON files to overlay in the figure (open loop: other _rates.json files)")
    add_open_loop_args(parser)
    args = parser.parse_args(argv)
    if args.url and not args.name:
        parser.error("--url needs --name LABEL for the result file")
    if args.request_rates and args.levels:
        parser.error("--levels sets a closed loop's concurrencies; --request-rate sweeps rates instead")
    if args.request_rates and min(args.request_rates) <= 0:
        parser.error("--request-rate takes rates above 0 (requests per second)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be 1 or more")
    if not 0 < args.slo_share <= 1:
        parser.error("--slo-share is a fraction: above 0, at most 1")
    if args.shared_prefix_tokens < 0:
        parser.error("--shared-prefix-tokens must be 0 (off) or more")
    return args


def add_open_loop_args(parser: argparse.ArgumentParser) -> None:
    """The open loop's options: the rates, how requests arrive, and the latency targets goodput counts."""
    group = parser.add_argument_group("open loop (requests at a rate instead of a fixed number of clients)")
    group.add_argument("--request-rate", dest="request_rates", type=float, nargs="+", metavar="R",
                       help="requests per second; several make a sweep over rates. Each request is sent at its "
                            "arrival time whether or not the earlier ones have finished")
    group.add_argument("--arrivals", choices=["poisson", "fixed"], default="poisson",
                       help="poisson (default): exponential gaps of mean 1/R, as independent users send; "
                            "fixed: exactly 1/R apart")
    group.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals (default 0): the same "
                                                            "seed, the same schedule")
    group.add_argument("--max-concurrency", type=int, help="at most this many requests in flight; one that "
                       "arrives beyond it waits for a place, outside its latencies (default: no cap)")
    group.add_argument("--slo-ttft-ms", type=float, default=SLO_TTFT_MS,
                       help=f"time-to-first-token target (default {SLO_TTFT_MS:g} ms, seed article 'Anatomy of "
                            "an LLM Inference Server')")
    group.add_argument("--slo-itl-ms", type=float, default=SLO_ITL_MS,
                       help=f"inter-token latency target, on a request's mean gap between tokens (default "
                            f"{SLO_ITL_MS:g} ms, same source)")
    group.add_argument("--slo-share", type=float, default=SLO_SHARE,
                       help=f"share of requests that must meet both targets for a rate to be sustainable "
                            f"(default {SLO_SHARE:g})")


def rate_sweep_of(args: argparse.Namespace) -> RateSweep | None:
    """The open-loop sweep ``args`` ask for, or None for the closed loop (no --request-rate)."""
    if not args.request_rates:
        return None
    return RateSweep(rates=args.request_rates, arrivals=args.arrivals, seed=args.seed,
                     max_concurrency=args.max_concurrency,
                     slo=Slo(ttft_s=args.slo_ttft_ms / 1000, itl_s=args.slo_itl_ms / 1000), slo_share=args.slo_share)


def result_name(name: str, shared_prefix_tokens: int) -> str:
    """The result's name: ``name``, with ``_shared_prefix`` (``_shared_prefix_N`` for a length other
    than the default) for the shared-prefix workload, so that it never overwrites the standard sweep's
    file. Appended to a name given with --name too, unless the name already says it."""
    if shared_prefix_tokens == 0 or "shared_prefix" in name:
        return name
    size = "" if shared_prefix_tokens == DEFAULT_SHARED_PREFIX_TOKENS else f"_{shared_prefix_tokens}"
    return f"{name}_shared_prefix{size}"


def sweep_of(args: argparse.Namespace) -> Sweep:
    base = QUICK if args.quick else FULL
    return Sweep(levels=args.levels or base.levels,
                 requests_per_level=args.requests or base.requests_per_level,
                 max_tokens=args.max_tokens or base.max_tokens)


# --- where it runs -------------------------------------------------------------------------------


def device_and_dtype(device: str, dtype: str) -> tuple[str, str]:
    """What ``--device`` and ``--dtype`` resolve to, by the stages' own rule (common/device.py), as names."""
    from .device import pick_device, pick_dtype  # imports torch: only when a stage is benchmarked

    chosen = pick_device(device)
    return chosen.type, str(pick_dtype(dtype, chosen)).removeprefix("torch.")


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


# The instruction sets a CPU's matrix products depend on: bfloat16 ones are fast only with avx512_bf16 or AMX (without
# them PyTorch converts to float32 and back), and int8 ones use VNNI. Results from different hosts say which they had.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "avx_vnni")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str] | None:
    """Which of CPU_FLAGS the first ``flags`` line of /proc/cpuinfo lists, in CPU_FLAGS' order; None where there
    is no such file (not Linux) or no such line."""
    if not cpuinfo.is_file():
        return None
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags") and ":" in line:
            present = set(line.split(":", 1)[1].split())
            return [flag for flag in CPU_FLAGS if flag in present]
    return None


def machine_info(device: str) -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),  # of CPU_FLAGS, those this CPU has: bfloat16 is slow on a CPU without the bf16 ones
        "cpu_count": os.cpu_count(),
        # What this process may use: a container often gets fewer cores than the machine has.
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else None,
        # Taken before the server starts: above ~0.5, something else was using the CPU, and the
        # numbers are worth less (on a small machine, two busy PyTorch processes slow each other a lot).
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def git_state() -> dict[str, Any]:
    """The commit the code came from, and whether the working tree had changes on top of it."""
    def git(*args: str) -> str | None:
        run = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
        return run.stdout.strip() if run.returncode == 0 else None

    status = git("status", "--porcelain")
    return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": None if status is None else status != ""}


# --- the stage's server as a subprocess -----------------------------------------------------------


def stage_folder(stage: str) -> str:
    """'2' or '02' -> '02_streaming'."""
    matches = sorted(p.name for p in REPO.glob(f"{int(stage):02d}_*") if (p / "__main__.py").is_file())
    if not matches:
        raise SystemExit(f"error: no stage {stage} in {REPO}")
    return matches[0]


def stage_command(stage: str, port: int, model: str, device: str, dtype: str) -> list[str]:
    """The command that serves ``stage`` on 127.0.0.1:``port``."""
    return [sys.executable, "-m", stage_folder(stage), "--port", str(port), "--host", "127.0.0.1", "--model", model,
            "--device", device, "--dtype", dtype]


def wait_healthy(url: str, server: subprocess.Popen[bytes], log: Path, timeout_s: float = 600) -> None:
    """Poll GET /health until it answers 200; fail early if the server process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode}; its log:\n{tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} was not healthy after {timeout_s:.0f} s; its log:\n{tail(log)}")


def tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def stop_server(server: subprocess.Popen[bytes], timeout_s: float = 15, group: bool = False) -> None:
    """Ask politely (SIGTERM), then insist (SIGKILL). ``group``: the server leads a process group of its
    own (``stage_server(process_group=True)``), and every process in it gets the signals, so that no
    child it started outlives it."""
    def send(sig: int) -> None:
        if not group:
            server.send_signal(sig)
            return
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:  # the whole group is gone already
            pass

    if server.poll() is None:
        send(signal.SIGTERM)
        try:
            server.wait(timeout_s)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            server.wait()
    if group:
        send(signal.SIGKILL)  # whatever the leader left behind in its group


@contextmanager
def stage_server(command: list[str], url: str, env: dict[str, str] | None = None,
                 process_group: bool = False) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` until the block ends, whatever way it ends (an error, Ctrl-C, SIGTERM). ``env``: the
    server's whole environment (default: ours). ``process_group``: start it in a session of its own and stop
    the whole group (Ctrl-C at the terminal then reaches only us, and we stop it)."""
    with tempfile.NamedTemporaryFile(prefix="bench-server-", suffix=".log", delete=False) as log_file:
        log = Path(log_file.name)
        server = subprocess.Popen(command, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=process_group)
    print(f"Started {shlex.join(command)} (pid {server.pid}, log {log})", flush=True)
    try:
        wait_healthy(url, server, log)
        yield server
    finally:
        stop_server(server, group=process_group)
    log.unlink()  # kept only when something went wrong, for the error message's reader


def traced_requests(stage: str, prompts: list[str], max_tokens: int = 16) -> list[dict[str, Any]]:
    """Serve ``stage`` with ``--trace``, send every prompt at once (streamed, greedy, ``max_tokens`` each)
    and return the requests' traces (see common/trace.py), in the order they finished."""
    folder = stage_folder(stage)
    trace_file = Path(tempfile.mkdtemp(prefix="trace-")) / "traces.jsonl"
    url = f"http://127.0.0.1:{(port := free_port())}"
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}

    def send(prompt: str) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "prompt": prompt}, timeout=600) as response:
            response.raise_for_status()
            response.read()

    with stage_server([sys.executable, "-m", folder, "--port", str(port), "--trace", str(trace_file)], url):
        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(send, prompts))
        deadline = time.monotonic() + 10  # a trace is written just after its response has gone out
        while len(traces := read_traces(trace_file) if trace_file.exists() else []) < len(prompts):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(traces)} of {len(prompts)} traces in {trace_file}")
            time.sleep(0.05)
    return traces


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that ``finally`` blocks (stopping the server) still run."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


# --- measuring and writing -------------------------------------------------------------------------


async def measure(url: str, model: str, stream: bool, max_tokens: int, extra_body: dict[str, Any], prefix: str,
                  load: Callable[[Workload], Awaitable[list[Any]]]) -> tuple[bool, list[Any]]:
    """Find out whether the server streams, warm it up, then run ``load`` (the closed loop's levels or the open
    loop's rates). ``prefix``: the shared-prefix workload's system prompt, or "" for the standard workload.
    The warm-up request carries it too (see ``warm_up``: the sweep measures a server that has seen its
    system prompt)."""
    if stream and not await probe_streaming(url, model, extra_body):
        print("The server answered 400 to a streaming request: measuring without streaming.", flush=True)
        stream = False
    workload = Workload(url, model, max_tokens, stream=stream, extra_body=extra_body, shared_prefix=prefix)
    await warm_up(workload)
    return stream, await load(workload)


def level_json(level: LevelResult) -> dict[str, Any]:
    summary = level.summary()
    summary["in_flight"]["samples"] = level.in_flight.samples
    summary["records"] = [asdict(r) for r in level.records]  # the raw data behind the aggregates
    return summary


def rate_json(rate: RateResult, slo: Slo) -> dict[str, Any]:
    """A rate's summary, with its schedule and raw records, each with its time in the queue (None: untraced)."""
    summary = rate.summary(slo)
    summary["in_flight"]["samples"] = rate.sent.in_flight.samples
    summary["arrivals_s"] = [round(t, 4) for t in rate.arrivals]
    queued = rate.queued_s or {}
    summary["records"] = [{**asdict(r), "queued_s": queued.get(r.request_id or "")} for r in rate.sent.records]
    return summary


def dumps(value: Any, indent: str = "") -> str:
    """JSON that reads top-down: one line per key and per record, but a record, a list of numbers
    (the in-flight samples) or a small object stays on one line, so that a result file stays short."""
    inner = indent + " "
    if isinstance(value, dict) and any(isinstance(v, dict | list) and v and not is_leaf(v) for v in value.values()):
        items = [f"{inner}{json.dumps(k)}: {dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return "[\n" + ",\n".join(inner + dumps(v, inner) for v in value) + f"\n{indent}]"
    return json.dumps(value, ensure_ascii=False)


def is_leaf(value: dict[str, Any] | list[Any]) -> bool:
    """True when no dict is nested anywhere inside: such a value prints on one line."""
    items = value.values() if isinstance(value, dict) else value
    return all(not isinstance(v, dict) and (not isinstance(v, list) or is_leaf(v)) for v in items)


def workload_json(sweep: Sweep, extra_body: dict[str, Any], shared_prefix_tokens: int) -> dict[str, Any]:
    """The result's ``workload`` section: everything a request asked for, so that a reader can tell
    which results measured the same work. ``shared_prefix_tokens`` is 0 for the standard workload."""
    return {**asdict(sweep), "temperature": 0, "ignore_eos": True, "prompts": PROMPTS, "extra_body": extra_body,
            "shared_prefix_tokens": shared_prefix_tokens, "shared_prefix": shared_prefix(shared_prefix_tokens)}


def rates_workload_json(sweep: Sweep, rates: RateSweep, extra_body: dict[str, Any],
                        shared_prefix_tokens: int) -> dict[str, Any]:
    """An open loop's ``workload`` section: the schedule's parameters, then what every request asked for."""
    closed = workload_json(sweep, extra_body, shared_prefix_tokens)
    request = {key: value for key, value in closed.items() if key not in ("levels", "requests_per_level")}
    return {"rates": rates.rates, "requests_per_rate": sweep.requests_per_level, "arrivals": rates.arrivals,
            "seed": rates.seed, "max_concurrency": rates.max_concurrency, **request}


def open_loop_json(results: list[RateResult], rates: RateSweep, queueing: str) -> dict[str, Any]:
    """The open loop's part of a result: the SLOs, the sustainable rate, where queueing times come from, and
    every rate."""
    summaries = [rate_json(result, rates.slo) for result in results]
    return {"slo": slo_json(rates.slo, rates.slo_share),
            "sustainable_rate": sustainable_rate(summaries, rates.slo_share),
            "queueing": queueing,
            "rates": summaries}


def slo_json(slo: Slo, share: float) -> dict[str, Any]:
    return {"ttft_ms": 1000 * slo.ttft_s, "itl_ms": 1000 * slo.itl_s, "share": share,
            "itl_is": "each request's mean gap between tokens"}


def rescore(result: dict[str, Any], slo: Slo, share: float) -> dict[str, Any]:
    """An open-loop result judged against other latency targets: each rate's goodput and the sustainable rate,
    recomputed from the raw records; nothing measured changes. Targets are a choice about the service, not part
    of the measurement (a GPU's 500 ms / 50 ms are out of a 2-core CPU's reach at any load), so one sweep can
    answer for several."""
    assert "rates" in result, f"{result.get('name')}: not an open loop's result (a _rates.json file)"
    names = {f.name for f in fields(RequestRecord)}
    rates = []
    for rate in result["rates"]:
        records = [RequestRecord(**{k: v for k, v in r.items() if k in names}) for r in rate["records"]]
        met = sum(slo.met_by(r) for r in records)
        rates.append({**rate, "goodput": met / rate["wall_s"] if rate["wall_s"] > 0 else 0.0,
                      "goodput_share": met / len(records) if records else 0.0})
    return {**result, "slo": slo_json(slo, share), "sustainable_rate": sustainable_rate(rates, share),
            "rates": rates}


def rescore_files(paths: list[Path], slo: Slo, share: float, compare: list[Path]) -> None:
    """``--rescore``: rewrite each file and its figure under the new targets, and print each conclusion."""
    rescored = []
    for path in paths:
        result = rescore(json.loads(path.read_text()), slo, share)
        path.write_text(dumps(result) + "\n")
        plot_rates([*compare, result], path.with_suffix(".png"))
        print(f"{result['name']}: {sustainable_line(result)}")
        rescored.append(result)
    if len(rescored) > 1:
        print(f"Wrote {plot_rates(rescored, paths[0].parent / 'rates.png')}")


def shared_prefix_tokens_of(path: Path) -> int | None:
    """The shared-prefix length a result file was measured with (0: the standard workload, or a file
    written before the option existed); None for a file that is no sweep (a stage's step timings, say)."""
    result = json.loads(path.read_text())
    if "workload" not in result or not ("levels" in result or "rates" in result):
        return None
    return result["workload"].get("shared_prefix_tokens", 0)


def previous_stage_result(out_dir: Path, stage: str | None, shared_prefix_tokens: int = 0,
                          rates: bool = False) -> list[Path]:
    """The previous stage's result in the same folder (so quick compares with quick, full with full),
    for the same workload (a shared-prefix sweep with a shared-prefix sweep of the same length) and the same
    loop (``rates``: an open loop's ``_rates`` file, else a closed loop's)."""
    if stage is None or int(stage) <= 1:
        return []
    candidates = sorted(out_dir.glob(f"{int(stage) - 1:02d}_*.json"))
    return [path for path in candidates if path.stem.endswith(RATES_SUFFIX) == rates
            and shared_prefix_tokens_of(path) == shared_prefix_tokens][:1]


def out_dir_of(args: argparse.Namespace, device: str) -> Path:
    """Where the result goes: --out, else results/<device>/ (results/quick/<device>/ for --quick)."""
    return args.out or (RESULTS / "quick" / device if args.quick else RESULTS / device)


def queueing_source(args: argparse.Namespace) -> str:
    """Where an open loop's queueing times come from, or why there are none: the client cannot see them."""
    if args.url:
        return ("none: an outside server (--url) keeps its queue to itself; only its own traces could show it "
                "(a stage started with --stage is traced)")
    if int(args.stage) < TRACED_FROM:
        return f"none: stage {int(args.stage):02d} writes no traces (--trace starts at stage {TRACED_FROM:02d})"
    return "the server's traces (--trace): the sum of each request's queued spans, matched by request id"


@contextmanager
def target(args: argparse.Namespace, device: str, dtype: str, trace_file: Path | None,
           process_group: bool) -> Iterator[tuple[str, str, list[str] | None]]:
    """The server to measure, for the block: the stage's, started here (with ``--trace trace_file`` when
    given, in a process group of its own with ``process_group``, see ``stage_server``), or the one at --url.
    Yields its URL, the model name to ask for, and the command that started it (None for --url)."""
    if not args.stage:
        yield args.url.rstrip("/"), args.model, None
        return
    url = f"http://127.0.0.1:{(port := free_port())}"
    tracing = ["--trace", str(trace_file)] if trace_file else []
    command = stage_command(args.stage, port, args.model, device, dtype) + tracing + args.server_args
    with stage_server(command, url, process_group=process_group):
        yield url, served_name(args.model), command


def run(args: argparse.Namespace, process_group: bool = False) -> dict[str, Any]:
    """Measure what ``args`` (from ``parse_args``) name: start the stage's server (in a process group of its
    own with ``process_group``, see ``stage_server``), or measure the running server at --url; a closed loop,
    or an open one with --request-rate. Returns the result as ``main`` writes it, without writing anything."""
    sweep, rates = sweep_of(args), rate_sweep_of(args)
    device, stage_dtype = device_and_dtype(args.device, args.dtype)
    # With --url we cannot see the server's dtype: record it only if the user told us.
    dtype = stage_dtype if args.stage else (None if args.dtype == "auto" else args.dtype)
    machine = machine_info(device)
    if (machine["load_average_1m"] or 0) > 1:
        print(f"warning: the load average is {machine['load_average_1m']:.1f} before we start: something else "
              "is using the CPU, and it will slow the server down", flush=True)
    prefix = shared_prefix(args.shared_prefix_tokens)
    name = result_name(args.name or stage_folder(args.stage), args.shared_prefix_tokens)
    name += RATES_SUFFIX if rates else ""
    with tempfile.TemporaryDirectory(prefix="bench-trace-") as folder:
        traced = rates is not None and args.stage is not None and int(args.stage) >= TRACED_FROM
        trace_file = Path(folder) / "traces.jsonl" if traced else None

        def load(workload: Workload) -> Awaitable[list[Any]]:
            if rates is None:
                return run_sweep(workload, sweep.levels, sweep.requests_per_level, name)
            return run_rates(workload, rates.rates, sweep.requests_per_level, rates.slo, rates.arrivals, rates.seed,
                             rates.max_concurrency, trace_file, name)

        with target(args, device, dtype, trace_file, process_group) as (url, model, server_command):
            stream, measured = asyncio.run(measure(url, model, not args.no_stream, sweep.max_tokens, args.extra_body,
                                                   prefix, load))
    return {
        "name": name,
        "stage": f"{int(args.stage):02d}" if args.stage else None,
        "model": model,
        "device": device,
        "dtype": dtype,
        "streaming": stream,
        "quick": args.quick,
        "workload": (workload_json(sweep, args.extra_body, args.shared_prefix_tokens) if rates is None
                     else rates_workload_json(sweep, rates, args.extra_body, args.shared_prefix_tokens)),
        "machine": machine,
        "command": shlex.join(sys.orig_argv),
        "server_command": shlex.join(server_command) if server_command else None,
        "url": url,
        **git_state(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **({"levels": [level_json(level) for level in measured]} if rates is None
           else open_loop_json(measured, rates, queueing_source(args))),
    }


def sustainable_line(result: dict[str, Any]) -> str:
    """The open loop's conclusion, in one sentence."""
    slo = result["slo"]
    targets = (f"at least {100 * slo['share']:g}% of requests within TTFT {slo['ttft_ms']:g} ms and ITL "
               f"{slo['itl_ms']:g} ms")
    if result["sustainable_rate"] is None:
        return f"Sustainable rate: none of the rates {result['workload']['rates']} kept {targets}"
    return f"Sustainable rate: {result['sustainable_rate']:g} requests/s, the highest that kept {targets}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rescore:
        slo = Slo(ttft_s=args.slo_ttft_ms / 1000, itl_s=args.slo_itl_ms / 1000)
        rescore_files(args.rescore, slo, args.slo_share, list(args.compare))
        return
    exit_on_sigterm()
    result = run(args)
    name, out_dir = result["name"], out_dir_of(args, result["device"])
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    json_path.write_text(dumps(result) + "\n")
    open_loop = "rates" in result
    others = previous_stage_result(out_dir, args.stage, args.shared_prefix_tokens, open_loop) + list(args.compare)
    plot = plot_rates if open_loop else plot_results
    png_path = plot([*others, result], json_path.with_suffix(".png"))
    if open_loop:
        print(sustainable_line(result))
    print(f"Wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
