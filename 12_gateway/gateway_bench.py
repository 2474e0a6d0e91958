"""Stage 12 measured: what the gateway's routers, autoscaler and queue do, and what its hop costs.

    python -m 12_gateway.gateway_bench routers      # prefix-aware routing against Ray Serve's default
    python -m 12_gateway.gateway_bench autoscale    # a load step up and down: the second replica comes and goes
    python -m 12_gateway.gateway_bench streams      # 2,000 streams at once; chats beside a burst of long prompts
    python -m 12_gateway.gateway_bench hop          # one request at a time: a server alone, then behind the gateway
    python -m 12_gateway.gateway_bench flood        # 3,000 requests at once while /health is probed every 0.2 s
    python -m 12_gateway.gateway_bench routers --quick   # any part, CI-sized, into results/quick/<device>/

Each part starts its own fleet (``fleet.start``: a local Ray instance, the replicas, the gateway), sends
its load through the gateway's OpenAI endpoint as streaming chat requests, stops the fleet, and writes
``results/<device>/12_gateway_<part>.json`` (with a figure beside it, ``.png``, except for ``hop``).

- **routers**: several system prompts, many questions after each, on 2 replicas. Ray Serve's default
  router (the less loaded of two at random) sends every system prompt to both replicas, so each prefills
  it; the prefix router keeps a system prompt on the replica that has it cached. Per router: the prefix
  cache's hit rate (cached prompt tokens over prompt tokens, from each answer's ``usage``), TTFT, the
  requests each replica got (``x-replica``) and output tokens/s. Each router gets a fresh fleet, so both
  start with cold caches. Twice: with fewer clients than the replicas hold, then with more clients than
  their slots (a few ``max_ongoing_requests`` each), so that requests wait at the gateway, where Ray Serve
  decides which waiting request gets a replica with room.
- **autoscale**: many clients at once for a while, then none, against one model of 1 to 2 replicas;
  ``/health`` every 0.5 s gives the replicas by state and the requests in flight. How long after the load
  starts the second replica is STARTING and then RUNNING (its model loaded and warmed up), and how long
  after the load ends the fleet is back to one.
- **streams**: thousands of streaming clients at once on 2 replicas, far more than their
  ``max_ongoing_requests``: the gateway must queue them, not refuse them. Counts the complete answers
  (``[DONE]`` after a ``finish_reason``) and the errors by status. Then chats through ``"model": "auto"``
  while a burst of long prompts arrives that the difficulty rule sends to the large model: the chats'
  TTFT and inter-token gaps with and without the burst.
- **hop**: the cost of the gateway's extra hops (Ray Serve's proxy, the gateway, the replica's actor):
  the same requests one at a time to a server alone (stage 09's, as the committed file was measured;
  its records keep the label "stage 10 alone") and to a gateway with one replica (stage 11's engine),
  alternating between them; TTFT and inter-token latency, p50.
- **flood**: far more requests at once than the fleet holds (3 replicas of 96 slots, 256 queued at the
  gateway), so that most are refused at once with 503: the gateway's busiest moment. Meanwhile a liveness
  probe's ``/health`` every 0.2 s on each of two paths, the main port and the probe port (``--health-port``,
  probe_server.py), each on a new connection and none waiting for the one before: the slowest, p99 and p50
  probe of each, against the 1 s a probe may take, and what the requests got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import shlex
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from common.bench import (
    RESULTS,
    device_and_dtype,
    dumps,
    exit_on_sigterm,
    git_state,
    machine_info,
    stage_command,
    stage_server,
)
from common.cli import served_name
from common.loadgen import CHARS_PER_TOKEN, SYSTEM_SENTENCES, RequestRecord, Stats, Workload, run_level, warm_up
from common.mixed import MixedWorkload
from common.net import free_port
from common.weights import DEFAULT_MODEL, resolve_model

from .config import EngineConfig
from .fleet import ModelSpec, model_specs, start, stop
from .gateway_config import GatewayConfig

STAGE = __package__  # this stage's folder, 12_gateway (or a later stage's, in its copy)
HEALTH_PERIOD_S = 0.5

# The questions after each system prompt. None holds two of routing.py's markers of a hard prompt, so through
# "auto" every one of them goes to the small model.
QUESTIONS = [
    "When are you open on Saturdays?", "How long does standard delivery take?", "Can I return a used kettle?",
    "How much does express delivery cost?", "Is my toaster still under warranty?", "How do I cancel ACME Plus?",
    "Do gift cards expire?", "Can I pay by bank transfer?", "My blender smells of smoke, what now?",
    "Where do I find my invoice?", "Do you sell spare parts for old models?", "Can I combine two promo codes?",
    "How do I ask for my personal data?", "Is the packaging recyclable?", "When will the red mixer be back?",
    "Can I talk to a human agent?",
]
DESKS = ["kitchen appliances", "garden tools", "small electronics", "business customers"]


# --- the workloads, full and quick ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoutersLoad:
    """The regime where a router matters: more system prompts than one replica's cache holds beside its running
    sequences, but no more than the two caches hold together (a pool of ``kv_cache_mb`` per replica, about 3,500
    tokens: some 10 prompts of 350 tokens). With fewer prompts, every cache holds them all and Ray Serve's router
    only pays one miss per prompt and replica; with many more, both routers miss.

    At least as many system prompts as clients: a prompt's next question is sent after its first one has
    been answered, when a replica holds the prompt in its cache. (Questions after one prompt that nobody has
    cached, sent at once, all miss whatever the router: that first wave measures no router.)

    Then the same requests with a queue at the gateway: ``queued_clients`` in flight, more than the replicas'
    slots together (``queued_slots`` each), as in any burst. Ray Serve then decides which waiting request gets a
    replica that has room, a decision that can undo the router's."""

    system_prompts: int = 16  # distinct system prompts, one per desk
    system_tokens: int = 350  # about this long each
    questions: int = 6  # per system prompt
    clients: int = 8  # requests in flight at once: far fewer than the replicas hold (96 each), no queue
    max_tokens: int = 16
    kv_cache_mb: int = 160  # each replica's pool: 45 KiB per token of SmolLM2-135M in float32
    queued_clients: int = 16  # twice the slots below: about half of them wait at the gateway
    queued_slots: int = 4  # each replica's max_ongoing_requests in the queued runs


@dataclass(frozen=True)
class AutoscaleLoad:
    clients: int = 128  # more than one replica's max_ongoing_requests (96): requests queue
    load_s: float = 60.0
    max_tokens: int = 32
    idle_before_s: float = 2.0  # /health polled with no load, before the step
    settle_s: float = 60.0  # after the load, the longest wait for the fleet to shrink back to one


@dataclass(frozen=True)
class StreamsLoad:
    clients: int = 2000  # streams at once, one request each
    max_tokens: int = 8
    chats: int = 8  # chat clients of the burst variant, each one request after another
    chat_tokens: int = 32
    lead_in_s: float = 20.0  # chats alone, before the burst
    burst: int = 8  # long prompts sent at once
    burst_tokens: tuple[int, int] = (700, 900)  # their length, over GatewayConfig.long_prompt_tokens (512)
    burst_max_tokens: int = 8


@dataclass(frozen=True)
class HopLoad:
    requests: int = 20  # to each server, one at a time
    max_tokens: int = 16
    rounds: int = 4  # the requests alternate between the two servers in this many rounds


@dataclass(frozen=True)
class FloodLoad:
    requests: int = 3000  # at once, one request each: far past 3 x 96 slots and 256 queued, most are refused
    max_tokens: int = 8
    max_queued_requests: int = 256  # per model at the gateway: a short queue, so that the refusals come at once
    probe_period_s: float = 0.2  # a /health probe starts this often, whether or not the last one has answered
    probe_timeout_s: float = 60.0  # a probe unanswered after this long is counted as unanswered, not timed
    lead_in_s: float = 2.0  # probes on the idle fleet, before the flood


FULL = {"routers": RoutersLoad(), "autoscale": AutoscaleLoad(), "streams": StreamsLoad(), "hop": HopLoad(),
        "flood": FloodLoad()}
QUICK = {"routers": RoutersLoad(system_prompts=8, questions=3, clients=4, max_tokens=8, kv_cache_mb=96,
                                queued_clients=8, queued_slots=2),
         "autoscale": AutoscaleLoad(load_s=35.0, max_tokens=16, settle_s=30.0),
         "streams": StreamsLoad(clients=200, chats=4, chat_tokens=16, lead_in_s=8.0, burst=3, burst_tokens=(600, 700)),
         "hop": HopLoad(requests=6, max_tokens=8, rounds=2), "flood": FloodLoad(requests=600)}


# --- one streamed chat request, as the client sees it ------------------------------------------------------------


@dataclass
class Answer:
    """One streamed request; times in seconds from the start of the run."""

    sent_s: float
    status: int | None = None  # None: no HTTP response at all (the connection failed)
    model: str = ""  # the gateway's x-model, x-replica and x-route headers
    replica: str = ""
    route: str = ""
    chunks_s: list[float] = field(default_factory=list)  # when each chunk with text arrived
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, found in the replica's prefix cache
    completion_tokens: int = 0
    finish_reason: str | None = None
    done: bool = False  # the stream ended with data: [DONE]
    error: str | None = None

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.done and self.finish_reason is not None and self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunks_s[0] - self.sent_s if self.chunks_s else None

    def gaps(self) -> list[tuple[float, float]]:
        """(when it ended, length) of every gap between two chunks."""
        return [(b, b - a) for a, b in pairwise(self.chunks_s)]


def chat_body(model: str, content: str, max_tokens: int, system: str = "") -> dict[str, Any]:
    """A greedy streaming chat request that makes exactly ``max_tokens`` tokens and reports its usage."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def chat_stream(client: httpx.AsyncClient, body: dict[str, Any], t0: float) -> Answer:
    """Send one streaming chat request and record its answer; a failure is recorded, never raised."""
    answer = Answer(sent_s=time.perf_counter() - t0)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            answer.status = response.status_code
            answer.model, answer.replica, answer.route = (response.headers.get(f"x-{name}", "")
                                                          for name in ("model", "replica", "route"))
            if response.status_code != 200:
                answer.error = (await response.aread()).decode(errors="replace")[:200]
                return answer
            async for line in response.aiter_lines():
                now = time.perf_counter() - t0
                if line == "data: [DONE]":
                    answer.done = True
                elif line.startswith("data: "):
                    record_event(answer, json.loads(line.removeprefix("data: ")), now)
    except httpx.HTTPError as exc:
        answer.error = f"{type(exc).__name__}: {exc}"[:200]
    return answer


def record_event(answer: Answer, event: dict[str, Any], now: float) -> None:
    if "error" in event:  # the stream had started when the replica failed
        answer.error = event["error"].get("message", "an error event")
    if usage := event.get("usage"):
        answer.prompt_tokens, answer.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        answer.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    for choice in event.get("choices") or []:
        # The first chunk the user sees is the first with text; after it, the last one counts even if empty.
        if choice["delta"].get("content") or (answer.chunks_s and choice.get("finish_reason")):
            answer.chunks_s.append(now)
        answer.finish_reason = choice.get("finish_reason") or answer.finish_reason


def new_client(url: str, connections: int) -> httpx.AsyncClient:
    """One connection per stream in flight, and one for /health; no timeout: a queued stream may wait long."""
    limits = httpx.Limits(max_connections=connections + 1, max_keepalive_connections=connections + 1)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(None, connect=60.0))


async def send_all(client: httpx.AsyncClient, bodies: list[dict[str, Any]], concurrency: int,
                   t0: float) -> list[Answer]:
    """Every request, at most ``concurrency`` in flight (a closed loop: one ends, the next starts)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(body: dict[str, Any]) -> Answer:
        async with gate:
            return await chat_stream(client, body, t0)

    return list(await asyncio.gather(*(one(body) for body in bodies)))


async def keep_sending(client: httpx.AsyncClient, clients: int, body: Callable[[int], dict[str, Any]],
                       until: asyncio.Event, t0: float, stagger_s: float = 0.0) -> list[Answer]:
    """``clients`` clients, each sending one request after another until ``until`` is set (client k starts
    ``k * stagger_s`` late); every answer."""
    answers: list[Answer] = []

    async def one_client(k: int) -> None:
        await asyncio.sleep(k * stagger_s)
        while not until.is_set():
            answers.append(await chat_stream(client, body(len(answers)), t0))

    await asyncio.gather(*(one_client(k) for k in range(clients)))
    return answers


async def poll_health(client: httpx.AsyncClient, model: str, t0: float, until: asyncio.Event,
                      samples: list[dict[str, Any]]) -> None:
    """Every HEALTH_PERIOD_S until ``until`` is set: the model's replicas by state and its requests in flight
    at the gateway (in a replica's batch or queue, or waiting at the gateway for one)."""
    while not until.is_set():
        t = round(time.perf_counter() - t0, 2)
        try:
            health = (await client.get("/health", timeout=10)).json()["models"][model]
            samples.append({"t": t, "replicas": health["replicas"], "in_flight": health["in_flight"]})
        except (httpx.HTTPError, ValueError, KeyError):
            pass  # a slow or failed poll is a missing sample
        try:
            await asyncio.wait_for(until.wait(), HEALTH_PERIOD_S)
        except TimeoutError:
            pass


# --- summaries ---------------------------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    p50, p90 = np.percentile(values, [50, 90])
    return {"p50": float(p50), "p90": float(p90)}


def errors_by_status(answers: list[Answer]) -> dict[str, int]:
    """Failed answers by HTTP status; "connection" for no response, "stream" for a 200 that did not end well."""
    def why(answer: Answer) -> str:
        return "connection" if answer.status is None else "stream" if answer.status == 200 else str(answer.status)

    return dict(Counter(why(answer) for answer in answers if not answer.complete))


def summarize(answers: list[Answer], wall_s: float) -> dict[str, Any]:
    """What a set of answers shows: complete ones and errors, TTFT, every gap between tokens, throughput,
    the prefix cache's hit rate over their prompts, and the replicas that answered (by how many requests)."""
    ok = [answer for answer in answers if answer.complete]
    prompt_tokens = sum(answer.prompt_tokens for answer in ok)
    return {
        "requests": len(answers),
        "complete": len(ok),
        "errors": errors_by_status(answers),
        "wall_s": wall_s,
        "ttft_s": percentiles([answer.ttft_s for answer in ok if answer.ttft_s is not None]),
        "itl_s": percentiles([gap for answer in ok for _, gap in answer.gaps()]),
        "output_tokens_per_s": sum(answer.completion_tokens for answer in ok) / wall_s if wall_s > 0 else 0.0,
        "prefix_cache_hit_rate": sum(answer.cached_tokens for answer in ok) / prompt_tokens if prompt_tokens else None,
        "per_replica": dict(Counter(answer.replica for answer in ok).most_common()),
        "per_model": dict(Counter(f"{answer.model} ({answer.route})" for answer in ok)),
    }


def percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.0f}%"


def ms(stats: dict[str, float] | None) -> str:
    return "n/a" if stats is None else f"p50 {1000 * stats['p50']:.0f} ms, p90 {1000 * stats['p90']:.0f} ms"


# --- the fleet ---------------------------------------------------------------------------------------------------


@contextmanager
def fleet_running(specs: list[ModelSpec], fleet: GatewayConfig, health_port: int | None = None) -> Iterator[str]:
    """The fleet, started for the block (its URL), stopped after it whatever happens; Ray with it. With
    ``health_port``, /health on that port too (probe_server.py)."""
    started = time.perf_counter()
    try:
        url = start(specs, fleet, port=free_port(), health_port=health_port)
        print(f"Fleet up at {url} in {time.perf_counter() - started:.0f} s: "
              f"{', '.join(spec.name for spec in specs)}; {fleet.min_replicas} to {fleet.max_replicas} replicas "
              f"each, router {fleet.router}", flush=True)
        yield url
    finally:
        stop()


def configs(args: argparse.Namespace, kv_cache_mb: int = 0, **fleet: Any) -> tuple[EngineConfig, GatewayConfig]:
    """The replicas' engine (stage 11's defaults, ``--quantization auto`` among them, but no speculative
    decoding: a shorter start-up; ``kv_cache_mb`` its pool, 0 the default) and the fleet (``fleet``:
    GatewayConfig's fields). Every part runs at most 2 engines at once: on a GPU, they share it, each replica with
    half of it for Ray and a pool of 0.45 of its half's memory less its weights (``fleet.shared_kv_cache_mb``)."""
    cuda = args.device == "cuda"
    engine = EngineConfig(model=str(resolve_model(args.model)), device=args.device, dtype=args.dtype,
                          speculative="off", gpu_memory_utilization=0.45 if cuda else 0.9, kv_cache_mb=kv_cache_mb)
    return engine, GatewayConfig(replica_gpus=0.5 if cuda else 0.0, **fleet)


def raise_open_files(needed: int) -> None:
    """Every stream holds a socket: raise this process's limit on open files towards ``needed``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else min(hard, needed),
                                                    hard))


# --- routers -----------------------------------------------------------------------------------------------------


def system_prompt(desk: int, tokens: int) -> str:
    """Desk ``desk``'s system prompt, about ``tokens`` tokens: its own first sentence (so that no two share a
    block), then the course's policy sentences, starting at a different one for each desk."""
    sentences = [f"You are the assistant of ACME's {DESKS[desk % len(DESKS)]} desk (desk {desk + 1})."]
    offset = 7 * desk
    while len(" ".join(sentences)) < tokens * CHARS_PER_TOKEN:
        sentences.append(SYSTEM_SENTENCES[(offset + len(sentences)) % len(SYSTEM_SENTENCES)])
    return " ".join(sentences)


def routers(args: argparse.Namespace) -> dict[str, Any]:
    """The shared-prefix workload, once per router without a queue at the gateway and once with one, each run on
    a fresh fleet of 2 replicas."""
    load: RoutersLoad = args.load
    engine, _ = configs(args, kv_cache_mb=load.kv_cache_mb)
    model = served_name(engine.model)
    systems = [system_prompt(desk, load.system_tokens) for desk in range(load.system_prompts)]
    # Question by question, each desk in turn: a desk's next question comes once every other desk has had one.
    bodies = [chat_body(model, question, load.max_tokens, system) for question in QUESTIONS[:load.questions]
              for system in systems]
    order = ["prefix", "pow2"] if args.first == "prefix" else ["pow2", "prefix"]
    runs = {router: router_run(args, engine, bodies, router, queued=False) for router in order}
    queued_runs = {router: router_run(args, engine, bodies, router, queued=True) for router in order}
    return {"workload": {**asdict(load), "system_prompt_texts": systems, "question_texts": QUESTIONS[:load.questions]},
            "order": order, "runs": runs, "queued_runs": queued_runs}


def router_run(args: argparse.Namespace, engine: EngineConfig, bodies: list[dict[str, Any]], router: str,
               queued: bool) -> dict[str, Any]:
    """The requests through ``router`` on a fresh fleet of 2 replicas; ``queued``: with fewer slots than clients."""
    load: RoutersLoad = args.load
    slots = {"max_ongoing_requests": load.queued_slots} if queued else {}
    _, fleet = configs(args, kv_cache_mb=load.kv_cache_mb, router=router, min_replicas=2, max_replicas=2,
                       replica_cpus=1, **slots)
    clients = load.queued_clients if queued else load.clients
    with fleet_running(model_specs(engine, fleet, None), fleet) as url:
        run = asyncio.run(measure_all(url, served_name(engine.model), bodies, clients))
    run["slots"] = 2 * fleet.max_ongoing_requests
    print(f"{router}, {clients} clients on {run['slots']} slots: prefix cache hits "
          f"{percent(run['prefix_cache_hit_rate'])}, TTFT {ms(run['ttft_s'])}, {run['output_tokens_per_s']:.1f} "
          f"tokens/s, requests per replica {list(run['per_replica'].values())}, at most {run['most_in_flight']} in "
          f"flight, errors {run['errors']}", flush=True)
    return run


async def measure_all(url: str, model: str, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """The requests, ``concurrency`` at a time, and the most of them in flight at the gateway meanwhile (beyond
    the replicas' slots, they wait at the gateway)."""
    samples: list[dict[str, Any]] = []
    done = asyncio.Event()
    async with new_client(url, concurrency) as client:
        t0 = time.perf_counter()
        poller = asyncio.create_task(poll_health(client, model, t0, done, samples))
        answers = await send_all(client, bodies, concurrency, t0)
        wall_s = time.perf_counter() - t0
        done.set()
        await poller
    return summarize(answers, wall_s) | {"most_in_flight": max((s["in_flight"] for s in samples), default=0)}


def plot_routers(result: dict[str, Any], out: Path) -> None:
    """Per router, a bar for each regime (no queue, a queue at the gateway): hit rate, TTFT, requests per replica."""
    load = result["workload"]
    regimes = {f"no queue ({load['clients']} clients)": result["runs"],
               f"queue ({load['queued_clients']} clients, {2 * load['queued_slots']} slots)": result["queued_runs"]}
    names = result["order"]
    fig = Figure(figsize=(14, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    hits, ttft, replicas = fig.subplots(1, 3)
    width = 0.8 / len(regimes)
    for i, (regime, runs) in enumerate(regimes.items()):
        x = np.arange(len(names)) + width * i
        hits.bar(x, [100 * runs[name]["prefix_cache_hit_rate"] for name in names], width, label=regime,
                 color=f"C{i}")
        ttft.bar(x, [1000 * runs[name]["ttft_s"]["p50"] for name in names], width, label=f"p50, {regime}",
                 color=f"C{i}")
        ttft.scatter(x, [1000 * runs[name]["ttft_s"]["p90"] for name in names], marker="_", s=400, color="black",
                     label="p90" if i == 0 else None, zorder=3)
        for k, name in enumerate(names):
            bottom = 0
            for j, count in enumerate(runs[name]["per_replica"].values()):  # the busier replica below
                replicas.bar(x[k], count, width, bottom=bottom, color=f"C{i}", alpha=1 - 0.4 * j, edgecolor="white",
                             label=regime if k == j == 0 else None)
                bottom += count
    for ax in (hits, ttft, replicas):
        ax.set_xticks(np.arange(len(names)) + width * (len(regimes) - 1) / 2, names)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    hits.set(title="Prefix-cache hit rate", ylabel="% of prompt tokens cached", ylim=(0, 100))
    ttft.set(title="Time to first token", ylabel="ms")
    replicas.set(title="Requests per replica (stacked)", ylabel="requests")
    fig.suptitle(f"Routers on 2 replicas: {load['system_prompts']} system prompts of ~{load['system_tokens']} tokens, "
                 f"{load['questions']} questions each ({result['device']}; {names[0]} ran first in each regime)")
    fig.savefig(out, dpi=110)


# --- autoscale ---------------------------------------------------------------------------------------------------


def autoscale(args: argparse.Namespace) -> dict[str, Any]:
    """A load step against one model of 1 to 2 replicas, and the fleet's answer to it over time."""
    load: AutoscaleLoad = args.load
    engine, fleet = configs(args, min_replicas=1, max_replicas=2, replica_cpus=1, upscale_delay_s=1.0,
                            downscale_delay_s=5.0)
    with fleet_running(model_specs(engine, fleet, None), fleet) as url:
        samples, answers, (load_start, drained) = asyncio.run(step_load(url, served_name(engine.model), load))
    events = scaling_events(samples, load_start, drained)
    print(f"After the load started: a second replica STARTING at +{fmt(events['second_starting_s'])} s, RUNNING at "
          f"+{fmt(events['second_running_s'])} s. After the last answer: one replica STOPPING at "
          f"+{fmt(events['scale_down_s'])} s, gone at +{fmt(events['back_to_one_s'])} s", flush=True)
    return {"workload": asdict(load), "gateway": asdict(fleet), "load_window_s": [load_start, load_start + load.load_s],
            "drained_s": drained, **events, "requests": summarize(answers, drained - load_start), "timeline": samples}


async def step_load(url: str, model: str, load: AutoscaleLoad) -> tuple[list[dict[str, Any]], list[Answer],
                                                                        tuple[float, float]]:
    """Poll /health throughout: idle, then ``clients`` clients sending for ``load_s`` (each then finishes the
    request it is in), then idle again until the fleet is back to one replica (or ``settle_s`` has passed).
    Returns the samples, the answers, when the load started and when its last answer came."""
    samples: list[dict[str, Any]] = []
    polling_done, load_done = asyncio.Event(), asyncio.Event()
    async with new_client(url, load.clients) as client:
        t0 = time.perf_counter()
        poller = asyncio.create_task(poll_health(client, model, t0, polling_done, samples))
        await asyncio.sleep(load.idle_before_s)
        load_start = time.perf_counter() - t0
        asyncio.get_running_loop().call_later(load.load_s, load_done.set)
        answers = await keep_sending(client, load.clients, lambda i: chat_body(
            model, QUESTIONS[i % len(QUESTIONS)], load.max_tokens), load_done, t0)
        drained = time.perf_counter() - t0
        while time.perf_counter() - t0 < drained + load.settle_s and not (
                samples and samples[-1]["t"] > drained and replicas(samples[-1]) == 1):
            await asyncio.sleep(HEALTH_PERIOD_S)
        await asyncio.sleep(2.0)  # a few samples of the fleet at rest
        polling_done.set()
        await poller
    return samples, answers, (round(load_start, 2), round(drained, 2))


def replicas(sample: dict[str, Any], state: str | None = None) -> int:
    """The sample's replicas in ``state`` (in any state if None)."""
    return sum(count for name, count in sample["replicas"].items() if state is None or name == state)


def scaling_events(samples: list[dict[str, Any]], load_start: float, drained: float) -> dict[str, float | None]:
    """Seconds from the load's start to the first sample with a second replica (in any state: STARTING) and with
    two RUNNING; from the last answer to the first sample with one RUNNING (the other STOPPING) and with one
    replica in all."""
    def first(after: float, condition: Callable[[dict[str, Any]], bool]) -> float | None:
        return next((round(s["t"] - after, 2) for s in samples if s["t"] >= after and condition(s)), None)

    return {"second_starting_s": first(load_start, lambda s: replicas(s) >= 2),
            "second_running_s": first(load_start, lambda s: replicas(s, "RUNNING") >= 2),
            "scale_down_s": first(drained, lambda s: replicas(s, "RUNNING") == 1),
            "back_to_one_s": first(drained, lambda s: replicas(s) == 1)}


def fmt(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f}"


def plot_autoscale(result: dict[str, Any], out: Path) -> None:
    samples = result["timeline"]
    t = [s["t"] for s in samples]
    fig = Figure(figsize=(11, 6), layout="constrained")
    FigureCanvasAgg(fig)
    fleet, flight = fig.subplots(2, 1, sharex=True)
    fleet.step(t, [replicas(s, "RUNNING") for s in samples], where="post", label="RUNNING", color="C0")
    fleet.step(t, [replicas(s) for s in samples], where="post", label="any state (STARTING, STOPPING...)",
               color="C1", linestyle="--")
    fleet.set(ylabel="replicas", title="Replicas of the model", ylim=(0, 2.5))
    flight.plot(t, [s["in_flight"] for s in samples], color="C2")
    flight.axhline(result["gateway"]["max_ongoing_requests"], color="grey", linestyle=":",
                   label="one replica's max_ongoing_requests")
    flight.set(xlabel="seconds", ylabel="requests", title="Requests in flight at the gateway", ylim=(0, None))
    start_s, end_s = result["load_window_s"]
    for ax in (fleet, flight):
        ax.axvspan(start_s, end_s, color="grey", alpha=0.1, label="clients sending")
        ax.axvline(result["drained_s"], color="grey", linewidth=0.8, label="the last answer")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    load = result["workload"]
    fig.suptitle(f"Autoscaling: {load['clients']} clients for {load['load_s']:g} s ({result['device']}); "
                 f"second replica STARTING +{fmt(result['second_starting_s'])} s, "
                 f"RUNNING +{fmt(result['second_running_s'])} s; back to one {fmt(result['back_to_one_s'])} s "
                 "after the last answer")
    fig.savefig(out, dpi=110)


# --- streams -----------------------------------------------------------------------------------------------------


def streams(args: argparse.Namespace) -> dict[str, Any]:
    """Many streams at once on 2 replicas; then chats beside a burst of long prompts on a small and a large model."""
    load: StreamsLoad = args.load
    raise_open_files(2 * load.clients + 256)
    engine, fleet = configs(args, min_replicas=2, max_replicas=2, replica_cpus=1)
    model = served_name(engine.model)
    with fleet_running(model_specs(engine, fleet, None), fleet) as url:
        many, samples = asyncio.run(all_at_once(url, model, load))
    print(f"{load.clients} streams at once: {many['complete']} complete, errors {many['errors']}, TTFT "
          f"{ms(many['ttft_s'])}, at most {max((s['in_flight'] for s in samples), default=0)} in flight at the "
          f"gateway", flush=True)
    # The large model is the same folder: a second deployment, with replicas of its own.
    _, burst_fleet = configs(args, min_replicas=1, max_replicas=1, replica_cpus=1)
    specs = model_specs(engine, burst_fleet, engine.model)
    # The same burst twice: through "auto" (the rule sends it to the large model's replica), then named to the
    # small model, whose replica the chats use: the isolation the rule buys, against none.
    with fleet_running(specs, burst_fleet) as url:
        burst = asyncio.run(chats_and_burst(url, load, "auto"))
        shared = asyncio.run(chats_and_burst(url, load, specs[0].name))
    for label, run in (("isolated", burst), ("shared", shared)):
        print(f"Chats without the burst ({label}): TTFT {ms(run['chats_alone']['ttft_s'])}, ITL "
              f"{ms(run['chats_alone']['itl_s'])}\nChats during the burst ({label}):  TTFT "
              f"{ms(run['chats_in_burst']['ttft_s'])}, ITL {ms(run['chats_in_burst']['itl_s'])}\nThe burst went to "
              f"{run['burst']['per_model']}", flush=True)
    models = {spec.name: {"size": spec.size, "folder": spec.engine.model} for spec in specs}
    note = ("the large model is the small model's own folder, served by a deployment of its own: its replicas are "
            "separate processes, but compute no more per token")
    return {"workload": asdict(load), "many_streams": {**many, "gateway": asdict(fleet), "timeline": samples},
            "burst": {"models": models, "note": note, **burst},
            "burst_shared": {"models": models, "note": "the same burst, named to the chats' own (small) model",
                             **shared}}


async def all_at_once(url: str, model: str, load: StreamsLoad) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    samples: list[dict[str, Any]] = []
    done = asyncio.Event()
    bodies = [chat_body(model, QUESTIONS[i % len(QUESTIONS)], load.max_tokens) for i in range(load.clients)]
    async with new_client(url, load.clients) as client:
        t0 = time.perf_counter()
        poller = asyncio.create_task(poll_health(client, model, t0, done, samples))
        answers = await send_all(client, bodies, load.clients, t0)
        wall_s = time.perf_counter() - t0
        done.set()
        await poller
    summary = summarize(answers, wall_s)
    summary["error_examples"] = sorted({answer.error for answer in answers if answer.error})[:5]
    return summary, samples


async def chats_and_burst(url: str, load: StreamsLoad, burst_model: str) -> dict[str, Any]:
    """Chat clients through "auto" (short prompts: the small model); after ``lead_in_s``, ``burst`` long
    prompts at once to ``burst_model`` ("auto": the rule sends them to the large model; the small model's
    name: beside the chats); the chats stop once every long prompt has its answer.
    The burst's window runs from sending the long prompts to their last answer: a chat's TTFT (its wait for
    its first token) or gap between two tokens that overlaps it is "in the burst"; one that ends before it,
    "alone"."""
    chats_done = asyncio.Event()
    long = MixedWorkload(long_tokens=load.burst_tokens, seed=1)
    async with new_client(url, load.chats + load.burst) as client:
        t0 = time.perf_counter()
        chats = asyncio.create_task(keep_sending(client, load.chats, lambda i: chat_body(
            "auto", QUESTIONS[i % len(QUESTIONS)], load.chat_tokens), chats_done, t0, stagger_s=0.25))
        await asyncio.sleep(load.lead_in_s)
        begin = time.perf_counter() - t0
        burst = await send_all(client, [chat_body(burst_model, long.long_prompt(i), load.burst_max_tokens)
                                        for i in range(load.burst)], load.burst, t0)
        end = time.perf_counter() - t0
        chats_done.set()
        answers = await chats
        chats_wall_s = time.perf_counter() - t0
    ok = [answer for answer in answers if answer.complete and answer.chunks_s]

    def in_burst(start: float, stop: float) -> bool:
        return start <= end and stop >= begin

    def chat_stats(ttfts: list[float], gaps: list[float]) -> dict[str, Any]:
        return {"requests": len(ttfts), "ttft_s": percentiles(ttfts), "itl_s": percentiles(gaps)}

    alone = chat_stats([a.ttft_s for a in ok if a.chunks_s[0] < begin],
                       [gap for a in ok for when, gap in a.gaps() if when < begin])
    during = chat_stats([a.ttft_s for a in ok if in_burst(a.sent_s, a.chunks_s[0])],
                        [gap for a in ok for when, gap in a.gaps() if in_burst(when - gap, when)])
    return {"window_s": [round(begin, 2), round(end, 2)], "chats": summarize(answers, chats_wall_s),
            "chats_alone": alone, "chats_in_burst": during,
            "burst": summarize(burst, end - begin),
            "chat_gaps": [[round(when, 3), round(gap, 4)] for a in ok for when, gap in a.gaps()],
            "burst_ttfts": [[round(a.sent_s, 2), round(a.ttft_s, 3)] for a in burst if a.ttft_s is not None]}


def plot_streams(result: dict[str, Any], out: Path) -> None:
    many, burst = result["many_streams"], result["burst"]
    fig = Figure(figsize=(13, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    queue, gaps = fig.subplots(1, 2)
    queue.plot([s["t"] for s in many["timeline"]], [s["in_flight"] for s in many["timeline"]], color="C0")
    queue.axhline(2 * many["gateway"]["max_ongoing_requests"], color="grey", linestyle=":",
                  label="2 replicas x max_ongoing_requests")
    queue.set(xlabel="seconds", ylabel="requests in flight at the gateway", ylim=(0, None),
              title=f"{many['requests']} streams at once: {many['complete']} complete, errors {many['errors'] or 0}")
    queue.legend(fontsize=8)
    runs = ((burst, "C0", "to the large model"), (result["burst_shared"], "C3", "to the chats' model"))
    for run, color, label in runs:  # each run's clock starts at its own first chat: the two overlay
        when, gap = zip(*run["chat_gaps"], strict=True) if run["chat_gaps"] else ((), ())
        gaps.scatter(when, [1000 * g for g in gap], s=4, alpha=0.5, color=color,
                     label=f"a chat's gap between tokens, the burst {label}")
        gaps.axvspan(*run["window_s"], color=color, alpha=0.08)
    gaps.set(yscale="log", xlabel="seconds", ylabel="ms", title="Chats through 'auto' while long prompts arrive "
             "(shaded: the burst)")
    gaps.legend(fontsize=8, markerscale=3)
    for ax in (queue, gaps):
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Streams through the gateway ({result['device']})")
    fig.savefig(out, dpi=110)


# --- hop ---------------------------------------------------------------------------------------------------------


def hop(args: argparse.Namespace) -> dict[str, Any]:
    """A server alone (stage 09's) and the gateway with one replica (stage 11's engine), up together, measured
    in turn."""
    load: HopLoad = args.load
    # As many PyTorch threads in the replica as the server alone takes by default.
    engine, fleet = configs(args, min_replicas=1, max_replicas=1, replica_cpus=float(torch.get_num_threads()))
    model = served_name(engine.model)
    port = free_port()
    alone_url = f"http://127.0.0.1:{port}"
    command = stage_command("09", port, engine.model, engine.device, engine.dtype) + [
        "--speculative", "off", "--gpu-memory-utilization", str(engine.gpu_memory_utilization)]
    records: dict[str, list[RequestRecord]] = {"stage 10 alone": [], "gateway, 1 replica": []}
    with stage_server(command, alone_url), fleet_running(model_specs(engine, fleet, None), fleet) as gateway_url:
        urls = dict(zip(records, (alone_url, gateway_url), strict=True))
        workloads = {label: Workload(url, model, load.max_tokens) for label, url in urls.items()}
        for workload in workloads.values():
            asyncio.run(warm_up(workload))
        for round_ in range(load.rounds):
            labels = list(records) if round_ % 2 == 0 else list(records)[::-1]  # neither always goes first
            for label in labels:
                level = asyncio.run(run_level(workloads[label], 1, load.requests // load.rounds, desc=label))
                records[label] += level.records
    summary = {label: hop_stats(rows) for label, rows in records.items()}
    alone, gateway = summary.values()
    difference = {key: (gateway[key].p50 - alone[key].p50) for key in ("ttft_s", "itl_s")}
    for label, stats in summary.items():
        print(f"{label:>20}: TTFT p50 {1000 * stats['ttft_s'].p50:.1f} ms, ITL p50 {1000 * stats['itl_s'].p50:.1f} ms")
    print(f"{'the hop':>20}: TTFT {1000 * difference['ttft_s']:+.1f} ms, ITL {1000 * difference['itl_s']:+.1f} ms",
          flush=True)
    return {"workload": asdict(load), "server_command": shlex.join(command), "gateway": asdict(fleet),
            "results": {label: {key: asdict(value) for key, value in stats.items()}
                        for label, stats in summary.items()},
            "difference_p50_s": difference,
            "records": {label: [asdict(row) for row in rows] for label, rows in records.items()}}


def hop_stats(records: list[RequestRecord]) -> dict[str, Stats]:
    ok = [record for record in records if record.ok]
    if len(ok) < len(records):
        raise RuntimeError(f"{len(records) - len(ok)} requests failed: {[r.error for r in records if not r.ok][:3]}")
    return {key: Stats.of([getattr(record, key) for record in ok]) for key in ("ttft_s", "itl_s", "e2e_s")}


# --- flood -------------------------------------------------------------------------------------------------------


@dataclass
class Probe:
    """One /health probe; ``sent_s`` from the start of the run."""

    sent_s: float
    seconds: float | None = None  # None: unanswered (the connection failed, or past probe_timeout_s)
    status: int | None = None
    snapshot_age_s: float | None = None  # how old the gateway's view of the fleet was, when it says


def flood(args: argparse.Namespace) -> dict[str, Any]:
    """Thousands of requests at once on 2 to 3 replicas while /health is probed every 0.2 s, as a liveness probe
    would: a probe of 1 to 2 s timeout restarts a gateway that does not answer in time."""
    load: FloodLoad = args.load
    raise_open_files(2 * load.requests + 256)
    engine, fleet = configs(args, min_replicas=2, max_replicas=3, max_queued_requests=load.max_queued_requests)
    model = served_name(engine.model)
    health_port = free_port()
    with fleet_running(model_specs(engine, fleet, None), fleet, health_port) as url:
        side = f"http://127.0.0.1:{health_port}"
        answers, probes, flood_s = asyncio.run(flood_and_probe(url, side, model, load))
    requests = summarize(answers, flood_s)
    begin = load.lead_in_s
    health = {path: {"idle": probe_stats([p for p in probes[path] if p.sent_s < begin]),
                     "flood": probe_stats([p for p in probes[path] if begin <= p.sent_s <= begin + flood_s])}
              for path in probes}
    print(f"{load.requests} requests at once: {requests['complete']} answered, errors {requests['errors']} in "
          f"{flood_s:.0f} s", flush=True)
    for path, stats in health.items():
        during = stats["flood"]
        print(f"  /health on the {path} port during the flood: {during['probes']} probes, slowest "
              f"{during['slowest_s']:.2f} s, p99 {during['p99_s']:.2f} s, p50 {during['p50_s']:.3f} s, "
              f"{during['over_1s']} over 1 s, {during['unanswered']} unanswered", flush=True)

    def rows(probes: list[Probe]) -> list[list[Any]]:
        return [[round(p.sent_s, 2), None if p.seconds is None else round(p.seconds, 4), p.status,
                 p.snapshot_age_s] for p in probes]

    # "health": the main port's /health (as before); "health_port": the probe port's (--health-port).
    return {"workload": asdict(load), "gateway": asdict(fleet), "requests": requests, "health": health["main"],
            "health_port": health["probe"], "probes": rows(probes["main"]),
            "probes_health_port": rows(probes["probe"])}


async def flood_and_probe(url: str, side: str, model: str,
                          load: FloodLoad) -> tuple[list[Answer], dict[str, list[Probe]], float]:
    """Probes from the start, the flood after ``lead_in_s``; every answer, every probe (of the main port's /health,
    "main", and of the probe port's, "probe"), the flood's seconds."""
    stop = threading.Event()
    t0 = time.perf_counter()
    # Each prober has a thread and an event loop of its own: the flood's thousands of streams in this loop must not
    # delay the reading of a probe's answer (a load balancer's probes come from another machine).
    probers = {path: asyncio.create_task(asyncio.to_thread(probe_health, base, load, t0, stop))
               for path, base in (("main", url), ("probe", side))}
    await asyncio.sleep(load.lead_in_s)
    bodies = [chat_body(model, QUESTIONS[i % len(QUESTIONS)], load.max_tokens) for i in range(load.requests)]
    async with new_client(url, load.requests) as client:
        started = time.perf_counter()
        answers = await send_all(client, bodies, load.requests, t0)
        flood_s = time.perf_counter() - started
    stop.set()
    return answers, {path: await prober for path, prober in probers.items()}, flood_s


def probe_health(url: str, load: FloodLoad, t0: float, stop: threading.Event) -> list[Probe]:
    """A /health every ``probe_period_s`` until ``stop``, each on a new connection (as a load balancer's probe) and
    none waiting for the one before."""

    async def one(client: httpx.AsyncClient, probe: Probe) -> None:
        try:
            response = await client.get("/health")
        except httpx.HTTPError:
            return
        probe.seconds, probe.status = time.perf_counter() - t0 - probe.sent_s, response.status_code
        with suppress(ValueError, AttributeError):  # an answer that is no JSON object says no age
            probe.snapshot_age_s = response.json().get("snapshot_age_s")

    async def probing() -> list[Probe]:
        probes: list[Probe] = []
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=load.probe_timeout_s) as client:
            running = []
            while not stop.is_set():
                probes.append(Probe(sent_s=time.perf_counter() - t0))
                running.append(asyncio.create_task(one(client, probes[-1])))
                await asyncio.sleep(load.probe_period_s)
            await asyncio.gather(*running)
        return probes

    return asyncio.run(probing())


def probe_stats(probes: list[Probe]) -> dict[str, Any]:
    """The probes' seconds: slowest, p99, p50, how many over 1 s and 2 s; the unanswered; the answers by status."""
    seconds = [p.seconds for p in probes if p.seconds is not None]
    p50, p99 = np.percentile(seconds, [50, 99]) if seconds else (float("nan"), float("nan"))
    ages = [p.snapshot_age_s for p in probes if p.snapshot_age_s is not None]
    return {"probes": len(probes), "unanswered": len(probes) - len(seconds),
            "by_status": dict(Counter(str(p.status) for p in probes if p.status is not None)),
            "slowest_s": max(seconds, default=float("nan")), "p99_s": float(p99), "p50_s": float(p50),
            "over_1s": sum(s > 1 for s in seconds), "over_2s": sum(s > 2 for s in seconds),
            "oldest_snapshot_s": max(ages, default=None)}


# --- the command line --------------------------------------------------------------------------------------------


PARTS: dict[str, tuple[Callable[[argparse.Namespace], dict[str, Any]], Callable[[dict[str, Any], Path], None] | None]]
PARTS = {"routers": (routers, plot_routers), "autoscale": (autoscale, plot_autoscale),
         "streams": (streams, plot_streams), "hop": (hop, None), "flood": (flood, None)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {STAGE}.gateway_bench", description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quick", action="store_true", help="a CI-sized workload, written under results/quick/")
    common.add_argument("--model", default=DEFAULT_MODEL, help="the (small) model: an embedded name or a folder")
    common.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    common.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    common.add_argument("--out", type=Path, help="folder for the JSON and PNG (default: results/<device>/)")
    parts = parser.add_subparsers(dest="part", required=True, metavar="PART")
    for name, (function, _) in PARTS.items():
        part = parts.add_parser(name, parents=[common], help=function.__doc__, description=function.__doc__)
        if name == "routers":
            part.add_argument("--first", default="prefix", choices=["prefix", "pow2"], help="the router measured first")
            part.add_argument("--system-prompts", type=int, help="distinct system prompts (default: 16; --quick: 8)")
        if name == "streams":
            part.add_argument("--clients", type=int, help="streams at once (default: 2000; --quick: 200)")
        if name == "flood":
            part.add_argument("--requests", type=int, help="requests at once (default: 3000; --quick: 600)")
    args = parser.parse_args(argv)
    args.load = (QUICK if args.quick else FULL)[args.part]
    if getattr(args, "clients", None):
        args.load = replace(args.load, clients=args.clients)
    if getattr(args, "requests", None):
        args.load = replace(args.load, requests=args.requests)
    if getattr(args, "system_prompts", None):
        args.load = replace(args.load, system_prompts=args.system_prompts)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exit_on_sigterm()
    args.device, args.dtype = device_and_dtype(args.device, args.dtype)
    measure, plot = PARTS[args.part]
    machine = machine_info(args.device)  # before the fleet starts: its load average says if the machine was quiet
    result = {"name": f"{STAGE}_{args.part}", "stage": STAGE[:2], "model": served_name(args.model),
              "device": args.device, "dtype": args.dtype, "quick": args.quick, "machine": machine,
              "command": shlex.join(sys.orig_argv), **git_state(),
              "date": datetime.now(UTC).isoformat(timespec="seconds")}
    result |= measure(args)
    out_dir = args.out or (RESULTS / "quick" / args.device if args.quick else RESULTS / args.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result['name']}.json"
    path.write_text(dumps(result) + "\n")
    if plot is not None:
        plot(result, path.with_suffix(".png"))
    print(f"Wrote {path}" + ("" if plot is None else f" and {path.with_suffix('.png').name}"))


if __name__ == "__main__":
    main()
