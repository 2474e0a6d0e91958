"""Stage 10: the gateway. The rules alone first (the difficulty rule, the prefix router's choice, the scaling
decision: no Ray), then one fleet on a local Ray instance for the whole module: two models (the embedded
model's folder twice, under two names, so that "small" and "large" are separate deployments), 2 to 3 replicas
of the small model and one of the large, each with one PyTorch thread and a fraction of a CPU, short autoscaling
delays. The last test stops it and checks that nothing is left running."""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest

from common.net import free_port

from .conftest import stage
from .prompts import TEXT_PROMPTS

FOLDER = "10_gateway"
routing = stage(FOLDER, "routing")
prefix_router = stage(FOLDER, "prefix_router")
autoscaling = stage(FOLDER, "autoscaling")
replica = stage(FOLDER, "replica")
fleet = stage(FOLDER, "fleet")
gateway_config = stage(FOLDER, "gateway_config")

RULE = routing.DifficultyRule(long_prompt_tokens=100, long_output_tokens=200, hard_prompt_score=2)


# --- the difficulty rule (Exercise 10.3) ----------------------------------------------------------


@pytest.mark.exercise("10.3")
@pytest.mark.parametrize(("prompt_tokens", "max_tokens", "text", "expected"), [
    (20, 16, "What is the capital of France?", routing.Route("small", "easy")),
    (20, None, "Hi there", routing.Route("small", "easy")),  # no max_tokens says nothing of the answer's length
    (100, 16, "Hi there", routing.Route("large", "long_prompt")),  # the threshold itself is long
    (99, 200, "Hi there", routing.Route("large", "long_output")),
    (20, 16, "Prove it step by step", routing.Route("large", "hard_prompt")),
    (20, 16, "Prove it, prove it again, PROVE it", routing.Route("small", "easy")),  # one marker, however often
    (150, 500, "prove step by step", routing.Route("large", "long_prompt")),  # the first reason that holds
])
def test_the_difficulty_rule_picks_a_size_and_says_why(prompt_tokens, max_tokens, text, expected):
    assert routing.choose_size(prompt_tokens, max_tokens, text, RULE) == expected


def test_hardness_counts_each_marker_once_whatever_its_case():
    assert routing.hardness("PROVE that... then prove again, step by step") == 2
    assert routing.hardness("What time is it?") == 0


# --- the prefix router's choice (Exercise 10.1) ---------------------------------------------------


def hashes(*blocks: int) -> list[bytes]:
    """Chained digests of blocks named by numbers: (1, 2) is the prefix "block 1 then block 2"."""
    out, parent = [], b""
    for block in blocks:
        parent = stage(FOLDER, "prefix_index").block_hash(parent, [block] * 4)
        out.append(parent)
    return out


@pytest.mark.exercise("10.1")
def test_a_repeated_prefix_goes_back_to_its_replica():
    owners = prefix_router.PrefixOwners()
    owners.record(hashes(1, 2, 3), "a")
    owners.record(hashes(1, 5), "b")  # b was sent block 1 later, then a block of its own
    loads = {"a": 3, "b": 3, "c": 0}
    rng = random.Random(0)
    for _ in range(20):
        assert prefix_router.prefer(hashes(1, 2, 3, 4), owners, loads, 8, rng, min_blocks=1) == ("a", "prefix")
        assert prefix_router.prefer(hashes(1, 5, 6), owners, loads, 8, rng, min_blocks=1) == ("b", "prefix")


@pytest.mark.exercise("10.1")
def test_a_new_prefix_goes_to_the_less_loaded_of_two():
    owners = prefix_router.PrefixOwners()
    loads = {"a": 5, "b": 1, "c": 9}
    seen = {prefix_router.prefer(hashes(7), owners, loads, 8, random.Random(seed), min_blocks=1) for seed in range(50)}
    # Two of three drawn: "b" whenever it is drawn, "a" when the draw is a and c; never "c".
    assert seen == {("b", "no_match"), ("a", "no_match")}


@pytest.mark.exercise("10.1")
def test_the_load_guard_leaves_a_replica_too_far_ahead():
    owners = prefix_router.PrefixOwners()
    owners.record(hashes(1, 2), "a")
    rng = random.Random(0)
    prefer = functools.partial(prefix_router.prefer, hashes(1, 2), owners, imbalance=8, rng=rng, min_blocks=1)
    assert prefer(loads={"a": 10, "b": 2}) == ("a", "prefix")  # 8 ahead: it stays
    assert prefer(loads={"a": 11, "b": 2}) == ("b", "imbalance")
    # A replica no longer among the candidates (stopped, or full) is no owner.
    assert prefer(loads={"b": 2, "c": 2})[1] == "no_match"
    assert prefer(loads={"a": 50}) == ("a", "prefix")  # the only one


@pytest.mark.exercise("10.1")
def test_a_match_shorter_than_min_blocks_is_no_match():
    """A chat template's opening is shared by every chat: it must not herd them all onto one replica."""
    owners = prefix_router.PrefixOwners()
    owners.record(hashes(1, 2, 3), "a")
    loads = {"a": 0, "b": 0, "c": 0}
    assert prefix_router.prefer(hashes(1, 2, 3, 9), owners, loads, 8, random.Random(0), min_blocks=3)[1] == "prefix"
    chosen = {prefix_router.prefer(hashes(1, 2, 8), owners, loads, 8, random.Random(seed), min_blocks=3)
              for seed in range(30)}
    assert {why for _, why in chosen} == {"no_match"} and {replica for replica, _ in chosen} == {"a", "b", "c"}


def test_the_owner_table_forgets_the_oldest_and_the_dead():
    owners = prefix_router.PrefixOwners(capacity=3)
    owners.record(hashes(1, 2), "a")
    owners.record(hashes(9), "b")
    owners.record(hashes(8), "b")  # the table holds 3: block 1's digest, the oldest, is forgotten
    assert len(owners) == 3
    assert owners.longest_match(hashes(1), {"a": 0, "b": 0}) == (None, 0)
    assert owners.longest_match(hashes(1, 2), {"a": 0, "b": 0}) == ("a", 2)  # a chained digest names the whole prefix
    owners.forget("b")
    assert len(owners) == 1 and owners.longest_match(hashes(9), {"b": 0}) == (None, 0)


def test_the_deepest_owner_still_there_wins():
    owners = prefix_router.PrefixOwners()
    owners.record(hashes(1, 2, 3), "a")
    owners.record(hashes(1), "b")  # b was sent the first block last
    assert owners.longest_match(hashes(1, 2, 3, 4), {"a": 0, "b": 0}) == ("a", 3)
    assert owners.longest_match(hashes(1, 7), {"a": 0, "b": 0}) == ("b", 1)
    assert owners.longest_match(hashes(1, 2, 3), {"b": 0}) == ("b", 1)  # a is gone: b's one block is the match


# --- the scaling decision (Exercise 10.2) ---------------------------------------------------------


@pytest.mark.exercise("10.2")
@pytest.mark.parametrize(("current", "waiting", "running", "expected"), [
    (1, 0, 0, 1),  # idle, at one replica: stays
    (1, 8, 64, 1),  # 8 waiting: what one replica tolerates
    (1, 9, 64, 2),  # one more: a replica more
    (2, 16 + 97, 128, 4),  # 97 beyond 2 x 8: two replicas of 96 slots
    (3, 0, 96, 2),  # nothing waits and 96 running fit in half of 2 x 96 slots: one fewer
    (3, 0, 97, 3),  # 97 do not
    (3, 1, 0, 3),  # something waits: never down
])
def test_the_decision_follows_the_queue_not_the_batch(current, waiting, running, expected):
    assert autoscaling.desired_replicas(current, waiting, running, target_depth=8, slots=96) == expected


def test_the_policy_adds_the_queue_at_the_gateway_to_the_replicas_queues():
    policy = autoscaling.QueueDepthPolicy(target_depth=8, slots=96)
    ctx = SimpleNamespace(current_num_replicas=1, total_queued_requests=5,
                          aggregated_metrics={"waiting": {"r1": 4.0}, "running": {"r1": 96.0}})
    assert policy(ctx) == (2, {"waiting": 9.0, "running": 96.0})  # 4 in the scheduler + 5 at the gateway > 8
    ctx.total_queued_requests = 0
    assert policy(ctx)[0] == 1


# --- a replica's in-process call ------------------------------------------------------------------


def test_call_app_streams_and_a_caller_that_leaves_cancels_the_app():
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app, closed = FastAPI(), asyncio.Event()

    @app.post("/count")
    async def count() -> StreamingResponse:
        async def numbers():
            try:
                for i in range(1000):
                    yield f"{i}\n"
                    await asyncio.sleep(0.01)
            finally:
                closed.set()
        return StreamingResponse(numbers(), media_type="text/plain")

    async def run() -> list[dict]:
        messages = []
        async for message in replica.call_app(app, "POST", "/count", b"{}"):
            messages.append(message)
            if len(messages) == 3:  # the start and two pieces of body, then the caller leaves
                break
        await asyncio.wait_for(closed.wait(), 5)
        return messages

    messages = asyncio.run(run())
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    assert [m["body"] for m in messages[1:]] == [b"0\n", b"1\n"]


# --- the fleet on Ray ---------------------------------------------------------------------------


# 12 s before a replica goes: the third replica, started by the first burst, comes up during the two bursts (about
# a minute on 2 busy cores) and has 12 s more after them.
FLEET = gateway_config.GatewayConfig(
    min_replicas=2, max_replicas=3, large_replicas=1, replica_cpus=0.25, max_ongoing_requests=8,
    max_queued_requests=40, router_imbalance=2, long_prompt_tokens=200, long_output_tokens=256, target_queue_depth=2,
    upscale_delay_s=0.5, downscale_delay_s=12.0, metrics_interval_s=0.25)


@pytest.fixture(scope="module")
def gateway(model_dir: Path) -> Iterator[SimpleNamespace]:
    engine = stage(FOLDER, "config").EngineConfig(model=str(model_dir), dtype="float32", kv_cache_mb=64,
                                                 speculative="off", max_num_seqs=8, max_num_batched_tokens=64)
    specs = fleet.model_specs(engine, FLEET, str(model_dir))  # the same folder twice: two deployments
    url = fleet.start(specs, FLEET, port=free_port())
    live = SimpleNamespace(url=url, small=specs[0].name, large=specs[1].name, stopped=False)
    yield live
    if not live.stopped:
        fleet.stop()


def test_the_large_model_can_be_pinned_to_a_number_of_replicas(model_dir):
    specs = fleet.model_specs(stage(FOLDER, "config").EngineConfig(model=str(model_dir)), FLEET, str(model_dir))
    assert [fleet.replica_bounds(spec, FLEET) for spec in specs] == [(2, 3), (1, 1)]
    unpinned = gateway_config.GatewayConfig(min_replicas=1, max_replicas=4, replica_cpus=0.5)
    assert [fleet.replica_bounds(spec, unpinned) for spec in specs] == [(1, 4), (1, 4)]
    assert fleet.cpus_needed(specs, FLEET) == (3 + 1) * 0.25


def chat(url: str, model: str, content: str, **fields) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def replica_states(url: str, model: str) -> dict[str, int]:
    return httpx.get(f"{url}/health", timeout=30).json()["models"][model]["replicas"]


def wait_for(condition, timeout: float, what: str) -> float:
    """Poll ``condition`` every 0.5 s (a /health asks Ray Serve's controller for the replicas' states); the seconds
    it took to hold."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"{what} within {timeout} s"
        time.sleep(0.5)
    return time.monotonic() - started


def test_greedy_answers_through_the_gateway_are_hugging_faces(gateway, model_dir, hf_greedy):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert replica_states(gateway.url, gateway.large) == {"RUNNING": 1}  # pinned (FLEET.large_replicas)
    cases = [(prompt, model) for prompt in TEXT_PROMPTS for model in (gateway.small, gateway.large)]

    def complete(prompt: str, model: str) -> httpx.Response:
        return httpx.post(f"{gateway.url}/v1/completions", timeout=120, json={
            "model": model, "prompt": tokenizer(prompt).input_ids, "max_tokens": 32, "temperature": 0})

    with ThreadPoolExecutor(len(cases)) as pool:  # all at once: each replica batches what it is sent
        responses = list(pool.map(complete, *zip(*cases, strict=True)))
    for (prompt, _), response in zip(cases, responses, strict=True):
        assert response.status_code == 200, response.text
        ids = tokenizer(prompt).input_ids
        assert response.json()["choices"][0]["text"] == tokenizer.decode(hf_greedy(ids, 32)), prompt


SYSTEM = ("You answer questions about a small bicycle shop in one sentence. The shop opens at nine and closes at six, "
          "from Monday to Saturday; it repairs bicycles of every make, sells tyres, lights and locks, and rents "
          "city bicycles by the hour or the day. Be polite and never recommend another shop.")


def ask_with_system(url: str, model: str, system: str, question: str, **fields) -> httpx.Response:
    body = {"model": model, "max_tokens": 8, "temperature": 0, **fields,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def counter(url: str, name: str, **labels: str) -> float:
    """One labelled sample of the gateway's /metrics (0 when it has not been counted yet)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f"{name}{{"):
            sample, value = line.rsplit(" ", 1)
            if ",".join(sorted(sample[len(name) + 1:-1].split(","))) == wanted:
                return float(value)
    return 0.0


def test_requests_go_to_the_model_they_name_or_the_rule_picks(gateway):
    before = counter(gateway.url, "llm_gateway_requests_total", model=gateway.large, reason="hard_prompt")
    cases = [
        ("auto", "What is the capital of France?", gateway.small, "easy"),
        ("auto", "Prove step by step that there are infinitely many primes.", gateway.large, "hard_prompt"),
        ("auto", "Tell me about bicycles. " * 60, gateway.large, "long_prompt"),  # 300+ tokens: a long job
        (gateway.large, "What is the capital of France?", gateway.large, "named"),
        (gateway.small, "Prove step by step that there are infinitely many primes.", gateway.small, "named"),
    ]
    for model, content, expected, reason in cases:
        response = chat(gateway.url, model, content)
        assert response.status_code == 200, response.text
        assert (response.headers["x-model"], response.headers["x-route"]) == (expected, reason), content
        assert response.json()["model"] == expected  # the answer names the model that gave it
    after = counter(gateway.url, "llm_gateway_requests_total", model=gateway.large, reason="hard_prompt")
    assert after == before + 1

    unknown = chat(gateway.url, "gpt-4", "Hi")
    assert unknown.status_code == 400
    error = unknown.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert gateway.small in error["message"] and "auto" in error["message"]
    listed = httpx.get(f"{gateway.url}/v1/models", timeout=30).json()["data"]
    assert [card["id"] for card in listed] == [gateway.small, gateway.large, "auto"]


# Each: (route, body) that stage 09 refuses with a 400. The gateway must answer exactly the same error object:
# the schema's errors from the same models at the gateway, the engine's own checks from the replica's stage 09 app.
BAD_REQUESTS = [
    ("/v1/completions", b"{"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", {}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "5"}),
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}),
    ("/v1/completions", {"prompt": "Hi", "n": 0}),
    ("/v1/completions", {"prompt": "Hi", "best_of": 2}),
    ("/v1/completions", {"prompt": [10**7]}),  # a token id past the vocabulary: the replica's check
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"99999999": 1}}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 100_000}),  # past the context: the replica's check
    ("/v1/completions", {"prompt": "Hi", "echo": True, "n": 2}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21}),
]


@pytest.mark.parametrize(("route", "body"), BAD_REQUESTS, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_the_same_400_as_stage_09(gateway, server09, route, body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    ours = httpx.post(f"{gateway.url}{route}", content=content, headers=headers, timeout=60)
    theirs = httpx.post(f"{server09.url}{route}", content=content, headers=headers, timeout=60)
    assert theirs.status_code == 400, theirs.text  # (the list holds only what stage 09 refuses)
    assert (ours.status_code, ours.json()) == (400, theirs.json())


def test_a_repeated_prefix_goes_to_the_same_replica_and_hits_its_cache(gateway):
    answers = [ask_with_system(gateway.url, gateway.small, SYSTEM, question)
               for question in ("When do you open?", "Do you sell locks?", "Can I rent a bicycle?", "Hello?")]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert len({a.headers["x-replica"] for a in answers}) == 1
    cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert all(c >= 64 for c in cached[1:]), cached  # the system prompt's blocks, found on that replica


def stream_open(client: httpx.Client, url: str, body: dict) -> httpx.Response:
    request = client.build_request("POST", f"{url}/v1/chat/completions", json={**body, "stream": True})
    return client.send(request, stream=True)


def test_the_router_leaves_a_replica_too_far_ahead(gateway):
    """With router_imbalance 2, the replica holding a prefix keeps it only while it holds at most 2 requests
    more than the other: six long streams of one prefix, opened at once, end up on both replicas."""
    system = "You are a pirate who speaks only of the sea. " * 6
    first = ask_with_system(gateway.url, gateway.small, system, "Ahoy?")
    assert first.status_code == 200
    body = {"model": gateway.small, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Tell me a long story."}]}
    with httpx.Client(timeout=120) as client:
        streams = [stream_open(client, gateway.url, body) for _ in range(6)]
        try:
            served = [s.headers["x-replica"] for s in streams]
        finally:
            for s in streams:
                s.close()
    assert first.headers["x-replica"] in served
    assert len(set(served)) == 2, served


def running_replicas(gateway: SimpleNamespace) -> int:
    return replica_states(gateway.url, gateway.small).get("RUNNING", 0)


def test_the_gateway_queues_what_the_replicas_cannot_hold(gateway):
    """48 streams at once, 16 to 24 slots in the replicas: the rest wait at the gateway, and every one ends whole."""

    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, bool]:
        body = {"model": gateway.small, "prompt": f"Number {i}:", "max_tokens": 8, "ignore_eos": True, "stream": True}
        async with http.stream("POST", f"{gateway.url}/v1/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line]
        finished = any('"finish_reason":"length"' in line for line in lines)
        return response.status_code, finished and lines[-1] == "data: [DONE]"

    async def run() -> list[tuple[int, bool]]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(48)))

    assert asyncio.run(run()) == [(200, True)] * 48


def test_past_its_queue_the_gateway_refuses_with_503_and_retry_after(gateway):
    """120 requests at once against at most 3 x 8 slots and a queue of 40: the rest are refused at once, with 503
    and Retry-After. How many depends on the machine: a request that finishes while the burst still arrives frees
    its place (on 2 busy cores, up to a third of the 56 beyond slots and queue were let in that way)."""

    async def one(http: httpx.AsyncClient, i: int) -> httpx.Response:
        return await http.post(f"{gateway.url}/v1/completions", json={
            "model": gateway.small, "prompt": f"Number {i}:", "max_tokens": 16, "ignore_eos": True})

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=128)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(120)))

    responses = asyncio.run(run())
    refused = [r for r in responses if r.status_code == 503]
    assert {r.status_code for r in responses} == {200, 503}
    assert len(refused) >= (120 - 3 * 8 - 40) // 2, f"{len(refused)} refused"
    assert all(r.headers.get("retry-after") == "1" and r.json()["error"]["code"] == "overloaded" for r in refused), \
        [(r.headers, r.text) for r in refused if r.headers.get("retry-after") != "1"][:2]


def test_the_fleet_grows_on_queued_requests(gateway):
    """The two bursts above queued requests at the gateway, past target_queue_depth per replica for longer than
    upscale_delay_s: the autoscaler added a third replica, which starts and loads its model."""
    wait_for(lambda: running_replicas(gateway) == 3, 120, "a third replica after the queued bursts")


def test_the_fleet_shrinks_when_idle(gateway):
    def two_running_and_no_other() -> bool:
        return {state: n for state, n in replica_states(gateway.url, gateway.small).items() if n} == {"RUNNING": 2}

    wait_for(two_running_and_no_other, 120, "back to 2 replicas once idle")


def test_a_client_that_leaves_frees_its_place(gateway):
    from ray import serve

    body = {"model": gateway.small, "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me everything."}]}
    with httpx.Client(timeout=120) as client:
        response = stream_open(client, gateway.url, body)
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the stream has begun
        response.close()  # the client leaves
    in_flight = lambda: httpx.get(f"{gateway.url}/health", timeout=30).json()["models"][gateway.small]["in_flight"]  # noqa: E731
    wait_for(lambda: in_flight() == 0, 30, "the gateway to drop the request")
    handle = serve.get_deployment_handle(fleet.deployment_name(gateway.small), app_name=fleet.APP_NAME)
    seen: dict[str, int] = {}

    def every_replica_idle() -> bool:
        for _ in range(8):  # calls without prefix hashes spread over the replicas
            health = handle.health.remote().result(timeout_s=30)
            seen[health["replica"]] = health["running"] + health["waiting"]
        return len(seen) >= 2 and not any(seen.values())

    wait_for(every_replica_idle, 30, "every replica's engine to drop the request")


def test_a_replica_killed_mid_stream_gives_an_error_event_and_the_gateway_goes_on(gateway):
    import ray

    body = {"model": gateway.small, "max_tokens": 300, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    with httpx.Client(timeout=120) as client:
        response = stream_open(client, gateway.url, body)
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        name = f"SERVE_REPLICA::{fleet.APP_NAME}#{fleet.deployment_name(gateway.small)}#{response.headers['x-replica']}"
        ray.kill(ray.get_actor(name, namespace="serve"))
        rest = [line for line in lines if line]
    errors = [json.loads(line[6:])["error"] for line in rest if line.startswith("data: {\"error\"")]
    assert [e["code"] for e in errors] == ["replica_failed"] and rest[-1] == "data: [DONE]"
    again = chat(gateway.url, gateway.small, "Are you still there?")  # another replica answers
    assert again.status_code == 200, again.text
    wait_for(lambda: running_replicas(gateway) < 2, 30, "Ray Serve to see the replica gone")
    wait_for(lambda: running_replicas(gateway) == 2, 120, "Ray Serve to replace the killed replica")


def is_ray(process: psutil.Process) -> bool:
    """One of Ray's processes; a child that has exited (a zombie, not yet reaped: any test's) runs nothing."""
    try:
        return "ray" in " ".join(process.cmdline()).lower()
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return False


def test_nothing_is_left_running_after_shutdown(gateway):
    ours = [p for p in psutil.Process().children(recursive=True) if is_ray(p)]
    assert ours, "Ray's processes are children of this one"
    fleet.stop()
    gateway.stopped = True
    _, alive = psutil.wait_procs(ours, timeout=60)
    assert not alive, [p.cmdline()[:3] for p in alive]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{gateway.url}/health", timeout=5)
