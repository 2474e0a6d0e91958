"""python -m 12_gateway [--demo] [--large-model FOLDER|random-360m] [--router prefix|pow2] [--port P]

Starts Ray on this machine (or joins the cluster RAY_ADDRESS names), deploys one stage 11 engine per replica
of each model and the gateway in front of them, and serves the OpenAI API on --port until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from ray import serve

from common.cli import add_config_args, config_from_args, model_dir_or_exit, stage_parser
from common.random_model import random_model_dir
from common.weights import load_tokenizer

from .autoscaling import desired_replicas
from .config import EngineConfig
from .fleet import APP_NAME, ModelSpec, RayDidNotStart, deployment_name, model_specs, start, stop
from .gateway_config import RANDOM_LARGE, GatewayConfig
from .prefix_router import MIN_MATCH_BLOCKS

# A shop's system prompt of 96 tokens: with the chat template's opening, 6 full blocks of 16 that every question
# after it shares, more than the prefix router's MIN_MATCH_BLOCKS (4), so those questions go where it is cached.
SYSTEM = ("You answer customers of Velo Verde, a bicycle shop at 12 Canal Street, in one short sentence, politely, "
          "and never recommend another shop. We are open Monday to Friday from 9 to 18 and Saturday from 10 to 16. "
          "We sell city, road and electric bikes and repair every brand: a service costs 49 euros and takes two "
          "days, and a flat tyre is fixed while you wait for 12 euros.")
SHOP_QUESTIONS = ("When are you open on Saturday?", "How much does a flat tyre cost?", "Do you sell electric bikes?")
# The burst's questions: no system prompt of their own, so no prefix to follow (the template's default one fills a
# single block): any replica with room takes them.
BURST_QUESTIONS = ("What is the capital of Italy?", "Name a fruit that is yellow.", "How many legs has a spider?",
                   "What colour is the sky at noon?", "Say hello in French.", "What is two plus three?",
                   "Name a large animal.", "What do bees make?")

# The demo's fleet, for each field the command line leaves at its default: two replicas of the small model that the
# autoscaler may take to three, one of the large; a replica holds 4 requests and the gateway queues 12 more per
# model, so that a burst of 20 clients fills the queue at once on a CPU, a request more is refused, and the 12
# waiting (more than 4 per replica) make the autoscaler add a replica after a second.
DEMO_FLEET = {"min_replicas": 2, "max_replicas": 3, "large_replicas": 1, "max_ongoing_requests": 4,
              "max_queued_requests": 12, "target_queue_depth": 4, "upscale_delay_s": 1.0}
# The demo's engines, likewise: no speculative decoding, whose start-up times the step (a replica added under load
# then starts in some 20 s on 2 cores instead of 50).
DEMO_ENGINE = {"speculative": "off"}


def demo_fleet(fleet: GatewayConfig) -> GatewayConfig:
    """``fleet`` with DEMO_FLEET's values for the fields the command line left at their defaults."""
    chosen = replace(fleet, **with_defaults_replaced(fleet, GatewayConfig(), DEMO_FLEET))
    if chosen.max_replicas <= chosen.min_replicas and fleet.max_replicas == GatewayConfig().max_replicas:
        chosen = replace(chosen, max_replicas=chosen.min_replicas + 1)  # room for the autoscaler to add one
    return chosen


def demo_engine(engine: EngineConfig) -> EngineConfig:
    """``engine`` with DEMO_ENGINE's values for the fields the command line left at their defaults."""
    return replace(engine, **with_defaults_replaced(engine, EngineConfig(), DEMO_ENGINE))


def with_defaults_replaced(config: object, defaults: object, demo: dict) -> dict:
    return {name: value for name, value in demo.items() if getattr(config, name) == getattr(defaults, name)}


def large_folder(name: str) -> str | None:
    if not name:
        return None
    if name == RANDOM_LARGE:
        return str(random_model_dir(shape="360m"))
    return str(model_dir_or_exit(name))


# --- one request at a time: the model, the replica, the cache -----------------------------------------------------


def ask(client: httpx.Client, model: str, messages: list[dict[str, str]], max_tokens: int) -> httpx.Response:
    response = client.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                         "max_tokens": max_tokens, "temperature": 0})
    if response.status_code != 200:
        raise SystemExit(f"error: {response.status_code} {response.text}")
    return response


def show(label: str, response: httpx.Response) -> tuple[str, int]:
    """Print where the answer came from (model, route, replica), how much of its prompt was cached, and its start;
    return the replica and the cached tokens."""
    answer = response.json()
    usage = answer["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    text = " ".join(answer["choices"][0]["message"]["content"].split())
    print(f"  {label:<34} -> {response.headers['x-model']} ({response.headers['x-route']}), replica "
          f"{response.headers['x-replica']}, {usage['prompt_tokens']} prompt tokens, {cached} cached\n"
          f"  {'':<34}    {text[:70] + ('...' if len(text) > 70 else '')!r}")
    return response.headers["x-replica"], cached


# --- the burst: streams, and the fleet's state while they run ----------------------------------------------------


MOST_CLIENTS = 64  # the burst's clients, whatever the fleet's slots and queue (--max-queued-requests 4096...)


@dataclass(frozen=True)
class Burst:
    """The demo's load on the small model: ``clients`` clients that each send one streamed request after another,
    and ``extra`` requests more once they have filled the queue."""

    clients: int  # as many as the replicas hold, plus what the gateway queues
    extra: int = 2  # refused with 503: the queue is full
    extra_after_s: float = 1.0  # (before any request ends: each makes max_tokens tokens)
    max_tokens: int = 16
    think_s: float = 0.2  # a client's pause between an answer and its next request
    after_running_s: float = 8.0  # the clients go on this long once the new replica runs
    longest_s: float = 60.0  # and stop after this long if no replica was added
    start_longest_s: float = 180.0  # or this long after the decision, if the new replica has not run by then
    poll_s: float = 0.25  # how often the demo reads the fleet's state


@dataclass
class Stream:
    """One streamed request of the burst; times in seconds from the burst's start."""

    sent_s: float
    status: int = 0  # 0: no HTTP answer at all
    answered_s: float | None = None  # the response's headers: a replica took it (or the gateway refused it)
    first_token_s: float | None = None
    replica: str = ""
    retry_after: str = ""  # a 503's Retry-After header, and its error code
    code: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s


@dataclass(frozen=True)
class Sample:
    """The small model's deployment as ``serve.status()`` described it at time ``t``, and /health's count."""

    t: float
    replicas: dict[str, int]  # by state: RUNNING, STARTING, STOPPING...
    status: str  # HEALTHY, UPSCALING (the autoscaler raised the target), DOWNSCALING...
    message: str  # e.g. "Upscaling from 2 to 3 replicas."
    in_flight: int | None = None  # the gateway's /health: in a replica, or waiting for one

    @property
    def desired(self) -> int:
        """The replicas the autoscaler asked for: all but those stopping (Ray Serve starts the new ones in the
        same step of its control loop as it raises the target)."""
        return sum(n for state, n in self.replicas.items() if state != "STOPPING")

    @property
    def running(self) -> int:
        return self.replicas.get("RUNNING", 0)


@dataclass
class BurstRecord:
    """What the burst did and what the demo saw of the fleet meanwhile: enough to print and draw it."""

    model: str
    initial_replicas: int
    target_queue_depth: int
    max_ongoing_requests: int
    max_queued_requests: int
    streams: list[Stream] = field(default_factory=list)  # every request, the extra ones too
    extras: list[Stream] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    extra_s: float = 0.0  # when the extra requests were sent
    stopped_s: float = 0.0  # when the clients stopped sending

    def waiting(self, sample: Sample) -> int | None:
        """The requests waiting at the gateway: those in flight beyond what the running replicas hold (a replica
        with room takes a request at once, up to max_ongoing_requests)."""
        if sample.in_flight is None:
            return None
        return max(0, sample.in_flight - sample.running * self.max_ongoing_requests)

    def decision_s(self) -> float | None:
        """When the autoscaler first asked for more replicas than the fleet started with."""
        return next((s.t for s in self.samples if s.desired > self.initial_replicas), None)

    def running_s(self) -> float | None:
        """When a replica more than the fleet started with began to run: serve.status() said so, or it answered a
        request (whichever came first: the status is read every ``poll_s``, and lags behind the replica)."""
        said = next((s.t for s in self.samples if s.running > self.initial_replicas), None)
        decision = self.decision_s()
        if decision is None:
            return said
        first_answer: dict[str, float] = {}  # each replica's first answer, in the order they came
        for s in sorted((s for s in self.streams if s.status == 200 and s.replica and s.answered_s is not None),
                        key=lambda s: s.answered_s):
            first_answer.setdefault(s.replica, s.answered_s)
        newcomers = [t for t in list(first_answer.values())[self.initial_replicas:] if t >= decision]
        return min([t for t in (said, *newcomers[:1]) if t is not None], default=None)


def stream_body(model: str, question: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


async def send_stream(client: httpx.AsyncClient, body: dict, t0: float) -> Stream:
    """One streamed request, read to its end; a failure is recorded, not raised."""
    stream = Stream(sent_s=time.perf_counter() - t0)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            stream.status, stream.answered_s = response.status_code, time.perf_counter() - t0
            stream.replica = response.headers.get("x-replica", "")
            if response.status_code != 200:
                stream.retry_after = response.headers.get("retry-after", "")
                stream.code = (json.loads(await response.aread()).get("error") or {}).get("code") or ""
                return stream
            async for line in response.aiter_lines():
                if stream.first_token_s is None and line.startswith("data: {"):
                    choices = json.loads(line.removeprefix("data: ")).get("choices") or [{}]
                    if choices[0].get("delta", {}).get("content"):
                        stream.first_token_s = time.perf_counter() - t0
    except (httpx.HTTPError, ValueError) as exc:
        stream.code = type(exc).__name__
    return stream


def deployment_state(deployment: str) -> tuple[dict[str, int], str, str]:
    """One deployment's replicas by state, its status and its message, from Ray Serve's controller (the demo's
    process is the Ray driver: serve.status() asks the controller)."""
    info = serve.status().applications[APP_NAME].deployments[deployment]
    return ({getattr(state, "value", str(state)): n for state, n in info.replica_states.items() if n},
            getattr(info.status, "value", str(info.status)), info.message)


async def watch_fleet(client: httpx.AsyncClient, record: BurstRecord, t0: float, poll_s: float,
                      until: asyncio.Event) -> None:
    """Every ``poll_s``, and once more when ``until`` is set: the model's replicas (serve.status()) and its
    requests in flight (the gateway's /health)."""
    deployment = deployment_name(record.model)
    while True:
        t = time.perf_counter() - t0
        replicas, status, message = await asyncio.to_thread(deployment_state, deployment)
        try:
            in_flight = (await client.get("/health", timeout=5)).json()["models"][record.model]["in_flight"]
        except (httpx.HTTPError, ValueError, KeyError):
            in_flight = None
        record.samples.append(Sample(round(t, 2), replicas, status, message, in_flight))
        if until.is_set():
            return
        try:
            await asyncio.wait_for(until.wait(), poll_s)
        except TimeoutError:
            pass


async def run_burst(url: str, record: BurstRecord, burst: Burst) -> dict | None:
    """The burst against ``record.model``, recorded in ``record``; what /health said as the extra requests went."""
    stop_sending, stop_watching = asyncio.Event(), asyncio.Event()
    limits = httpx.Limits(max_connections=burst.clients + burst.extra + 2)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(None, connect=30)) as client:
        t0 = time.perf_counter()
        watcher = asyncio.create_task(watch_fleet(client, record, t0, burst.poll_s, stop_watching))

        def body(i: int) -> dict:
            return stream_body(record.model, BURST_QUESTIONS[i % len(BURST_QUESTIONS)], burst.max_tokens)

        async def one_client(k: int) -> None:  # one request after another; refused, it waits Retry-After
            sent = 0
            while not stop_sending.is_set():
                stream = await send_stream(client, body(k + sent), t0)
                record.streams.append(stream)
                sent += 1
                retry_s = float(stream.retry_after) if stream.retry_after.isdigit() else 1.0
                await asyncio.sleep(burst.think_s if stream.status == 200 else retry_s)

        clients = [asyncio.create_task(one_client(k)) for k in range(burst.clients)]
        await asyncio.sleep(burst.extra_after_s)
        health = None
        try:
            health = (await client.get("/health", timeout=5)).json()["models"][record.model]
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        record.extra_s = time.perf_counter() - t0
        record.extras = list(await asyncio.gather(*(send_stream(client, body(k), t0) for k in range(burst.extra))))
        record.streams += record.extras

        def done() -> bool:
            now, decision, running = time.perf_counter() - t0, record.decision_s(), record.running_s()
            if running is not None:
                return now > running + burst.after_running_s
            if decision is not None:  # a replica is starting: wait for it (on a busy machine that takes longer)
                return now > decision + burst.start_longest_s
            return now > burst.longest_s

        while not done():
            await asyncio.sleep(burst.poll_s)
        record.stopped_s = time.perf_counter() - t0
        stop_sending.set()
        await asyncio.gather(*clients)  # each finishes the request it is in
        stop_watching.set()
        await watcher
    return health


def report_burst(record: BurstRecord, burst: Burst, health: dict | None) -> None:
    """Print what the burst showed: the queue, the refusals, the autoscaler's decision and the TTFTs."""
    replicas, slots = record.initial_replicas, record.initial_replicas * record.max_ongoing_requests
    print(f"  {burst.clients} clients send streamed requests ({burst.max_tokens} tokens), each its next one "
          f"{burst.think_s} s after an answer.")
    waiting = None
    if health:
        waiting = record.waiting(Sample(record.extra_s, health["replicas"], "", "", health["in_flight"]))
        print(f"    +{record.extra_s:.1f} s, /health: {health['in_flight']} in flight, replicas {health['replicas']}")
        print(f"      {health['in_flight'] - waiting} in the replicas ({replicas} x max_ongoing_requests "
              f"{record.max_ongoing_requests}), {waiting} waiting at the gateway (max_queued_requests "
              f"{record.max_queued_requests})")
    for s in record.extras:
        print("    a request more: " + (
            f"{s.status} after {1000 * (s.answered_s - s.sent_s):.0f} ms, Retry-After: {s.retry_after}, code {s.code}"
            if s.status == 503 else f"{s.status} (replica {s.replica}): the queue had room"))
    later = sum(s.status != 200 for s in record.streams) - sum(s.status != 200 for s in record.extras)
    if later:
        print(f"    (and {later} refused later: a client's next request found the queue full; it waits Retry-After "
              "and sends it again)")

    if waiting is not None:
        desired = desired_replicas(replicas, waiting, slots, record.target_queue_depth, record.max_ongoing_requests)
        print(f"  The policy: {waiting} waiting {'>' if waiting > record.target_queue_depth * replicas else '<='} "
              f"target_queue_depth {record.target_queue_depth} x {replicas} replicas -> desired_replicas = {desired}")
    print(f"  What Ray Serve did (serve.status(), read every {burst.poll_s} s):")
    decision, running = record.decision_s(), record.running_s()
    if decision is None:
        print("    no replica added")
    else:
        upscaling = next((s for s in record.samples if s.status == "UPSCALING"), None)
        said = f"{upscaling.status} {upscaling.message!r}" if upscaling else "the target raised"
        print(f"    +{decision:5.1f} s  {said} -> {next(s for s in record.samples if s.t == decision).replicas}")
        if running is not None:
            print(f"    +{running:5.1f} s  the new replica runs, {running - decision:.0f} s later (a process, the "
                  f"model, its warm-up)")
        else:
            waited = record.stopped_s - decision
            print(f"    the new replica had not run when the clients stopped, {waited:.0f} s after the decision: "
                  "its start took longer than the demo waits (a busy machine?)")
    print(f"    +{record.stopped_s:5.1f} s  the clients stop")

    answered = [s for s in record.streams if s.ttft_s is not None]
    inf = float("inf")
    edges = [0.0, inf if decision is None else decision, inf if running is None else running, inf]
    print("  TTFT, median of the requests sent:")
    for label, lo, hi in zip(("before the decision", "while the new replica started", "once it ran"), edges,
                             edges[1:], strict=False):
        ttfts = [s.ttft_s for s in answered if lo <= s.sent_s < hi]
        print(f"    {label:<30} " + (f"{statistics.median(ttfts):4.1f} s ({len(ttfts)} requests)" if ttfts else "-"))
    before = {s.replica for s in answered if decision is None or s.answered_s < decision}
    print("  Requests per replica: " + ", ".join(f"{replica} {n}" + ("" if replica in before else " (the new one)")
                                             for replica, n in Counter(s.replica for s in answered).items()))


def plot_burst(record: BurstRecord, out: Path) -> Path:
    """The burst in three panels over time: what the autoscaler saw (requests waiting, against what it tolerates),
    what it decided (replicas desired, starting, running), and each request's TTFT by when it was sent."""
    fig = Figure(figsize=(12, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    seen, decided, ttft = fig.subplots(3, 1, sharex=True)
    t = [s.t for s in record.samples]
    counted = [s for s in record.samples if s.in_flight is not None]
    seen.step([s.t for s in counted], [record.waiting(s) for s in counted], where="post", color="C3",
              label="waiting at the gateway:\nin flight - running replicas\nx max_ongoing_requests")
    seen.step(t, [record.target_queue_depth * s.running for s in record.samples], where="post", color="grey",
              linestyle="--", label="tolerated: target_queue_depth\nx running replicas")
    seen.plot([s.t for s in counted], [s.in_flight for s in counted], color="C0", linestyle=":",
              label="in flight (/health):\nin a replica or waiting")
    seen.set(ylabel="requests", title="What the autoscaler saw: requests waiting at the gateway", ylim=(0, None))
    decided.step(t, [s.desired for s in record.samples], where="post", color="C1", label="desired (the target)")
    decided.step(t, [s.running for s in record.samples], where="post", color="C2", label="RUNNING")
    decided.step(t, [s.desired - s.running for s in record.samples], where="post", color="C4", linestyle=":",
                 label="starting")
    top = max([s.desired for s in record.samples] + [record.initial_replicas])
    decided.set(ylabel="replicas", title="What it decided: replicas of the model (serve.status())",
                ylim=(-0.1, top + 0.5), yticks=range(top + 1))
    answered = sorted((s for s in record.streams if s.ttft_s is not None), key=lambda s: s.answered_s or 0)
    replicas = list(dict.fromkeys(s.replica for s in answered))  # by their first answer: the new one last
    decision = record.decision_s()
    for i, replica in enumerate(replicas):
        mine = [s for s in answered if s.replica == replica]
        new = decision is not None and (mine[0].answered_s or 0) > decision
        ttft.scatter([s.sent_s for s in mine], [s.ttft_s for s in mine], s=16, color=f"C{i}",
                     label=f"replica {replica}" + (" (new)" if new else ""))
    refused = [s for s in record.streams if s.status != 200]
    if refused:
        ttft.scatter([s.sent_s for s in refused], [0] * len(refused), marker="x", s=50, color="red",
                     label="refused: 503, Retry-After")
    ttft.set(xlabel="seconds since the burst began (a request: when it was sent)", ylabel="TTFT (s)",
             title="Time to first token of each request", ylim=(-0.3, None))
    running = record.running_s()
    for ax in (seen, decided, ttft):
        first = ax is seen
        if decision is not None:
            ax.axvline(decision, color="black", linestyle="--", linewidth=1,
                       label="the decision:\none replica more" if first else None)
        if running is not None:
            ax.axvline(running, color="black", linewidth=1, label="the new replica runs" if first else None)
        ax.axvline(record.stopped_s, color="grey", linestyle="-.", linewidth=1,
                   label="the clients stop" if first else None)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"A burst on {record.model}: {record.initial_replicas} replicas, a queue, and the autoscaler")
    fig.savefig(out, dpi=100)
    return Path(out)


def demo(url: str, specs: list[ModelSpec], fleet: GatewayConfig, max_tokens: int) -> None:
    """Each decision the stage makes, with its evidence: the model (by difficulty), the replica (by prefix), the
    queue and its refusals, the autoscaler's replica; the burst drawn to a PNG whose path it prints last."""
    small = specs[0].name
    with httpx.Client(base_url=url, timeout=300) as client:
        print("\n1. Which model: 'auto' picks by difficulty")
        show("an easy question", ask(client, "auto", [{"role": "user", "content": "What is the capital of France?"}],
                                     max_tokens))
        if len(specs) > 1:
            show("a hard one (random weights: noise)", ask(client, "auto", [{"role": "user", "content": (
                "Prove step by step that the square root of 2 is irrational, and explain why the proof works.")}],
                max_tokens))
        running = client.get("/health").json()["models"][small]["replicas"].get("RUNNING", 0)
        tokens = len(load_tokenizer(specs[0].engine.model)(SYSTEM).input_ids)
        print(f"\n2. Which replica: {small} has {running} replicas; a shop's system prompt of {tokens} tokens, "
              "then a question")
        seen = [show(repr(question), ask(client, small, [{"role": "system", "content": SYSTEM},
                                                         {"role": "user", "content": question}], max_tokens))
                for question in SHOP_QUESTIONS]
        where = "the same replica each time" if len({r for r, _ in seen}) == 1 else "not always the same replica"
        cached = [n for _, n in seen]
        print(f"  -> {where}; cached tokens {cached}: the system prompt's {max(cached) // specs[0].engine.block_size} "
              f"full blocks of {specs[0].engine.block_size}\n     (the router follows a prefix of {MIN_MATCH_BLOCKS} "
              "blocks or more, MIN_MATCH_BLOCKS)")

    burst = Burst(clients=min(MOST_CLIENTS, fleet.min_replicas * fleet.max_ongoing_requests
                              + fleet.max_queued_requests))
    record = BurstRecord(small, fleet.min_replicas, fleet.target_queue_depth, fleet.max_ongoing_requests,
                         fleet.max_queued_requests)
    print(f"\n3. A burst: a queue at the gateway, its 503, the autoscaler ({small}: {fleet.min_replicas} to "
          f"{fleet.max_replicas} replicas)")
    health = asyncio.run(run_burst(url, record, burst))
    report_burst(record, burst, health)

    with httpx.Client(base_url=url, timeout=300) as client:
        print("\n4. The gateway's counters (/metrics):")
        for line in client.get("/metrics").text.splitlines():
            if line.startswith(("llm_gateway_requests_total", "llm_gateway_requests_refused_total")):
                print("  " + line)
    out = plot_burst(record, Path(tempfile.gettempdir()) / "12_gateway_demo.png")
    print(f"\nThe burst, drawn: {out}")


def main() -> None:
    parser = stage_parser(__package__, EngineConfig)
    add_config_args(parser, GatewayConfig)
    parser.add_argument("--health-port", type=int, default=None,
                        help="serve /health also on this port, from this process, apart from the requests' path "
                             "(point a liveness probe there: a flood on --port does not delay it); default: --port "
                             "+ 1; 0: none")
    args = parser.parse_args()
    engine = config_from_args(EngineConfig, args)
    fleet = GatewayConfig(**{name: getattr(args, name) for name in GatewayConfig.__dataclass_fields__})
    if args.demo:  # the demo's own fleet and engines, where the command line leaves the defaults
        fleet, engine = demo_fleet(fleet), demo_engine(engine)
    if engine.device == "cuda" and fleet.replica_gpus == 0:
        raise SystemExit("error: --device cuda needs --replica-gpus (Ray hides the GPUs from replicas that ask for "
                         "none); e.g. --replica-gpus 0.25 for 4 replicas on one GPU, each with a KV pool of "
                         "--gpu-memory-utilization of its quarter of the GPU's memory, less its weights")
    large = large_folder(fleet.large_model or (RANDOM_LARGE if args.demo else ""))
    specs = model_specs(engine, fleet, large)
    print(f"Models: {', '.join(f'{s.name} ({s.size}, {s.engine.model})' for s in specs)}")
    pinned = f" (the large model: {fleet.large_replicas})" if fleet.large_replicas and len(specs) > 1 else ""
    print(f"Replicas of each: {fleet.min_replicas} to {fleet.max_replicas}{pinned}, {fleet.replica_cpus} CPU each; "
          f"router: {fleet.router}; autoscaling past {fleet.target_queue_depth} waiting requests per replica")
    started = time.perf_counter()
    try:
        health_port = args.port + 1 if args.health_port is None else args.health_port
        url = start(specs, fleet, args.host, args.port, health_port or None)
        print(f"The gateway serves {url} (started in {time.perf_counter() - started:.1f} s)"
              + (f"; liveness probes: http://{args.host}:{health_port}/health" if health_port else ""))
        if args.demo:
            demo(url, specs, fleet, args.max_tokens)
            return
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    except RayDidNotStart as exc:
        raise SystemExit(f"error: {exc}") from None
    finally:
        stop()


if __name__ == "__main__":
    main()
