"""The mixed workload: chat streams decode while long prompts arrive. What chunked prefill (stage 06) is for.

    python -m common.mixed                                         # stage 05, then 06 at each budget
    python -m common.mixed --stages 06 --budgets 256 --long-prompts 2   # one quick look

``streams`` chat clients each send one short request after another (a closed loop, ``ignore_eos``), so
the server always has that many streams decoding. Each request asks for a number of tokens drawn
between ``stream_tokens`` (seeded) and the streams start half a second apart, so that they do not
start, finish and prefill in lockstep. After ``lead_in_s`` seconds a long prompt (``long_tokens``:
2,000 to 4,000 tokens of text, each starting differently, so that no prefix cache can share them)
arrives every ``long_every_s`` seconds and asks for a few tokens. When the last long prompt has its
answer, the streams finish the request they are in and stop.

What a user feels, and what the run records, over its *measured window*: from the first long
prompt's arrival to the last one's answer (the lead-in before it is the streams' steady state):

- every gap between two streamed chunks of the chat requests, with its time: their median is the
  normal pace of a stream, their 99th percentile and maximum the *stalls* when a prefill holds every
  stream up (stage 05 runs a whole prompt in one step; stage 06 a chunk of it per step);
- each long prompt's time to first token;
- everyone's output tokens per second of the window (a chat request's tokens counted where its
  chunks arrived): the work done, which a smaller step should not cut by much.

A stage 06 server runs once per budget (``--max-num-batched-tokens``), so the result is a trade-off
curve: a small budget keeps the streams smooth and makes the long prompt wait longer. Everything goes
to one JSON file and one figure (``results/<device>/mixed.json`` and ``.png``).

How often the long prompts come decides what a 99th percentile can see. Each long prompt costs each
stream one stall, and a stall must be more than 1% of a stream's gaps to show in the p99. On this
course's 2-core CPU a 3,000-token prompt takes about 7 s to prefill alone and a decode step of 16
streams about 120 ms, so with a long prompt every 15 s a stream makes about 60 tokens between two
stalls (the stall is 1.6% of its gaps), and stage 05 still keeps up (it prefills about half the time).
On a GPU the same prompts take tens of milliseconds, and they would come every few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from common.bench import (
    RESULTS,
    device_and_dtype,
    dumps,
    exit_on_sigterm,
    free_port,
    git_state,
    machine_info,
    stage_command,
    stage_folder,
    stage_server,
)
from common.cli import served_name
from common.loadgen import Workload, shared_prefix, stream_chunks
from common.weights import DEFAULT_MODEL


@dataclass
class MixedWorkload:
    streams: int = 16  # chat clients, each decoding continuously
    stream_tokens: tuple[int, int] = (64, 192)  # tokens per chat request, drawn uniformly (seeded)
    stream_stagger_s: float = 0.5  # chat client k starts k times this late
    long_prompts: int = 6  # long prompts in the run; it ends when the last has its answer
    long_tokens: tuple[int, int] = (2000, 4000)  # a long prompt's length, drawn uniformly (seeded)
    long_every_s: float = 15.0  # one long prompt every this many seconds
    lead_in_s: float = 15.0  # the streams alone before the first long prompt: the steady state to compare with
    long_max_tokens: int = 16
    seed: int = 0

    def long_prompt(self, index: int) -> str:
        """Long prompt ``index``: its own first line (so that it shares no block with another), then text."""
        tokens = random.Random(self.seed * 1000 + index).randint(*self.long_tokens)
        return f"Case file {index + 1}, reference {(index + 1) * 7919 % 100003:05d}.\n{shared_prefix(tokens)}" \
               f"\nSummarize case file {index + 1} in one sentence."

    def chat_tokens(self, stream: int, request: int) -> int:
        """How many tokens chat client ``stream`` asks for in its ``request``-th request (seeded)."""
        return random.Random(f"{self.seed}/{stream}/{request}").randint(*self.stream_tokens)


@dataclass
class MixedRun:
    """One server's run: every chat gap and long-prompt TTFT, with when it happened (seconds from the start).

    ``window`` is the measured window (the first long prompt's arrival, the last one's answer); the
    chat gaps before it are the lead-in's, kept for the timeline and left out of the summary."""

    label: str
    stage: str
    budget: int | None  # --max-num-batched-tokens, for stage 06 on
    server_command: str
    window: tuple[float, float] = (0.0, 0.0)
    window_tokens: float = 0.0  # output tokens that arrived in the window (a chat request's spread over its chunks)
    errors: int = 0
    chat_gaps: list[tuple[float, float]] = field(default_factory=list)  # (when, gap s)
    answers: list[tuple[list[float], int]] = field(default_factory=list)  # every request's (chunk times, tokens)
    long_ttfts: list[tuple[float, float]] = field(default_factory=list)  # (sent at, TTFT s)

    def count_window_tokens(self) -> None:
        """Output tokens in the window: a request's tokens pro rata of its chunks that arrived in it."""
        begin, end = self.window
        self.window_tokens = sum(tokens * sum(begin <= t <= end for t in times) / len(times)
                                 for times, tokens in self.answers)

    def summary(self) -> dict[str, Any]:
        begin, end = self.window
        gaps = [gap for when, gap in self.chat_gaps if begin <= when <= end]
        ttfts = [ttft for _, ttft in self.long_ttfts]
        p50, p99 = np.percentile(gaps, [50, 99]) if gaps else (None, None)
        return {
            "label": self.label,
            "stage": self.stage,
            "budget": self.budget,
            "chat_itl_s": {"p50": float(p50), "p99": float(p99), "max": max(gaps)} if gaps else None,
            "long_ttft_s": {"mean": float(np.mean(ttfts)), "max": max(ttfts)} if ttfts else None,
            "window_s": end - begin,
            "output_tokens": self.window_tokens,
            "output_tokens_per_s": self.window_tokens / (end - begin) if end > begin else 0.0,
            "errors": self.errors,
        }


async def run_mixed(url: str, model: str, workload: MixedWorkload, run: MixedRun) -> None:
    """Drive the server with the streams and the long prompts; fill ``run`` in (times from the start)."""
    chats = Workload(url, model, max_tokens=0)  # the standard workload's prompts, in turn; lengths drawn per request
    longs = Workload(url, model, workload.long_max_tokens,
                     prompts=[workload.long_prompt(i) for i in range(workload.long_prompts)])
    limits = httpx.Limits(max_connections=workload.streams + workload.long_prompts + 1)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        await stream_chunks(client, {**chats.body(0), "max_tokens": 8})  # warm-up: the first request pays for nothing
        start, stop = time.perf_counter(), asyncio.Event()

        async def chat(k: int) -> None:
            await asyncio.sleep(k * workload.stream_stagger_s)
            i = 0
            while not stop.is_set():
                try:
                    body = {**chats.body(k + i), "max_tokens": workload.chat_tokens(k, i)}
                    times, tokens = await stream_chunks(client, body)
                except Exception:  # noqa: BLE001 (a benchmark counts errors, it does not die of them)
                    run.errors += 1
                    continue
                run.chat_gaps += [(b - start, b - a) for a, b in pairwise(times)]
                run.answers.append(([t - start for t in times], tokens))
                i += 1

        async def long(index: int) -> float:
            """Send long prompt ``index`` on schedule; return when its answer ended (from the start)."""
            await asyncio.sleep(workload.lead_in_s + index * workload.long_every_s)
            sent = time.perf_counter()
            try:
                times, tokens = await stream_chunks(client, longs.body(index))
            except Exception:  # noqa: BLE001
                run.errors += 1
                return time.perf_counter() - start
            run.long_ttfts.append((sent - start, times[0] - sent))
            run.answers.append(([t - start for t in times], tokens))
            return times[-1] - start

        streams = [asyncio.create_task(chat(k)) for k in range(workload.streams)]
        ends = await asyncio.gather(*(long(i) for i in range(workload.long_prompts)))
        stop.set()
        await asyncio.gather(*streams)
    run.window = (workload.lead_in_s, max(ends))
    run.count_window_tokens()


def measure(stage: str, budget: int | None, model: str, device: str, dtype: str, workload: MixedWorkload) -> MixedRun:
    """Start ``stage``'s server (with ``budget``, if given), run the workload against it, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = stage_command(stage, port, model, device, dtype)
    if budget is not None:
        command += ["--max-num-batched-tokens", str(budget)]
    label = stage_folder(stage) if budget is None else f"{stage_folder(stage)} budget {budget}"
    run = MixedRun(label, f"{int(stage):02d}", budget, shlex.join(command))
    with stage_server(command, url):
        asyncio.run(run_mixed(url, served_name(model), workload, run))
    s = run.summary()
    print(f"{label}: chat ITL p50 {s['chat_itl_s']['p50'] * 1000:.0f} ms, p99 {s['chat_itl_s']['p99'] * 1000:.0f} ms, "
          f"max {s['chat_itl_s']['max'] * 1000:.0f} ms; long TTFT mean {s['long_ttft_s']['mean']:.1f} s; "
          f"{s['output_tokens_per_s']:.1f} tokens/s; errors {s['errors']}", flush=True)
    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m common.mixed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="+", default=["05", "06"], help="stages to measure (default: 05 06)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512, 1024],
                        help="--max-num-batched-tokens values for the stages that have it (06 on)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    defaults = MixedWorkload()
    parser.add_argument("--streams", type=int, default=defaults.streams)
    parser.add_argument("--long-prompts", type=int, default=defaults.long_prompts)
    parser.add_argument("--long-every", type=float, default=defaults.long_every_s, metavar="SECONDS")
    parser.add_argument("--name", default="mixed", help="the result file's name (default: mixed)")
    parser.add_argument("--out", type=Path, help="folder for the JSON and PNG (default: results/<device>/)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exit_on_sigterm()
    device, dtype = device_and_dtype(args.device, args.dtype)
    workload = MixedWorkload(streams=args.streams, long_prompts=args.long_prompts, long_every_s=args.long_every)
    machine = machine_info(device)
    runs = []
    for stage in args.stages:
        budgets: list[int | None] = list(args.budgets) if int(stage) >= 6 else [None]  # a budget per step: 06 on
        runs += [measure(stage, budget, args.model, device, dtype, workload) for budget in budgets]
    result = {
        "name": args.name,
        "device": device,
        "dtype": dtype,
        "workload": asdict(workload),
        "machine": machine,
        "command": shlex.join(sys.orig_argv),
        **git_state(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "runs": [{**run.summary(), "server_command": run.server_command, "chat_gaps": run.chat_gaps,
                  "long_ttfts": run.long_ttfts, "window": run.window} for run in runs],
    }
    out_dir = args.out or RESULTS / device
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{args.name}.json"
    json_path.write_text(dumps(result) + "\n")
    from common.plots import plot_mixed  # matplotlib only when there is something to draw

    print(f"Wrote {json_path} and {plot_mixed(result, json_path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
