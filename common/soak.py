"""Soak a server: waves of concurrent streaming clients; every request must come back whole, and
the server's memory must stay flat from one wave to the next.

    python -m common.soak --stage 04                      # start stage 04, 4 waves of 256 clients
    python -m common.soak --stage 04 --clients 512 --rounds 10 --max-tokens 64
    python -m common.soak --url http://127.0.0.1:8004 --pid 12345   # a running server (pid: for its memory)

Each wave sends ``--clients`` streaming requests at once (greedy, EOS ignored, ``--max-tokens``
each) and waits for all of them. A request passes when its stream ends with ``[DONE]``, carries no
error event and reports exactly ``max_tokens`` completion tokens. The server's resident memory is
sampled every 100 ms. The exit status is 1 if any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field

import psutil

from .bench import free_port, stage_folder, stage_server
from .cli import served_name
from .loadgen import Stats, Workload, run_level
from .weights import DEFAULT_MODEL

MIB = 2**20


@dataclass
class SoakResult:
    clients: int
    rounds: int
    max_tokens: int
    requests: int = 0
    failures: list[str] = field(default_factory=list)  # one line per failed request
    output_tokens: int = 0
    wall_s: float = 0.0
    e2e_s: Stats | None = None
    rss_mib: list[float] = field(default_factory=list)  # the server's memory, every 100 ms
    rss_after_round_mib: list[float] = field(default_factory=list)

    @property
    def peak_rss_mib(self) -> float | None:
        return max(self.rss_mib) if self.rss_mib else None

    def summary(self) -> str:
        lines = [f"{self.requests} requests ({self.rounds} waves of {self.clients} clients, {self.max_tokens} tokens "
                 f"each): {self.requests - len(self.failures)} ok, {len(self.failures)} failed",
                 f"{self.output_tokens} tokens in {self.wall_s:.1f} s: {self.output_tokens / self.wall_s:.1f} tokens/s"]
        if self.e2e_s is not None:
            lines.append(f"end-to-end latency: p50 {self.e2e_s.p50:.2f} s, p99 {self.e2e_s.p99:.2f} s")
        if self.rss_mib:
            after = ", ".join(f"{m:.0f}" for m in self.rss_after_round_mib)
            lines.append(f"server memory: {self.rss_mib[0]:.0f} MiB at start, peak {self.peak_rss_mib:.0f} MiB, "
                         f"after each wave {after} MiB")
        lines += [f"  failed: {failure}" for failure in self.failures[:10]]
        return "\n".join(lines)


async def sample_rss(pid: int, into: list[float], done: asyncio.Event) -> None:
    process = psutil.Process(pid)
    while not done.is_set():
        into.append(process.memory_info().rss / MIB)
        try:
            await asyncio.wait_for(done.wait(), 0.1)
        except TimeoutError:
            pass


async def soak(url: str, model: str | None, clients: int, rounds: int, max_tokens: int,
               pid: int | None = None) -> SoakResult:
    """Run the waves and check every request; ``pid`` (the server's process) adds memory samples."""
    result = SoakResult(clients, rounds, max_tokens)
    workload = Workload(url, model, max_tokens=max_tokens, stream=True)
    done = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(pid, result.rss_mib, done)) if pid is not None else None
    latencies: list[float] = []
    try:
        for wave in range(rounds):
            level = await run_level(workload, clients, clients, desc=f"wave {wave + 1}/{rounds}")
            result.wall_s += level.wall_s
            for record in level.records:
                result.requests += 1
                if not record.ok:
                    result.failures.append(f"wave {wave + 1} request {record.index}: {record.error}")
                elif record.output_tokens != max_tokens:
                    result.failures.append(f"wave {wave + 1} request {record.index}: "
                                           f"{record.output_tokens} tokens, not {max_tokens}")
                else:
                    result.output_tokens += record.output_tokens
                    latencies.append(record.e2e_s or 0.0)
            if pid is not None:
                result.rss_after_round_mib.append(psutil.Process(pid).memory_info().rss / MIB)
    finally:
        done.set()
        if sampler is not None:
            await sampler
    result.e2e_s = Stats.of(latencies)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m common.soak", description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--stage", help="start this stage's server (02, 03, 04, ...) for the soak")
    target.add_argument("--url", help="soak a server that is already running")
    parser.add_argument("--pid", type=int, help="with --url: the server's process id, to sample its memory")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--clients", type=int, default=256, help="concurrent clients per wave (default: 256)")
    parser.add_argument("--rounds", type=int, default=4, help="waves (default: 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: 32)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = served_name(args.model)
    if args.stage:
        url = f"http://127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", stage_folder(args.stage), "--port", url.rsplit(":", 1)[1],
                   "--model", args.model, "--max-requests", str(max(512, args.clients))]
        with stage_server(command, url) as server:
            result = asyncio.run(soak(url, model, args.clients, args.rounds, args.max_tokens, server.pid))
    else:
        result = asyncio.run(soak(args.url.rstrip("/"), model, args.clients, args.rounds, args.max_tokens, args.pid))
    print(result.summary())
    raise SystemExit(1 if result.failures else 0)


if __name__ == "__main__":
    main()
