"""The course's latest stage against Hugging Face's own continuous-batching server, one after the other.

    python -m common.peer                 # transformers serve, then the latest stage: levels 1, 4, 16, 64
    python -m common.peer --quick         # the short sweep, written under results/quick/ (also: make peer QUICK=1)
    python -m common.peer --stage 04      # another stage against the same peer
    python -m common.peer --dtype bfloat16   # both in bfloat16: peer_bf16.json (also: make peer DTYPE=bfloat16)
    python -m common.peer --levels 1 4 8 16 32 64   # bench's six levels (also: make peer LEVELS="1 4 8 16 32 64")

First ``transformers serve <model folder> --continuous-batching`` on the folder every stage loads (see
common/weights.py), offline (``HF_HUB_OFFLINE=1``: it serves the local folder and downloads nothing), on the
stage's device and dtype (float32 on a CPU unless ``--dtype`` says otherwise; both servers get the same), with
``--cb-num-blocks 128 --cb-max-batch-tokens 512`` where this transformers has those options. When it answers, the
sweep of common/bench.py runs against it, and it is stopped, its whole process group: bench's full sweep (64
requests of 64 tokens a level) at concurrency 1, 4, 16 and 64 (``--levels`` for others, ``--quick`` for bench's
short sweep). Then the stage's server starts the way ``python -m common.bench --stage``
starts it, gets the same sweep, and is stopped: the two never run at once. The work is the same for both:
greedy, streamed, and exactly ``max_tokens`` tokens a request (``ignore_eos`` for the stage; transformers
refuses that field, so its requests carry a generation config without an EOS id instead).

It writes ``results/<device>/peer.json`` (both results as common/bench.py writes them, the machine with its CPU's
instruction-set flags, the dtype, the date, the git commit, the commands, and per level the ratio stage /
transformers of output tokens/s) and ``peer.png`` beside it, and prints the ratio table. Another dtype than float32
gets files of its own, so that neither overwrites the other: ``peer_bf16.json`` and ``peer_bf16.png`` for bfloat16
(on a CPU, fast only where it has avx512_bf16 or AMX: see ``cpu_flags`` in the JSON's machine).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from . import bench
from .cli import model_dir_or_exit
from .net import free_port
from .plots import load_result, plot_latency, plot_throughput, subtitle
from .weights import DEFAULT_MODEL

PEER_NAME = "transformers_serve_cb"  # the name the stage READMEs' hand-made peer results have
# What transformers serve's own check (is_serve_available) needs besides transformers; pip names = module names.
SERVE_MODULES = ("fastapi", "uvicorn", "pydantic", "openai")
# A smaller KV pool and step than the defaults, which are sized from a GPU's free memory.
CB_OPTIONS = ["--cb-num-blocks", "128", "--cb-max-batch-tokens", "512"]
# transformers refuses ignore_eos (422: unexpected field); a generation config without an EOS id makes every
# request run to max_tokens all the same. With temperature 0 it decodes greedily.
PEER_EXTRA_BODY = {"ignore_eos": None, "generation_config": json.dumps({"eos_token_id": -1})}
# The concurrency levels of the peer's full sweep: bench's FULL (1, 4, 8, 16, 32, 64) without 8 and 32, the same
# requests and tokens a level; the sweep runs twice, once per server.
PEER_LEVELS = [1, 4, 16, 64]
# A result file's suffix per dtype: float32 keeps peer.json, the others get files of their own.
DTYPE_SUFFIX = {"float32": "", "bfloat16": "_bf16", "float16": "_fp16"}
# The peer's environment: nothing from the Hub (the model is a local folder), no update check against PyPI.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
               "NO_COLOR": "1"}


def latest_stage() -> str:
    """The highest stage that is one server, e.g. '09': transformers serve is one process, and the gateway's stage (a
    Ray fleet of replicas, each the engine of the stage before it) is measured against its own single replica by its
    own benchmarks."""
    folders = sorted(p.parent.name for p in bench.REPO.glob("[0-9][0-9]_*/__main__.py")
                     if not (p.parent / "gateway.py").exists())
    return folders[-1][:2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m common.peer", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--stage", default=latest_stage(),
                        help="the stage to compare, e.g. 04 (default: the latest, %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model both serve (default: %(default)s)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="device both run on (auto: CUDA when there is one)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="for both servers; auto: the stage's default, float32 on CPU, bfloat16 on CUDA. "
                             "Not float32: results go to peer_bf16.json / peer_fp16.json (also: DTYPE=bfloat16)")
    parser.add_argument("--quick", action="store_true", default=os.environ.get("QUICK", "") in ("1", "true", "yes"),
                        help=f"bench's short sweep (levels {bench.QUICK.levels}, {bench.QUICK.requests_per_level} "
                             f"requests, {bench.QUICK.max_tokens} tokens), written under results/quick/ "
                             "(also: QUICK=1)")
    parser.add_argument("--levels", type=int, nargs="+",
                        help=f"the concurrency levels (default: {' '.join(map(str, PEER_LEVELS))}; with --quick, "
                             f"bench's {' '.join(map(str, bench.QUICK.levels))}) (also: LEVELS=\"1 4\")")
    parser.add_argument("--requests", type=int, help="override the requests per level")
    parser.add_argument("--max-tokens", type=int, help="override the output tokens per request")
    parser.add_argument("--out", type=Path, help="folder for peer.json and peer.png, or peer_bf16.json and "
                                                  "peer_bf16.png (default: results/<device>/)")
    args = parser.parse_args(argv)
    if args.levels is None and not args.quick:
        args.levels = list(PEER_LEVELS)
    args.stage = bench.stage_folder(args.stage)[:2]  # '9' -> '09'; exits when there is no such stage
    return args


# --- transformers serve ------------------------------------------------------------------------------------


def transformers_cli() -> list[str]:
    """The ``transformers`` command of this Python's environment."""
    script = Path(sys.executable).with_name("transformers")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "transformers.cli.transformers"]


def missing_serve_modules() -> list[str]:
    """The packages transformers serve needs that are not installed (transformers itself first)."""
    needed = ("transformers", *SERVE_MODULES)
    return [name for name in needed if importlib.util.find_spec(name) is None]


def exit_needing(packages: list[str]) -> None:
    """The one line that says what to install, and exit status 2."""
    print(f"error: transformers serve needs {', '.join(packages)}, not installed here: "
          f"{shlex.join(['pip', 'install', *packages])}", file=sys.stderr)
    raise SystemExit(2)


def module_missing_from_log(text: str) -> str | None:
    """What a server's output says is missing, if it says so: a module's top-level package, or transformers'
    own serving extra (its check of fastapi, uvicorn, pydantic and openai)."""
    if match := re.search(r"No module named '([\w.]+)'", text):
        return match.group(1).split(".")[0]
    if "transformers[serving]" in text:
        return "transformers[serving]"
    return None


def peer_env() -> dict[str, str]:
    return {**os.environ, **OFFLINE_ENV}


def cb_options(cli: list[str]) -> tuple[list[str], str]:
    """CB_OPTIONS where ``transformers serve --help`` lists them, else none; and a sentence for the result."""
    run = subprocess.run([*cli, "serve", "--help"], capture_output=True, text=True, env=peer_env(), check=False,
                         timeout=120)
    if run.returncode != 0:
        missing = module_missing_from_log(run.stdout + run.stderr)
        if missing:
            exit_needing([missing])
        raise SystemExit(f"error: `{shlex.join([*cli, 'serve', '--help'])}` failed:\n{run.stderr[-2000:]}")
    flags = [flag for flag in CB_OPTIONS if flag.startswith("--")]
    if all(flag in run.stdout for flag in flags):
        return CB_OPTIONS, f"{shlex.join(CB_OPTIONS)} (this transformers has both options)"
    return [], f"transformers' defaults: this transformers has no {' / '.join(flags)}"


def serve_command(cli: list[str], folder: Path, device: str, dtype: str, port: int, cb_flags: list[str]) -> list[str]:
    return [*cli, "serve", str(folder), "--continuous-batching", "--device", device, "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), *cb_flags]


# --- the sweeps ------------------------------------------------------------------------------------------


def sweep_flags(args: argparse.Namespace) -> list[str]:
    """The sweep's flags for common.bench, the same for both servers."""
    flags = ["--quick"] if args.quick else []
    if args.levels:
        flags += ["--levels", *map(str, args.levels)]
    if args.requests:
        flags += ["--requests", str(args.requests)]
    if args.max_tokens:
        flags += ["--max-tokens", str(args.max_tokens)]
    return flags


def measure_peer(args: argparse.Namespace, folder: Path, device: str, dtype: str,
                 commands: dict[str, str]) -> dict[str, Any]:
    """Start transformers serve on ``folder``, run the sweep against it, stop it (whatever happens): its result,
    with the server's command, transformers' version and the CB options it had."""
    cli = transformers_cli()
    cb_flags, cb_note = cb_options(cli)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = serve_command(cli, folder, device, dtype, port, cb_flags)
    bench_argv = ["--url", url, "--model", str(folder), "--name", PEER_NAME, "--device", device, "--dtype", dtype,
                  "--extra-body", json.dumps(PEER_EXTRA_BODY), *sweep_flags(args)]
    commands["transformers_server"] = " ".join(f"{k}={v}" for k, v in OFFLINE_ENV.items()) + " " + shlex.join(server)
    commands["transformers_bench"] = shlex.join(["python", "-m", "common.bench", *bench_argv])
    print(f"[1/2] transformers serve --continuous-batching, CB options: {cb_note}", flush=True)
    try:
        with bench.stage_server(server, url, env=peer_env(), process_group=True):
            result = bench.run(bench.parse_args(bench_argv))
    except RuntimeError as exc:  # it exited before it answered: say what it lacks when it says so
        if missing := module_missing_from_log(str(exc)):
            exit_needing([missing])
        raise
    result["server_command"] = shlex.join(server)
    result["transformers"] = importlib.metadata.version("transformers")
    result["cb_options"] = cb_note
    return result


def measure_stage(args: argparse.Namespace, device: str, dtype: str, commands: dict[str, str]) -> dict[str, Any]:
    """The same sweep against the stage, started as ``python -m common.bench --stage`` starts it."""
    bench_argv = ["--stage", args.stage, "--model", args.model, "--device", device, "--dtype", dtype,
                  *sweep_flags(args)]
    commands["stage_bench"] = shlex.join(["python", "-m", "common.bench", *bench_argv])
    print(f"[2/2] stage {bench.stage_folder(args.stage)}", flush=True)
    result = bench.run(bench.parse_args(bench_argv), process_group=True)
    commands["stage_server"] = result["server_command"]
    return result


# --- the comparison: pure functions of the two results ------------------------------------------------


def ratio_rows(peer: dict[str, Any], stage: dict[str, Any]) -> list[dict[str, Any]]:
    """Per concurrency level both measured: each one's output tokens/s and stage / transformers (None when
    the peer made nothing)."""
    peer_tps = {level["concurrency"]: level["output_tokens_per_s"] for level in peer["levels"]}
    rows = []
    for level in stage["levels"]:
        if (concurrency := level["concurrency"]) not in peer_tps:
            continue
        theirs, ours = peer_tps[concurrency], level["output_tokens_per_s"]
        rows.append({"concurrency": concurrency, "transformers_tokens_per_s": theirs, "stage_tokens_per_s": ours,
                     "ratio": ours / theirs if theirs else None})
    return rows


def unequal_work(result: dict[str, Any]) -> list[str]:
    """What makes the comparison unfair in ``result``: failed requests, or answers shorter than max_tokens
    (a server that stopped at EOS did less work). Empty when every request made exactly max_tokens."""
    max_tokens, problems = result["workload"]["max_tokens"], []
    for level in result["levels"]:
        ok = level["requests"] - level["errors"]
        if level["errors"]:
            problems.append(f"{result['name']} at concurrency {level['concurrency']}: {level['errors']} of "
                            f"{level['requests']} requests failed")
        if level["output_tokens"] != ok * max_tokens:
            problems.append(f"{result['name']} at concurrency {level['concurrency']}: {level['output_tokens']} "
                            f"output tokens, not {ok} x {max_tokens}")
    return problems


def format_table(rows: list[dict[str, Any]], stage_name: str) -> str:
    """The ratio table as Markdown, the way the READMEs hold results."""
    lines = [f"| Concurrency | transformers tokens/s | {stage_name} tokens/s | {stage_name[:2]} / transformers |",
             "|---|---|---|---|"]
    for row in rows:
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(f"| {row['concurrency']} | {row['transformers_tokens_per_s']:.1f} | "
                     f"{row['stage_tokens_per_s']:.1f} | {ratio} |")
    return "\n".join(lines)


def peer_result(peer: dict[str, Any], stage: dict[str, Any], commands: dict[str, str],
                machine: dict[str, Any] | None = None, git: dict[str, Any] | None = None) -> dict[str, Any]:
    """peer.json: the comparison first, then both results whole."""
    return {
        "name": "peer",
        "stage": stage["name"],
        "peer": peer["name"],
        "model": stage["model"],
        "device": stage["device"],
        "dtype": stage["dtype"],
        "quick": stage.get("quick", False),
        "transformers": peer.get("transformers"),
        "transformers_cb_options": peer.get("cb_options"),
        "workload": {key: stage["workload"].get(key) for key in ("levels", "requests_per_level", "max_tokens")}
        | {"temperature": 0, "streaming": {"transformers": peer.get("streaming"), "stage": stage.get("streaming")}},
        "machine": machine if machine is not None else stage.get("machine"),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **(git if git is not None else {k: stage.get(k) for k in ("git_commit", "git_dirty")}),
        "commands": commands,
        "warnings": unequal_work(peer) + unequal_work(stage),
        "ratio": ratio_rows(peer, stage),
        "results": {"transformers": peer, "stage": stage},
    }


def plot_peer(result: dict[str, Any], out: str | Path) -> Path:
    """Three panels against concurrency: output tokens/s of both, their inter-token latency, and the ratio."""
    runs = [load_result(result["results"]["transformers"]), load_result(result["results"]["stage"])]
    fig = Figure(figsize=(15, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    tps, itl, ratio = fig.subplots(1, 3)
    plot_throughput(tps, runs)
    plot_latency(itl, runs, "itl_s", "Inter-token latency")
    rows = [row for row in result["ratio"] if row["ratio"] is not None]
    xs, ys = [row["concurrency"] for row in rows], [row["ratio"] for row in rows]
    ratio.plot(xs, ys, "o-", color="C2", label=f"{result['stage']} / {result['peer']}")
    for x, y in zip(xs, ys, strict=True):
        ratio.annotate(f"{y:.2f}x", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ratio.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ratio.set_title("Output tokens/s: stage / transformers")
    ratio.set_ylabel("ratio")
    ratio.set_ylim(0, max([1.2, *ys]) * 1.15)
    levels = sorted({level["concurrency"] for run in runs for level in run["levels"]})
    for ax in (tps, itl, ratio):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        if ax is not ratio:
            ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['stage']} vs transformers serve --continuous-batching"
                 f"{' ' + result['transformers'] if result.get('transformers') else ''}\n{subtitle(runs[::-1])}",
                 fontsize=11)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def result_stem(dtype: str) -> str:
    """The result files' name for a run in ``dtype``: 'peer' for float32, 'peer_bf16' for bfloat16, ..."""
    return "peer" + DTYPE_SUFFIX.get(dtype, f"_{dtype}")


def write_peer(result: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """peer.json and peer.png in ``out_dir`` (peer_bf16.json and peer_bf16.png for a bfloat16 run, see
    result_stem)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = result_stem(result["dtype"])
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(bench.dumps(result) + "\n")
    return json_path, plot_peer(result, out_dir / f"{stem}.png")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bench.exit_on_sigterm()  # SIGTERM runs the finally blocks too: no server left behind
    if missing := missing_serve_modules():
        exit_needing(missing)
    folder = model_dir_or_exit(args.model)  # converted once from the embedded GGUF, as the stages do
    device, dtype = bench.device_and_dtype(args.device, args.dtype)
    machine, git = bench.machine_info(device), bench.git_state()  # before either server starts
    commands = {"peer": shlex.join(sys.orig_argv)}
    try:
        peer = measure_peer(args, folder, device, dtype, commands)  # stopped before the stage starts: never both
        stage = measure_stage(args, device, dtype, commands)
    except KeyboardInterrupt:  # each server was stopped on the way out (see bench.stage_server)
        print("\ninterrupted: the servers are stopped, nothing written", file=sys.stderr)
        raise SystemExit(130) from None
    result = peer_result(peer, stage, commands, machine, git)
    json_path, png_path = write_peer(result, bench.out_dir_of(args, device))
    print()
    print(format_table(result["ratio"], stage["name"]))
    for warning in result["warnings"]:
        print(f"warning: {warning}")
    print(f"\nWrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
