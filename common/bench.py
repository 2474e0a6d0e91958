"""Benchmark a stage (or any OpenAI-compatible server) with the course's standard sweep.

    python -m common.bench --stage 02            # start stage 02's server, sweep, stop it
    python -m common.bench --stage 02 --quick    # the short CI version (also: QUICK=1)
    python -m common.bench --url http://127.0.0.1:8000 --model NAME --name vllm   # a running server
    python -m common.bench --stage 05 --shared-prefix-tokens   # a 1000-token system prompt in every request

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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from .cli import served_name
from .loadgen import (
    DEFAULT_SHARED_PREFIX_TOKENS,
    PROMPTS,
    LevelResult,
    Workload,
    probe_streaming,
    run_sweep,
    shared_prefix,
    warm_up,
)
from .net import free_port
from .plots import plot_results
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m common.bench", description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--stage", help="stage number, e.g. 02: start its server on a free loopback port")
    target.add_argument("--url", help="root URL of an OpenAI-compatible server that is already running")
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
    parser.add_argument("--requests", type=int, help="override the requests per level")
    parser.add_argument("--max-tokens", type=int, help="override the output tokens per request")
    parser.add_argument("--out", type=Path, help="folder for the JSON and PNG (default: results/<device>/)")
    parser.add_argument("--compare", type=Path, nargs="*", default=[],
                        help="more result JSON files to overlay in the figure")
    args = parser.parse_args(argv)
    if args.url and not args.name:
        parser.error("--url needs --name LABEL for the result file")
    if args.shared_prefix_tokens < 0:
        parser.error("--shared-prefix-tokens must be 0 (off) or more")
    return args


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


def machine_info(device: str) -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
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


async def measure(url: str, model: str, stream: bool, sweep: Sweep, label: str, extra_body: dict[str, Any],
                  prefix: str = "") -> tuple[bool, list[LevelResult]]:
    """Find out whether the server streams, warm it up, then run every level. ``prefix``: the
    shared-prefix workload's system prompt, or "" for the standard workload. The warm-up request
    carries it too (see ``warm_up``: the sweep measures a server that has seen its system prompt)."""
    if stream and not await probe_streaming(url, model, extra_body):
        print("The server answered 400 to a streaming request: measuring without streaming.", flush=True)
        stream = False
    workload = Workload(url, model, sweep.max_tokens, stream=stream, extra_body=extra_body, shared_prefix=prefix)
    await warm_up(workload)
    return stream, await run_sweep(workload, sweep.levels, sweep.requests_per_level, label)


def level_json(level: LevelResult) -> dict[str, Any]:
    summary = level.summary()
    summary["in_flight"]["samples"] = level.in_flight.samples
    summary["records"] = [asdict(r) for r in level.records]  # the raw data behind the aggregates
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


def shared_prefix_tokens_of(path: Path) -> int:
    """The shared-prefix length a result file was measured with (0: the standard workload, or a file
    written before the option existed)."""
    return json.loads(path.read_text())["workload"].get("shared_prefix_tokens", 0)


def previous_stage_result(out_dir: Path, stage: str | None, shared_prefix_tokens: int = 0) -> list[Path]:
    """The previous stage's result in the same folder (so quick compares with quick, full with full),
    for the same workload (a shared-prefix sweep with a shared-prefix sweep of the same length)."""
    if stage is None or int(stage) <= 1:
        return []
    candidates = sorted(out_dir.glob(f"{int(stage) - 1:02d}_*.json"))
    return [path for path in candidates if shared_prefix_tokens_of(path) == shared_prefix_tokens][:1]


def out_dir_of(args: argparse.Namespace, device: str) -> Path:
    """Where the result goes: --out, else results/<device>/ (results/quick/<device>/ for --quick)."""
    return args.out or (RESULTS / "quick" / device if args.quick else RESULTS / device)


def run(args: argparse.Namespace, process_group: bool = False) -> dict[str, Any]:
    """Measure what ``args`` (from ``parse_args``) name: start the stage's server (in a process group of its
    own with ``process_group``, see ``stage_server``), or measure the running server at --url. Returns the
    result as ``main`` writes it, without writing anything."""
    sweep = sweep_of(args)
    device, stage_dtype = device_and_dtype(args.device, args.dtype)
    # With --url we cannot see the server's dtype: record it only if the user told us.
    dtype = stage_dtype if args.stage else (None if args.dtype == "auto" else args.dtype)
    machine = machine_info(device)
    if (machine["load_average_1m"] or 0) > 1:
        print(f"warning: the load average is {machine['load_average_1m']:.1f} before we start: something else "
              "is using the CPU, and it will slow the server down", flush=True)
    server_command = None
    prefix = shared_prefix(args.shared_prefix_tokens)

    if args.stage:
        name = result_name(args.name or stage_folder(args.stage), args.shared_prefix_tokens)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server_command = stage_command(args.stage, port, args.model, device, dtype) + args.server_args
        model = served_name(args.model)
        with stage_server(server_command, url, process_group=process_group):
            stream, levels = asyncio.run(measure(url, model, not args.no_stream, sweep, name, args.extra_body,
                                                 prefix))
    else:
        name, url, model = result_name(args.name, args.shared_prefix_tokens), args.url.rstrip("/"), args.model
        stream, levels = asyncio.run(measure(url, model, not args.no_stream, sweep, name, args.extra_body, prefix))

    return {
        "name": name,
        "stage": f"{int(args.stage):02d}" if args.stage else None,
        "model": model,
        "device": device,
        "dtype": dtype,
        "streaming": stream,
        "quick": args.quick,
        "workload": workload_json(sweep, args.extra_body, args.shared_prefix_tokens),
        "machine": machine,
        "command": shlex.join(sys.orig_argv),
        "server_command": shlex.join(server_command) if server_command else None,
        "url": url,
        **git_state(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "levels": [level_json(level) for level in levels],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exit_on_sigterm()
    result = run(args)
    name, out_dir = result["name"], out_dir_of(args, result["device"])
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    json_path.write_text(dumps(result) + "\n")
    others = previous_stage_result(out_dir, args.stage, args.shared_prefix_tokens) + list(args.compare)
    png_path = plot_results([*others, result], json_path.with_suffix(".png"))
    print(f"Wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
