"""An async load generator: many clients at once against POST /v1/completions, timed per request.

A *level* sends ``num_requests`` requests with at most ``concurrency`` of them in flight (a
closed loop: as soon as one finishes, the next starts). For every request we record

- TTFT, time to first token: from sending the request to the first chunk that carries text;
- ITL, inter-token latency: the mean gap between the streamed chunks that follow it;
- end-to-end latency: from sending the request to the end of the answer;
- output tokens, from the server's own ``usage`` numbers (not by counting chunks).

While a level runs, a sampler asks the server every ~100 ms how many requests it holds
(``llm_requests_running + llm_requests_waiting`` from GET /metrics). A server without /metrics
(stage 01) gets the client's own count instead, and the result says which one it is. Before and
after the level it reads the engine's busy seconds (``llm_engine_busy_seconds_total``, stages 02
on): their difference over the level's wall time is the engine's busy fraction, the nearest thing
a CPU server has to a GPU-utilization panel.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx
import numpy as np
from tqdm import tqdm

# Short, varied prompts: prose, code, a list, a question, non-Latin text. Requests cycle through them.
PROMPTS: list[str] = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1. Apples\n2. Bananas\n3.",
    "The three laws of thermodynamics are",
    "Q: What is the capital of France?\nA:",
    "日本の首都は",
    "SELECT name, age FROM users WHERE",
]

SAMPLE_PERIOD_S = 0.1
# Gauges that count a server's requests, summed over their labels. Ours, and vLLM's names, so that
# an outside server is measured the same way.
RUNNING_METRICS = ("llm_requests_running", "vllm:num_requests_running")
WAITING_METRICS = ("llm_requests_waiting", "vllm:num_requests_waiting")
BUSY_METRIC = "llm_engine_busy_seconds_total"  # the course's stages (02 on): seconds the engine computed

InFlightSource = Literal["server", "client"]


@dataclass
class Workload:
    """What every request of a sweep asks for. Greedy and ``ignore_eos``: each request makes exactly
    ``max_tokens`` tokens, so the work per request is the same for every stage and every run."""

    url: str  # the server's root, e.g. http://127.0.0.1:8002
    model: str | None
    max_tokens: int
    stream: bool = True
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    timeout_s: float = 900.0  # generous: at concurrency 64 a one-at-a-time server queues for minutes
    # Fields merged into every request body; a None value removes one (a peer that rejects ignore_eos).
    extra_body: dict[str, Any] = field(default_factory=dict)

    def body(self, index: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": self.prompts[index % len(self.prompts)],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": self.stream,
        }
        if self.model is not None:
            body["model"] = self.model
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        body.update(self.extra_body)
        return {key: value for key, value in body.items() if value is not None}


@dataclass
class RequestRecord:
    """One request's measurements, in seconds. Latencies are None for a failed request."""

    index: int
    start_s: float  # when it was sent, from the start of its level
    ok: bool = False
    ttft_s: float | None = None
    itl_s: float | None = None  # None without streaming (no gaps are visible) or with one chunk
    e2e_s: float | None = None
    output_tokens: int = 0
    error: str | None = None


@dataclass
class Stats:
    mean: float
    p50: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Stats | None:
        """Mean and percentiles (linear interpolation between samples), or None for no values."""
        if not values:
            return None
        p50, p99 = np.percentile(values, [50, 99])
        return cls(mean=float(np.mean(values)), p50=float(p50), p99=float(p99))


@dataclass
class InFlight:
    """How many requests were in flight during a level, and who counted them."""

    source: InFlightSource  # "server": from GET /metrics; "client": the load generator's own count
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds since level start, count)

    @property
    def mean(self) -> float | None:
        return float(np.mean([n for _, n in self.samples])) if self.samples else None

    @property
    def max(self) -> int | None:
        return max(n for _, n in self.samples) if self.samples else None


@dataclass
class LevelResult:
    concurrency: int
    wall_s: float
    records: list[RequestRecord]
    in_flight: InFlight
    engine_busy: float | None = None  # share of the level's wall time the engine spent computing (02 on)

    def summary(self) -> dict[str, Any]:
        """The level's aggregates; latencies over the requests that succeeded."""
        ok = [r for r in self.records if r.ok]
        output_tokens = sum(r.output_tokens for r in ok)

        def stats(name: str) -> dict[str, float] | None:
            s = Stats.of([getattr(r, name) for r in ok if getattr(r, name) is not None])
            return None if s is None else asdict(s)

        return {
            "concurrency": self.concurrency,
            "requests": len(self.records),
            "errors": len(self.records) - len(ok),
            "wall_s": self.wall_s,
            "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "ttft_s": stats("ttft_s"),
            "itl_s": stats("itl_s"),
            "e2e_s": stats("e2e_s"),
            "in_flight": {"source": self.in_flight.source, "mean": self.in_flight.mean, "max": self.in_flight.max},
            "engine_busy": self.engine_busy,
        }


# --- one request -------------------------------------------------------------------------------


async def send_streaming(client: httpx.AsyncClient, workload: Workload, record: RequestRecord) -> None:
    """Send one streaming request and fill in ``record`` from its server-sent events."""
    start = time.perf_counter()
    chunk_times: list[float] = []  # arrival of each chunk that carries a token, from the first text on
    async with client.stream("POST", "/v1/completions", json=workload.body(record.index)) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            event = json.loads(line[len("data: "):])
            if "error" in event:  # the stream had started when generation failed
                raise RuntimeError(event["error"].get("message", "error event in the stream"))
            if event.get("usage"):
                record.output_tokens = event["usage"]["completion_tokens"]
            choice = (event.get("choices") or [None])[0]
            # The first token the user sees is the first chunk with text (a server may send "" while
            # it holds back half a character). After that, the last chunk counts even if it is empty.
            if choice and (choice.get("text") or (chunk_times and choice.get("finish_reason"))):
                chunk_times.append(now)
    end = time.perf_counter()
    if not chunk_times:
        raise RuntimeError("the stream carried no text")
    if record.output_tokens == 0:  # counting chunks instead would undercount (a chunk may hold two tokens)
        raise RuntimeError("no usage numbers: the server ignored stream_options.include_usage")
    record.ttft_s = chunk_times[0] - start
    gaps = np.diff(chunk_times)
    record.itl_s = float(gaps.mean()) if len(gaps) else None
    record.e2e_s = end - start


async def send_whole(client: httpx.AsyncClient, workload: Workload, record: RequestRecord) -> None:
    """Send one non-streaming request. The client sees every token at once, at the end, so
    TTFT equals end-to-end latency and the gaps between tokens cannot be observed: ITL stays None
    (e2e / tokens would mix the prefill and the queueing into it, and look like a measurement)."""
    start = time.perf_counter()
    response = await client.post("/v1/completions", json=workload.body(record.index))
    end = time.perf_counter()
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
    record.output_tokens = response.json()["usage"]["completion_tokens"]
    record.ttft_s = record.e2e_s = end - start


async def run_one(client: httpx.AsyncClient, workload: Workload, record: RequestRecord) -> None:
    """Send one request; any failure becomes the record's error, so one bad request never stops a level."""
    send = send_streaming if workload.stream else send_whole
    try:
        await send(client, workload, record)
        record.ok = True
    except Exception as exc:  # noqa: BLE001 (a benchmark counts errors, it does not die of them)
        record.ttft_s = record.itl_s = record.e2e_s = None
        record.error = f"{type(exc).__name__}: {exc}"[:300]


# --- counting requests in flight ---------------------------------------------------------------


def parse_in_flight(metrics_text: str) -> int | None:
    """running + waiting from a Prometheus text page, or None if the page has neither."""
    total, found = 0.0, False
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in RUNNING_METRICS or name in WAITING_METRICS:
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return round(total) if found else None


async def server_metrics(client: httpx.AsyncClient) -> str | None:
    """The server's GET /metrics page, or None if it has none."""
    try:
        response = await client.get("/metrics", timeout=5)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


async def server_in_flight(client: httpx.AsyncClient) -> int | None:
    """The server's in-flight count, or None if it has no usable GET /metrics."""
    return None if (text := await server_metrics(client)) is None else parse_in_flight(text)


def parse_counter(metrics_text: str, name: str) -> float | None:
    """The value of an unlabelled counter in a Prometheus text page, or None if the page has none."""
    for line in metrics_text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


async def server_busy_s(client: httpx.AsyncClient) -> float | None:
    """Seconds the server's engine has spent computing since it started, or None if it does not say."""
    return None if (text := await server_metrics(client)) is None else parse_counter(text, BUSY_METRIC)


@dataclass
class ClientCount:
    """Requests this load generator has sent and not yet seen finish."""

    value: int = 0


async def sample_in_flight(client: httpx.AsyncClient, in_flight: InFlight, count: ClientCount,
                           level_start: float, done: asyncio.Event) -> None:
    """Append a sample every SAMPLE_PERIOD_S until ``done`` is set."""
    while not done.is_set():
        t = time.perf_counter() - level_start
        n = await server_in_flight(client) if in_flight.source == "server" else count.value
        if n is not None:
            in_flight.samples.append((round(t, 2), n))
        try:
            await asyncio.wait_for(done.wait(), SAMPLE_PERIOD_S)
        except TimeoutError:
            pass


# --- a level and a sweep -----------------------------------------------------------------------


def new_client(workload: Workload, concurrency: int) -> httpx.AsyncClient:
    # One connection per in-flight request, plus one for the /metrics sampler.
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    return httpx.AsyncClient(base_url=workload.url, timeout=workload.timeout_s, limits=limits)


async def run_level(workload: Workload, concurrency: int, num_requests: int, desc: str = "") -> LevelResult:
    """Send ``num_requests`` requests, at most ``concurrency`` at a time, and time each one."""
    async with new_client(workload, concurrency) as client:
        # Ask /metrics once before the load starts: a one-at-a-time server (stage 01) could not
        # answer it during the level anyway, and has none.
        source: InFlightSource = "server" if await server_in_flight(client) is not None else "client"
        busy_before = await server_busy_s(client) if source == "server" else None
        in_flight, count, done = InFlight(source), ClientCount(), asyncio.Event()
        gate = asyncio.Semaphore(concurrency)
        bar = tqdm(total=num_requests, desc=desc or f"concurrency {concurrency}", unit="req", leave=False)
        level_start = time.perf_counter()

        async def one(index: int) -> RequestRecord:
            async with gate:
                record = RequestRecord(index, start_s=time.perf_counter() - level_start)
                count.value += 1
                await run_one(client, workload, record)
                count.value -= 1
                bar.update()
                return record

        sampler = asyncio.create_task(sample_in_flight(client, in_flight, count, level_start, done))
        try:
            records = await asyncio.gather(*(one(i) for i in range(num_requests)))
            wall_s = time.perf_counter() - level_start
        finally:
            done.set()
            await sampler
            bar.close()
        # The engine's busy fraction: how much of the level it spent computing rather than waiting for work.
        busy_after = await server_busy_s(client) if busy_before is not None else None
        engine_busy = None if busy_after is None else min(1.0, (busy_after - busy_before) / wall_s)
    return LevelResult(concurrency, wall_s, list(records), in_flight, engine_busy)


async def run_sweep(workload: Workload, levels: list[int], requests_per_level: int,
                    label: str = "") -> list[LevelResult]:
    """Run the levels one after the other, printing a one-line summary after each."""
    results = []
    for concurrency in levels:
        level = await run_level(workload, concurrency, requests_per_level, desc=f"{label} c={concurrency}".strip())
        results.append(level)
        tqdm.write(format_summary(level.summary()))
    return results


def format_summary(s: dict[str, Any]) -> str:
    def ms(stats: dict[str, float] | None) -> str:
        return "   n/a" if stats is None else f"{1000 * stats['mean']:6.0f}"

    return (f"concurrency {s['concurrency']:3d}: {s['output_tokens_per_s']:7.1f} tok/s, "
            f"TTFT {ms(s['ttft_s'])} ms, ITL {ms(s['itl_s'])} ms, e2e {ms(s['e2e_s'])} ms, "
            f"in flight {s['in_flight']['mean'] or 0:5.1f} ({s['in_flight']['source']}), "
            + ("" if s.get("engine_busy") is None else f"engine busy {100 * s['engine_busy']:3.0f}%, ")
            + f"errors {s['errors']}")


async def probe_streaming(url: str, model: str | None, extra_body: dict[str, Any] | None = None) -> bool:
    """Send one small streaming request: True if the server streams, False if it answers 400
    (stage 01 cannot stream)."""
    workload = Workload(url, model, max_tokens=2, stream=True, extra_body=extra_body or {})
    async with new_client(workload, 1) as client:
        async with client.stream("POST", "/v1/completions", json=workload.body(0)) as response:
            await response.aread()
    if response.status_code == 400:
        return False
    response.raise_for_status()
    return True


async def warm_up(workload: Workload) -> None:
    """One unmeasured request: the first one pays for lazy set-up (memory, kernel choices) that
    would otherwise land in the first level's numbers."""
    record = RequestRecord(0, start_s=0.0)
    async with new_client(workload, 1) as client:
        await run_one(client, workload, record)
    if not record.ok:
        raise RuntimeError(f"the warm-up request failed: {record.error}")
