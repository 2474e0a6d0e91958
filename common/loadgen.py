"""An async load generator: many clients at once against POST /v1/completions, timed per request.

It drives a server in one of two ways.

- A *level* sends ``num_requests`` requests with at most ``concurrency`` of them in flight (a
  closed loop: as soon as one finishes, the next starts). The clients wait for their answers, so a
  slow server slows the load down with it: the queue never grows beyond ``concurrency``.
- A *rate* sends them at arrival times drawn in advance (an open loop, as production benchmarks
  such as vLLM's ``benchmark_serving`` do): Poisson arrivals of ``rate`` requests per second by
  default (``arrival_times``), each request sent when it is due whether or not the earlier ones
  have finished. Above the rate a server can serve, requests pile up in its queue and wait there,
  which a closed loop hides. Each rate reports its *goodput* (``Slo``): the requests per second
  that met their latency targets.

For every request we record

- TTFT, time to first token: from sending the request to the first chunk that carries text;
- ITL, inter-token latency: the mean gap between the streamed chunks that follow it;
- end-to-end latency: from sending the request to the end of the answer;
- output tokens, from the server's own ``usage`` numbers (not by counting chunks);
- the server's id for it (the ``id`` of its response), the name its ``--trace`` line carries.

The client cannot see how long a request waited in the server's queue: that hides inside TTFT.
A server started with ``--trace FILE`` (stages 02 on, see common/trace.py) writes it down, and a
rate given that file reads each of its requests' ``queued`` spans, matched by the id above.

While a level (or a rate) runs, a sampler asks the server every ~100 ms how many requests it holds
(``llm_requests_running + llm_requests_waiting`` from GET /metrics). A server without /metrics
(stage 01) gets the client's own count instead, and the result says which one it is. Before and
after it, it reads the engine's busy seconds (``llm_engine_busy_seconds_total``, stages 02
on): their difference over its wall time is the engine's busy fraction, the nearest thing
a CPU server has to a GPU-utilization panel.

A batching stage (04 on) also counts each phase of its steps (``llm_step_phase_seconds``: schedule,
prepare, execute, sample or verify, update, detokenize, handoff). Read before and after a level, they
give the level's mean step, phase by phase (``step_phases_ms``), and **the server's share of a token**:
of the mean gap between two of a request's tokens, the part that is not the model's forward pass,
``1 - decode step / ITL``. The decode step is the mean forward pass that a decoding sequence waited for
between two of its tokens (``llm_decode_step_seconds``, counted once per such sequence: a step of 64
weighs 64 times, as it does in the ITL; a prefill that only computes prompts is no gap of anyone's).
Everything else (scheduling, preparing inputs, sampling, detokenizing, handing outputs over, waiting for
the GIL or the cores) is the server's own time, which a token should not have to pay.

Two ITLs give two shares. ``server_share`` divides by the ITL the server measures itself, as it hands
each token over (``llm_inter_token_latency_seconds``). ``client_share`` divides by the ITL this client
saw, which adds the way to the client: the event loop writing the chunk, the network, the client's own
parsing, and the gap of a step whose chunk carried no text (held back, sent with the next one). When the
load generator runs on the server's machine, as on a laptop, it also takes CPU from the server, and that
shows here.

The *shared-prefix workload* (``Workload.shared_prefix``, built by ``shared_prefix``) puts the same
long system prompt in front of every request, as real chat traffic does: every conversation with a
product's assistant starts with the same page of instructions. A server without a prefix cache
computes that page again for every request; one with a prefix cache (stage 05) computes it once and
reuses its KV blocks, so the workload shows what the cache buys. When the server counts its cache's
lookups on /metrics (``llm_prefix_cache_queries_total`` and ``llm_prefix_cache_hits_total``, in
prompt tokens, vLLM's convention), each level records its hit rate: the share of the prompt tokens
it looked up that the cache already held.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
from tqdm import tqdm

from .trace import read_traces

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

# The shared-prefix workload's system prompt: a customer-service policy, as a product's chat assistant
# would get. Distinct sentences, so that the text tokenizes like real prose (one word repeated would be
# a handful of tokens that a tokenizer may merge in odd ways); cycled when a longer prompt is asked for.
SYSTEM_SENTENCES: list[str] = [
    "You are a helpful assistant for ACME Corporation, answering customers' questions about our products.",
    "Be polite, concise and accurate; when you do not know an answer, say so instead of guessing.",
    "ACME sells kitchen appliances, garden tools and small electronics in forty countries.",
    "Our customer service hours are Monday to Friday, 8 a.m. to 6 p.m. local time, except public holidays.",
    "Orders ship within two business days, and standard delivery takes three to seven business days.",
    "Express delivery costs 12 euros and arrives the next business day when ordered before noon.",
    "Customers may return any unused product within 30 days of delivery for a full refund.",
    "A refund is paid to the original payment method within ten business days of the returned item's arrival.",
    "Opened software, gift cards and personalized items cannot be returned unless they are faulty.",
    "Every appliance carries a two-year warranty covering defects in materials and workmanship.",
    "The warranty does not cover damage from accidents, misuse, power surges or unauthorized repairs.",
    "To make a warranty claim, the customer needs the order number and a short description of the fault.",
    "Never ask a customer for a full card number, a password or a one-time security code.",
    "If a customer reports smoke, sparks or a burning smell, tell them to unplug the device at once.",
    "Safety reports are always escalated to a human agent, whatever the time of day.",
    "Do not promise discounts, compensation or delivery dates that this policy does not state.",
    "Members of the ACME Plus program get free express delivery and an extra year of warranty.",
    "ACME Plus costs 49 euros a year and can be cancelled at any time from the account page.",
    "Price matching applies only to identical items sold new by an authorized retailer in the same country.",
    "Gift cards never expire and can be combined with one promotional code per order.",
    "Promotional codes cannot be applied to orders that have already been placed.",
    "Spare parts for discontinued models remain available for at least seven years after the last sale.",
    "Recommend the user manual's troubleshooting section before suggesting a repair.",
    "Repairs under warranty are free, including the cost of sending the product to our service center.",
    "Out-of-warranty repairs start with a free quote, and the customer decides whether to go ahead.",
    "Answer in the language the customer writes in, and keep a friendly, professional tone.",
    "Use plain words, short paragraphs and numbered steps for instructions.",
    "If a question is unrelated to ACME, help briefly if you can, then offer to return to the customer's order.",
    "Do not share internal procedures, employee names or information about other customers.",
    "Personal data is handled according to the ACME privacy notice, which the customer can read on our website.",
    "A customer can ask for a copy of their data or for its deletion by writing to the privacy team.",
    "Invoices are available as PDF files from the order history page for seven years.",
    "Business customers can pay by bank transfer and receive a single monthly invoice.",
    "Bulk orders of more than fifty units are handled by the sales team, who answer within one business day.",
    "Products are tested to European safety standards and carry the CE mark.",
    "Packaging is made from recycled cardboard, and old appliances can be returned for recycling free of charge.",
    "When a product is out of stock, offer to notify the customer by email when it is available again.",
    "Do not speculate about future products, prices or release dates.",
    "If the customer is unhappy with an answer, offer to pass the conversation to a human agent.",
    "End each answer by asking whether there is anything else you can help with.",
]
# Ends with one newline: the prompt's tokens then begin with exactly the prefix's tokens, whatever the
# question (after "\n\n" the tokenizer would split the newlines differently), so a cache of token blocks matches.
SYSTEM_PROMPT_END = "\n\nThe customer writes:\n"
# English prose in SmolLM2's tokenizer: the sentences above make 722 tokens from 3,637 characters; 1,000 tokens
# asked for give 1,013 (5,064 characters).
CHARS_PER_TOKEN = 5.0
DEFAULT_SHARED_PREFIX_TOKENS = 1000  # about a page of instructions, a common size for a system prompt


def shared_prefix(tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens of SmolLM2's tokenizer (estimated from its length:
    CHARS_PER_TOKEN characters a token), always the same text for the same ``tokens``: SYSTEM_SENTENCES
    in order, cycled until long enough, then SYSTEM_PROMPT_END. "" for 0 tokens (no prefix)."""
    if tokens <= 0:
        return ""
    target_chars = tokens * CHARS_PER_TOKEN - len(SYSTEM_PROMPT_END)
    sentences: list[str] = []
    while len(" ".join(sentences)) < target_chars:
        sentences.append(SYSTEM_SENTENCES[len(sentences) % len(SYSTEM_SENTENCES)])
    return " ".join(sentences) + SYSTEM_PROMPT_END


SAMPLE_PERIOD_S = 0.1
# Gauges that count a server's requests, summed over their labels. Ours, and vLLM's names, so that
# an outside server is measured the same way.
RUNNING_METRICS = ("llm_requests_running", "vllm:num_requests_running")
WAITING_METRICS = ("llm_requests_waiting", "vllm:num_requests_waiting")
BUSY_METRIC = "llm_engine_busy_seconds_total"  # the course's stages (02 on): seconds the engine computed
# Prefix-cache counters, in prompt tokens: looked up in the cache, and found there. Ours (stage 05 on) and vLLM's.
PREFIX_QUERIES_METRICS = ("llm_prefix_cache_queries_total", "vllm:prefix_cache_queries_total")
PREFIX_HITS_METRICS = ("llm_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")
PHASE_METRIC = "llm_step_phase_seconds"  # the course's batching stages (04 on): a histogram, one series per phase
OVERLAPPED_METRIC = "llm_overlapped_steps_total"  # steps launched before the one in flight was read (10 on)
SYNC_METRIC = "llm_sync_steps_total"  # steps that waited for the one before, by reason (10 on)
DECODE_STEP_METRIC = "llm_decode_step_seconds"  # the forward pass each decoding sequence waited for (04 on)
SERVER_ITL_METRIC = "llm_inter_token_latency_seconds"  # the course's stages (02 on): ITL as the server hands over

InFlightSource = Literal["server", "client"]


@dataclass
class Workload:
    """What every request of a sweep asks for. Greedy and ``ignore_eos``: each request makes exactly
    ``max_tokens`` tokens, so the work per request is the same for every stage and every run.

    With a ``shared_prefix`` (see ``shared_prefix()``), every prompt is that system prompt followed
    by one of ``prompts`` in turn: the long part is the same in every request, the short end differs
    from one request to the next. Without one (the standard workload), the prompts are sent alone."""

    url: str  # the server's root, e.g. http://127.0.0.1:8002
    model: str | None
    max_tokens: int
    stream: bool = True
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    timeout_s: float = 900.0  # generous: at concurrency 64 a one-at-a-time server queues for minutes
    # Fields merged into every request body; a None value removes one (a peer that rejects ignore_eos).
    extra_body: dict[str, Any] = field(default_factory=dict)
    shared_prefix: str = ""  # a system prompt in front of every prompt; "" for none

    def prompt(self, index: int) -> str:
        return self.shared_prefix + self.prompts[index % len(self.prompts)]

    def body(self, index: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": self.prompt(index),
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
    request_id: str | None = None  # the server's id for it (its response's "id"), which its trace carries


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
class TailStats(Stats):
    """Stats with p90 too, for an open loop: a latency target is usually set on a high percentile, and
    as the rate climbs the tail (p90, then p99) breaks it long before the median does."""

    p90: float

    @classmethod
    def of(cls, values: list[float]) -> TailStats | None:
        stats = Stats.of(values)
        return None if stats is None else cls(**asdict(stats), p90=float(np.percentile(values, 90)))


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
    prefix_cache_hit_rate: float | None = None  # share of the prompt tokens looked up found in the cache (05 on)
    step_phases: StepPhases | None = None  # the level's steps, phase by phase (04 on)

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
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            **token_time(self.step_phases, stats("itl_s")),
        }


def token_time(phases: StepPhases | None, itl: dict[str, float] | None) -> dict[str, Any]:
    """Where a token's time went: the level's mean step phase by phase, in ms, the server's own mean ITL, and the
    share of a token that is not the model's, against the server's ITL and against the client's (None where the
    server does not count its phases, or nothing streamed)."""
    if phases is None or not phases.steps:
        return {"steps": None, "step_phases_ms": None, "decode_step_ms": None, "server_itl_ms": None,
                "server_share": None, "client_share": None, "overlapped_steps": None, "synchronous_steps": None}
    step = phases.decode_step_s

    def share(itl_s: float | None) -> float | None:
        return None if step is None or not itl_s else 1 - step / itl_s

    return {"steps": phases.steps, "step_phases_ms": {name: 1000 * s for name, s in phases.mean_s.items()},
            "decode_step_ms": None if step is None else 1000 * step,
            "server_itl_ms": None if phases.server_itl_s is None else 1000 * phases.server_itl_s,
            "server_share": share(phases.server_itl_s), "client_share": share(itl["mean"] if itl else None),
            "overlapped_steps": phases.overlapped, "synchronous_steps": phases.synchronous}


# --- one request -------------------------------------------------------------------------------


@dataclass
class Streamed:
    """What one streamed answer showed the client."""

    chunk_times: list[float]  # arrival of each chunk that carries a token, from the first text on
    output_tokens: int  # the server's count (its ``usage``)
    response_id: str | None  # the server's id for the request: its chunks' "id"


async def stream_response(client: httpx.AsyncClient, body: dict[str, Any]) -> Streamed:
    """Send one streaming request; return when each chunk that carries a token arrived, the output
    tokens the server counted, and the id it gave the request."""
    chunk_times: list[float] = []
    output_tokens, response_id = 0, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
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
            response_id = event.get("id", response_id)
            if event.get("usage"):
                output_tokens = event["usage"]["completion_tokens"]
            choice = (event.get("choices") or [None])[0]
            # The first token the user sees is the first chunk with text (a server may send "" while
            # it holds back half a character). After that, the last chunk counts even if it is empty.
            if choice and (choice.get("text") or (chunk_times and choice.get("finish_reason"))):
                chunk_times.append(now)
    if not chunk_times:
        raise RuntimeError("the stream carried no text")
    if output_tokens == 0:  # counting chunks instead would undercount (a chunk may hold two tokens)
        raise RuntimeError("no usage numbers: the server ignored stream_options.include_usage")
    return Streamed(chunk_times, output_tokens, response_id)


async def stream_chunks(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[list[float], int]:
    """``stream_response``'s chunk times and output tokens, for a caller that needs no id."""
    streamed = await stream_response(client, body)
    return streamed.chunk_times, streamed.output_tokens


async def send_streaming(client: httpx.AsyncClient, workload: Workload, record: RequestRecord) -> None:
    """Send one streaming request and fill in ``record`` from its server-sent events."""
    start = time.perf_counter()
    streamed = await stream_response(client, workload.body(record.index))
    end = time.perf_counter()
    record.output_tokens, record.request_id = streamed.output_tokens, streamed.response_id
    record.ttft_s = streamed.chunk_times[0] - start
    gaps = np.diff(streamed.chunk_times)
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
    answer = response.json()
    record.output_tokens, record.request_id = answer["usage"]["completion_tokens"], answer.get("id")
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


def sum_series(metrics_text: str, names: tuple[str, ...]) -> float | None:
    """The sum of every series of the metrics ``names`` (whatever their labels) in a Prometheus text
    page, or None if the page has none of them."""
    total, found = 0.0, False
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.split("{", 1)[0].split(" ", 1)[0] in names:
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else None


def parse_in_flight(metrics_text: str) -> int | None:
    """running + waiting from a Prometheus text page, or None if the page has neither."""
    total = sum_series(metrics_text, RUNNING_METRICS + WAITING_METRICS)
    return None if total is None else round(total)


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


@dataclass
class Counters:
    """The server's running totals at one moment, from one /metrics page; None where it has no such
    counter. Read before and after a level, their differences describe the level alone."""

    busy_s: float | None = None  # seconds the engine has spent computing since it started
    prefix_queries: float | None = None  # prompt tokens looked up in the prefix cache
    prefix_hits: float | None = None  # of those, tokens found there
    phases: dict[str, tuple[float, float]] | None = None  # each step phase's (count, seconds) (04 on)
    decode_steps: tuple[float, float] | None = None  # llm_decode_step_seconds' (count, seconds) (04 on)
    server_itl: tuple[float, float] | None = None  # llm_inter_token_latency_seconds' (count, seconds) (02 on)
    overlapped: float | None = None  # steps that overlapped the one before (10 on)
    synchronous: dict[str, float] | None = None  # steps that waited for it, by reason (10 on)

    @classmethod
    def parse(cls, metrics_text: str) -> Counters:
        return cls(busy_s=sum_series(metrics_text, (BUSY_METRIC,)),
                   prefix_queries=sum_series(metrics_text, PREFIX_QUERIES_METRICS),
                   prefix_hits=sum_series(metrics_text, PREFIX_HITS_METRICS),
                   phases=parse_phases(metrics_text), decode_steps=parse_count_sum(metrics_text, DECODE_STEP_METRIC),
                   server_itl=parse_count_sum(metrics_text, SERVER_ITL_METRIC),
                   overlapped=sum_series(metrics_text, (OVERLAPPED_METRIC,)),
                   synchronous=parse_labelled(metrics_text, SYNC_METRIC, "reason"))


def parse_labelled(metrics_text: str, counter: str, label: str) -> dict[str, float] | None:
    """A counter's value per value of ``label``, from a Prometheus text page; None without it."""
    values = {line.split(f'{label}="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in metrics_text.splitlines() if line.startswith(counter + "{") and f'{label}="' in line}
    return values or None


def parse_count_sum(metrics_text: str, histogram: str) -> tuple[float, float] | None:
    """A histogram's (count, sum) from a Prometheus text page; None without it."""
    count = sum_series(metrics_text, (histogram + "_count",))
    return None if count is None else (count, sum_series(metrics_text, (histogram + "_sum",)) or 0.0)


def parse_phases(metrics_text: str) -> dict[str, tuple[float, float]] | None:
    """``llm_step_phase_seconds``'s count and sum per phase, from a Prometheus text page; None without it."""
    counts: dict[str, float] = {}
    sums: dict[str, float] = {}
    for line in metrics_text.splitlines():
        for suffix, into in (("_count{", counts), ("_sum{", sums)):
            if line.startswith(PHASE_METRIC + suffix) and 'phase="' in line:
                into[line.split('phase="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return {phase: (counts[phase], sums.get(phase, 0.0)) for phase in counts} or None


@dataclass(frozen=True)
class StepPhases:
    """The steps a level ran: how many, the mean seconds per step of each phase, the mean forward pass a
    decoding sequence waited for, and the server's mean ITL (None: no sequence decoded)."""

    steps: int
    mean_s: dict[str, float]
    decode_step_s: float | None = None
    server_itl_s: float | None = None
    overlapped: int | None = None  # steps launched while the one before was in flight (10 on)
    synchronous: dict[str, int] | None = None  # steps that waited for the one before, by reason (10 on)


def step_phases_between(before: Counters, after: Counters) -> StepPhases | None:
    """The steps between two readings (a step counts once per phase: ``schedule`` counts them all)."""
    if before.phases is None and after.phases is None:
        return None
    start, end = before.phases or {}, after.phases or {}
    steps = round(end.get("schedule", (0, 0))[0] - start.get("schedule", (0, 0))[0])
    if steps <= 0:
        return StepPhases(0, {})
    return StepPhases(steps, {phase: (seconds - start.get(phase, (0, 0.0))[1]) / steps
                              for phase, (_, seconds) in end.items()},
                      mean_between(before.decode_steps, after.decode_steps),
                      mean_between(before.server_itl, after.server_itl),
                      None if after.overlapped is None else round(after.overlapped - (before.overlapped or 0)),
                      None if after.synchronous is None else
                      {reason: round(n - (before.synchronous or {}).get(reason, 0))
                       for reason, n in after.synchronous.items()})


def mean_between(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """The mean of what a histogram recorded between two (count, sum) readings; None if nothing."""
    count, total = (a - b for a, b in zip(after or (0, 0.0), before or (0, 0.0), strict=True))
    return total / count if count > 0 else None


async def server_counters(client: httpx.AsyncClient) -> Counters:
    """The server's counters now; all None if it has no usable GET /metrics."""
    return Counters() if (text := await server_metrics(client)) is None else Counters.parse(text)


def engine_busy_between(before: Counters, after: Counters, wall_s: float) -> float | None:
    """The engine's busy fraction over ``wall_s`` seconds: how much of it went to computing rather
    than waiting for work. None if the server does not count its busy seconds."""
    if before.busy_s is None or after.busy_s is None or wall_s <= 0:
        return None
    return min(1.0, (after.busy_s - before.busy_s) / wall_s)


def prefix_hit_rate_between(before: Counters, after: Counters) -> float | None:
    """Tokens found in the prefix cache / tokens looked up, between two readings: the share of the
    prompts' prefill that the cache saved. None if the server has no prefix cache or looked nothing up."""
    counts = (before.prefix_queries, before.prefix_hits, after.prefix_queries, after.prefix_hits)
    if any(count is None for count in counts):
        return None
    queries = after.prefix_queries - before.prefix_queries
    return (after.prefix_hits - before.prefix_hits) / queries if queries > 0 else None


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


@dataclass
class Sent:
    """What sending a set of requests measured: the part a closed-loop level and an open-loop rate share."""

    wall_s: float
    records: list[RequestRecord]
    in_flight: InFlight
    engine_busy: float | None
    prefix_cache_hit_rate: float | None
    step_phases: StepPhases | None = None


async def send_requests(workload: Workload, arrivals: list[float], limit: int | None, desc: str) -> Sent:
    """Send request ``i`` ``arrivals[i]`` seconds after the start, with at most ``limit`` in flight (None: no
    cap; a request due while the cap is reached waits for a free place), and time each one.

    All arrivals at 0 with a limit is a closed loop; arrivals spread in time without a limit, an open loop.
    A record's ``start_s`` is when the request was sent, after any wait for the cap (as vLLM's benchmark
    times it): its latencies are the server's, the client's own wait is not in them."""
    async with new_client(workload, limit or len(arrivals)) as client:
        # Ask /metrics once before the load starts: a one-at-a-time server (stage 01) could not
        # answer it during the load anyway, and has none.
        source: InFlightSource = "server" if await server_in_flight(client) is not None else "client"
        before = await server_counters(client) if source == "server" else Counters()
        in_flight, count, done = InFlight(source), ClientCount(), asyncio.Event()
        gate = asyncio.Semaphore(limit) if limit is not None else nullcontext()
        bar = tqdm(total=len(arrivals), desc=desc, unit="req", leave=False)
        level_start = time.perf_counter()

        async def one(index: int) -> RequestRecord:
            if (due_in := level_start + arrivals[index] - time.perf_counter()) > 0:
                await asyncio.sleep(due_in)
            async with gate:
                record = RequestRecord(index, start_s=time.perf_counter() - level_start)
                count.value += 1
                await run_one(client, workload, record)
                count.value -= 1
                bar.update()
                return record

        sampler = asyncio.create_task(sample_in_flight(client, in_flight, count, level_start, done))
        try:
            records = await asyncio.gather(*(one(i) for i in range(len(arrivals))))
            wall_s = time.perf_counter() - level_start
        finally:
            done.set()
            await sampler
            bar.close()
        after = await server_counters(client) if before != Counters() else Counters()
    return Sent(wall_s, list(records), in_flight, engine_busy_between(before, after, wall_s),
                prefix_hit_rate_between(before, after), step_phases_between(before, after))


async def run_level(workload: Workload, concurrency: int, num_requests: int, desc: str = "") -> LevelResult:
    """Send ``num_requests`` requests, at most ``concurrency`` at a time, and time each one."""
    sent = await send_requests(workload, [0.0] * num_requests, concurrency, desc or f"concurrency {concurrency}")
    return LevelResult(concurrency, sent.wall_s, sent.records, sent.in_flight, sent.engine_busy,
                       sent.prefix_cache_hit_rate, sent.step_phases)


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
            + ("" if s.get("prefix_cache_hit_rate") is None
               else f"prefix cache hits {100 * s['prefix_cache_hit_rate']:3.0f}%, ")
            + ("" if s.get("server_share") is None else f"server's share of a token {100 * s['server_share']:3.0f}%, ")
            + ("" if s.get("client_share") is None else f"as the client sees it {100 * s['client_share']:3.0f}%, ")
            + f"errors {s['errors']}")


# --- an open loop: requests at a rate ---------------------------------------------------------------

Arrivals = Literal["poisson", "fixed"]
TRACE_WAIT_S = 10.0  # a trace is written just after its response has gone out: how long to wait for the last


def arrival_times(rate: float, count: int, arrivals: Arrivals = "poisson", seed: int = 0) -> list[float]:
    """When each of ``count`` requests is due, in seconds from the first (due at 0).

    ``poisson``: a Poisson process of ``rate`` requests per second, i.e. independent exponential gaps of
    mean 1/rate, as users who do not know about each other send them: bursts and lulls, which is what fills
    a queue. The gaps are drawn from a generator seeded with ``seed`` as exponentials of mean 1, then
    divided by the rate: the same seed gives the same schedule, and every rate of a sweep the same pattern
    of bursts, scaled, so that two rates differ only in their rate. ``fixed``: exactly 1/rate apart."""
    if arrivals == "fixed":
        return (np.arange(count) / rate).tolist()
    gaps = np.random.default_rng(seed).exponential(1.0, max(count - 1, 0)) / rate
    return np.concatenate(([0.0], np.cumsum(gaps)))[:count].tolist()


@dataclass
class Slo:
    """Latency targets (service-level objectives) a request must meet to count toward goodput."""

    ttft_s: float  # its first token within this
    itl_s: float  # its mean gap between tokens (``RequestRecord.itl_s``) within this

    def met_by(self, record: RequestRecord) -> bool:
        """True for a request that succeeded within both targets. Its ITL is its *mean* gap, as vLLM's TPOT
        target reads it: one slow step among many does not fail a request, a slow stream does. A request
        with no gap to measure (one token, or a server measured without streaming) is judged on TTFT alone."""
        return (record.ok and record.ttft_s is not None and record.ttft_s <= self.ttft_s
                and (record.itl_s is None or record.itl_s <= self.itl_s))


def sustainable_rate(summaries: list[dict[str, Any]], share: float) -> float | None:
    """The highest offered rate of a sweep at which at least ``share`` of the requests met the SLOs (its
    ``goodput_share``), or None if no rate did: the load the server takes within its latency targets."""
    return max((s["rate"] for s in summaries if s["goodput_share"] >= share), default=None)


@dataclass
class RateResult:
    """One rate of an open-loop sweep: the schedule, what was measured, and (from the server's traces, when
    it wrote them) how long each request waited in its queue."""

    rate: float  # offered: requests per second
    arrivals: list[float]  # when each request was due, seconds from the start
    max_concurrency: int | None
    sent: Sent
    queued_s: dict[str, float] | None = None  # request id -> seconds in the queue; None: no traces

    def summary(self, slo: Slo) -> dict[str, Any]:
        """The rate's aggregates (latencies over the requests that succeeded), and its goodput: the
        requests per second that met ``slo``, over the rate's wall time, and their share of all requests."""
        records, wall_s = self.sent.records, self.sent.wall_s
        ok = [r for r in records if r.ok]
        met = sum(slo.met_by(r) for r in records)
        output_tokens = sum(r.output_tokens for r in ok)

        def stats(values: list[float | None]) -> dict[str, float] | None:
            s = TailStats.of([v for v in values if v is not None])
            return None if s is None else asdict(s)

        queued = None if self.queued_s is None else [self.queued_s.get(r.request_id or "") for r in ok]
        return {
            "rate": self.rate,
            "max_concurrency": self.max_concurrency,
            "requests": len(records),
            "errors": len(records) - len(ok),
            "wall_s": wall_s,
            "achieved_rate": len(ok) / wall_s if wall_s > 0 else 0.0,
            "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else 0.0,
            "ttft_s": stats([r.ttft_s for r in ok]),
            "itl_s": stats([r.itl_s for r in ok]),
            "e2e_s": stats([r.e2e_s for r in ok]),
            "queued_s": None if queued is None else stats(queued),
            "goodput": met / wall_s if wall_s > 0 else 0.0,
            "goodput_share": met / len(records) if records else 0.0,
            "in_flight": {"source": self.sent.in_flight.source, "mean": self.sent.in_flight.mean,
                          "max": self.sent.in_flight.max},
            "engine_busy": self.sent.engine_busy,
            "prefix_cache_hit_rate": self.sent.prefix_cache_hit_rate,
            **token_time(self.sent.step_phases, stats([r.itl_s for r in ok])),
        }


def queued_seconds(traces: list[dict[str, Any]]) -> dict[str, float]:
    """Each traced request's time in the queue: the sum of its ``queued`` spans (more than one when it was
    preempted and waited again), by request id."""
    return {trace["request_id"]: trace["totals_ms"].get("queued", 0.0) / 1000 for trace in traces}


async def read_queueing(trace_file: Path, request_ids: set[str]) -> dict[str, float]:
    """The queueing time of each of ``request_ids`` from the server's trace file, waiting up to TRACE_WAIT_S
    for the last traces to be written; a request whose trace never came is left out."""
    deadline = time.monotonic() + TRACE_WAIT_S
    while True:
        try:
            found = queued_seconds(read_traces(trace_file)) if trace_file.exists() else {}
        except json.JSONDecodeError:  # we read a long trace while the server was still writing it: read again
            found = {}
        if request_ids <= found.keys() or time.monotonic() > deadline:
            return {rid: seconds for rid, seconds in found.items() if rid in request_ids}
        await asyncio.sleep(0.05)


async def run_rate(workload: Workload, rate: float, arrivals: list[float], max_concurrency: int | None = None,
                   trace_file: Path | None = None, desc: str = "") -> RateResult:
    """Send a request at each of ``arrivals`` (an open loop), then read their queueing times from the
    server's ``trace_file`` if it writes one."""
    sent = await send_requests(workload, arrivals, max_concurrency, desc or f"rate {rate:g}/s")
    ids = {r.request_id for r in sent.records if r.request_id is not None}
    queued = None if trace_file is None else await read_queueing(trace_file, ids)
    return RateResult(rate, arrivals, max_concurrency, sent, queued)


async def run_rates(workload: Workload, rates: list[float], requests_per_rate: int, slo: Slo,
                    arrivals: Arrivals = "poisson", seed: int = 0, max_concurrency: int | None = None,
                    trace_file: Path | None = None, label: str = "") -> list[RateResult]:
    """Run the rates one after the other, each with its own schedule from the same seed, printing a one-line
    summary after each."""
    results = []
    for rate in rates:
        schedule = arrival_times(rate, requests_per_rate, arrivals, seed)
        result = await run_rate(workload, rate, schedule, max_concurrency, trace_file,
                                desc=f"{label} rate={rate:g}/s".strip())
        results.append(result)
        tqdm.write(format_rate_summary(result.summary(slo)))
    return results


def format_rate_summary(s: dict[str, Any]) -> str:
    def ms(stats: dict[str, float] | None, stat: str) -> str:
        return "  n/a" if stats is None else f"{1000 * stats[stat]:5.0f}"

    return (f"rate {s['rate']:5g}/s: achieved {s['achieved_rate']:5.2f}/s, {s['output_tokens_per_s']:6.1f} tok/s, "
            f"TTFT p50 {ms(s['ttft_s'], 'p50')} p90 {ms(s['ttft_s'], 'p90')} ms, ITL p50 {ms(s['itl_s'], 'p50')} ms, "
            f"queued p50 {ms(s['queued_s'], 'p50')} ms, goodput {s['goodput']:5.2f}/s "
            f"({100 * s['goodput_share']:3.0f}% met the SLOs), in flight {s['in_flight']['mean'] or 0:5.1f}, "
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
    would otherwise land in the first level's numbers.

    It is the workload's first request, shared prefix included. So a server with a prefix cache
    starts the sweep with the system prompt cached: the sweep measures the steady state of a server
    that has seen its system prompt before, as a production server has, and not one cold prefill
    that any server pays once. Every server, our stages and a peer measured with --url alike, gets
    this same request, so the comparison stays fair; and the warm-up pays for set-up at the
    workload's real prompt length (a GPU kernel tuned for long prefills, say)."""
    record = RequestRecord(0, start_s=0.0)
    async with new_client(workload, 1) as client:
        await run_one(client, workload, record)
    if not record.ok:
        raise RuntimeError(f"the warm-up request failed: {record.error}")
