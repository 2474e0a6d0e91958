"""Stage 12: the gateway. The rules alone first (the difficulty rule, the prefix router's choice, the scaling
decision: no Ray), then one fleet on a local Ray instance for the whole module: two models (the embedded
model's folder twice, under two names, so that "small" and "large" are separate deployments), 2 to 3 replicas
of the small model and one of the large, each with one PyTorch thread and a fraction of a CPU, short autoscaling
delays. The last test stops it and checks that nothing is left running."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest
import ray
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from common.net import free_port

from .conftest import stage
from .prompts import TEXT_PROMPTS

FOLDER = "12_gateway"
routing = stage(FOLDER, "routing")
prefix_router = stage(FOLDER, "prefix_router")
autoscaling = stage(FOLDER, "autoscaling")
replica = stage(FOLDER, "replica")
fleet = stage(FOLDER, "fleet")
gateway_config = stage(FOLDER, "gateway_config")

RULE = routing.DifficultyRule(long_prompt_tokens=100, long_output_tokens=200, hard_prompt_score=2)


# --- the difficulty rule (Exercise 12.3) ----------------------------------------------------------


@pytest.mark.exercise("12.3")
@pytest.mark.parametrize(("prompt_tokens", "max_tokens", "text", "expected"), [
    (20, 16, "What is the capital of France?", routing.Route("small", "easy")),
    (20, None, "Hi there", routing.Route("small", "easy")),  # no max_tokens says nothing of the answer's length
    (100, 16, "Hi there", routing.Route("large", "long_prompt")),  # the threshold itself is long
    (99, 200, "Hi there", routing.Route("large", "long_output")),
    (20, 16, "Prove it step by step", routing.Route("large", "hard_prompt")),
    (20, None, "Prove it step by step", routing.Route("large", "hard_prompt")),  # no max_tokens: on to the words
    (20, 16, "Prove it, prove it again, PROVE it", routing.Route("small", "easy")),  # one marker, however often
    # The first reason that holds wins: every pair of reasons, then all three, so that the order is pinned.
    (100, 200, "Hi there", routing.Route("large", "long_prompt")),
    (100, 16, "Prove it step by step", routing.Route("large", "long_prompt")),
    (99, 200, "Prove it step by step", routing.Route("large", "long_output")),
    (150, 500, "prove step by step", routing.Route("large", "long_prompt")),
])
def test_the_difficulty_rule_picks_a_size_and_says_why(prompt_tokens, max_tokens, text, expected):
    assert routing.choose_size(prompt_tokens, max_tokens, text, RULE) == expected


def test_hardness_counts_each_marker_once_whatever_its_case():
    assert routing.hardness("PROVE that... then prove again, step by step") == 2
    assert routing.hardness("What time is it?") == 0


@pytest.mark.parametrize(("text", "score"), [
    ("How can I improve my waterproof jacket?", 0),  # not "prove" in improve, nor "proof" in waterproof
    ("Please proofread the letter and approve it", 0),
    ("Can you recommend a debugger, a calculator or an algorithmic trading app?", 0),
    ("Climb one step by stepping on the box", 0),  # a phrase is whole words too
])
def test_hardness_matches_whole_words_only(text, score):
    assert routing.hardness(text) == score


@pytest.mark.parametrize(("text", "score"), [
    ("Proving it step-by-step", 2),  # a phrase word by word, across hyphens
    ("Compare the algorithms", 2),  # a verb, a plural
    ("Give the derivation and its proof", 2),  # the noun of a verb counts as the verb
    ("Analyse it, analyze it, write the analysis", 1),  # one idea in any of its forms counts once
    ("What are the trade offs? The tradeoffs, the trade-offs!", 1),
])
def test_hardness_counts_the_forms_written_in_the_list(text, score):
    assert routing.hardness(text) == score


# --- the prefix router's choice (Exercise 12.1) ---------------------------------------------------


def hashes(*blocks: int) -> list[bytes]:
    """Chained digests of blocks named by numbers: (1, 2) is the prefix "block 1 then block 2"."""
    out, parent = [], b""
    for block in blocks:
        parent = stage(FOLDER, "prefix_index").block_hash(parent, [block] * 4)
        out.append(parent)
    return out


@pytest.mark.exercise("12.1")
def test_a_repeated_prefix_goes_back_to_its_replica():
    owners = prefix_router.PrefixOwners()
    owners.record(hashes(1, 2, 3), "a")
    owners.record(hashes(1, 5), "b")  # b was sent block 1 later, then a block of its own
    loads = {"a": 3, "b": 3, "c": 0}
    rng = random.Random(0)
    for _ in range(20):
        assert prefix_router.prefer(hashes(1, 2, 3, 4), owners, loads, 8, rng, min_blocks=1) == ("a", "prefix")
        assert prefix_router.prefer(hashes(1, 5, 6), owners, loads, 8, rng, min_blocks=1) == ("b", "prefix")


@pytest.mark.exercise("12.1")
def test_a_new_prefix_goes_to_the_less_loaded_of_two():
    owners = prefix_router.PrefixOwners()
    loads = {"a": 5, "b": 1, "c": 9}
    seen = {prefix_router.prefer(hashes(7), owners, loads, 8, random.Random(seed), min_blocks=1) for seed in range(50)}
    # Two of three drawn: "b" whenever it is drawn, "a" when the draw is a and c; never "c".
    assert seen == {("b", "no_match"), ("a", "no_match")}


@pytest.mark.exercise("12.1")
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


@pytest.mark.exercise("12.1")
def test_a_match_shorter_than_min_blocks_is_no_match():
    """A chat template's opening is shared by every chat: it must not herd them all onto one replica."""
    owners = prefix_router.PrefixOwners()
    owners.record(hashes(1, 2, 3), "a")
    loads = {"a": 0, "b": 0, "c": 0}
    assert prefix_router.prefer(hashes(1, 2, 3, 9), owners, loads, 8, random.Random(0), min_blocks=3)[1] == "prefix"
    chosen = {prefix_router.prefer(hashes(1, 2, 8), owners, loads, 8, random.Random(seed), min_blocks=3)
              for seed in range(30)}
    assert {why for _, why in chosen} == {"no_match"} and {replica for replica, _ in chosen} == {"a", "b", "c"}


class RecordingRandom(random.Random):
    """The router's own generator, keeping what it was asked to draw from (``populations``) and how many other
    draws it made (``draws``)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.populations: list[list] = []
        self.draws = 0

    def sample(self, population, k, **kwargs):
        self.populations.append(list(population))
        return super().sample(population, k, **kwargs)

    def choice(self, seq):
        self.populations.append(list(seq))
        return super().choice(seq)

    def choices(self, population, *args, **kwargs):
        self.populations.append(list(population))
        return super().choices(population, *args, **kwargs)

    def shuffle(self, x):
        self.populations.append(list(x))
        return super().shuffle(x)

    def random(self):
        self.draws += 1
        return super().random()

    def randrange(self, *args, **kwargs):
        self.draws += 1
        return super().randrange(*args, **kwargs)


@pytest.mark.exercise("12.1")
def test_the_owner_is_weighed_against_two_others_drawn_with_the_routers_generator():
    """The two the owner is compared with are drawn from the *other* replicas (drawn with it, the owner could be its
    own yardstick and never look too far ahead), and by the router's own ``rng`` (seeded, so that a test or a replay
    routes the same way; the global ``random`` is shared with everything else in the process)."""
    owners = prefix_router.PrefixOwners()
    owners.record(hashes(1, 2), "a")
    loads = {"a": 30, "b": 0, "c": 5, "d": 5}
    for seed in range(30):
        rng = RecordingRandom(seed)
        replica, why = prefix_router.prefer(hashes(1, 2), owners, loads, 8, rng, min_blocks=1)
        assert rng.populations or rng.draws, "the replicas are drawn with the router's own generator"
        assert all("a" not in population for population in rng.populations), "the owner is drawn against itself"
        assert (why, replica != "a") == ("imbalance", True)


@pytest.mark.exercise("12.1")
def test_a_loaded_owner_gives_way_to_the_less_loaded_of_the_two_drawn_not_of_all():
    """Power of two choices, not the least loaded of all: the least loaded replica ("b") wins only when drawn; a draw
    of c and d (one time in three) sends the request to one of them."""
    owners = prefix_router.PrefixOwners()
    owners.record(hashes(1, 2), "a")
    loads = {"a": 20, "b": 0, "c": 10, "d": 10}
    seen = {prefix_router.prefer(hashes(1, 2), owners, loads, 5, random.Random(seed), min_blocks=1)
            for seed in range(60)}
    assert ("b", "imbalance") in seen and seen & {("c", "imbalance"), ("d", "imbalance")}, seen
    assert {why for _, why in seen} == {"imbalance"}


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


# --- the router's ranks, inside Ray Serve (Exercise 12.4) -----------------------------------------
# Ray Serve builds the router in the gateway's process from its class; building it here takes no Ray instance.

DEPLOYMENT = DeploymentID(name="model", app_name="gateway")


class FakeReplica:
    """What Ray Serve's routing asks of a replica (a RunningReplica): its id, its slots, its requests now."""

    def __init__(self, name: str, slots: int = 4, held: int = 0) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = slots
        self.held = held

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.held


BACKOFF_S = 0.01  # between two rounds of Ray Serve's routing loop without room: shorter than its own, to wait less


def new_router(**state) -> prefix_router.PrefixAwareRouter:
    """The router as Ray Serve makes it (with a short, constant backoff), then its state."""
    router = prefix_router.PrefixAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN,
                                             use_replica_queue_len_cache=True, initial_backoff_s=BACKOFF_S,
                                             backoff_multiplier=1.0, max_backoff_s=BACKOFF_S)
    router.initialize_state(**state)
    return router


def pending(number: int, prefix: list[bytes]) -> PendingRequest:
    """A call as the gateway makes it: the prompt's block hashes in the ``prefix_hashes`` keyword."""
    return PendingRequest(args=[], kwargs={"prefix_hashes": prefix},
                          metadata=RequestMetadata(request_id=str(number), internal_request_id=str(number)))


def ranks_for(router: prefix_router.PrefixAwareRouter, replicas: list[FakeReplica],
              prefix: list[bytes] | None) -> list[list[str]]:
    """The router's ranks for a request with these block hashes (None: no request, as for a call that is no
    generation) as replica names, the empty ones left out (Ray Serve skips them)."""

    async def choose() -> list[list[FakeReplica]]:  # a request holds a future: it is made in the loop
        return await router.choose_replicas(replicas, None if prefix is None else pending(1, prefix))

    chosen = asyncio.run(choose())
    by_id = {replica.replica_id: replica for replica in replicas}
    assert all(by_id[replica.replica_id] is replica for rank in chosen for replica in rank), "not the replicas given"
    return [[replica.replica_id.unique_id for replica in rank] for rank in chosen if rank]


class ScriptedPrefer:
    """A stand-in for ``prefer`` (Exercise 12.1): it records each call's arguments by name and answers
    ``answer``, a replica's name and a reason, so that these tests grade the ranks alone."""

    def __init__(self) -> None:
        self.answer = ("", "")
        self.calls: list[dict] = []
        self.signature = inspect.signature(prefix_router.prefer)

    def __call__(self, *args, **kwargs) -> tuple[ReplicaID, str]:
        self.calls.append(dict(self.signature.bind(*args, **kwargs).arguments))
        name, reason = self.answer
        return ReplicaID(unique_id=name, deployment_id=DEPLOYMENT), reason


@pytest.fixture
def scripted_prefer(monkeypatch) -> ScriptedPrefer:
    stand_in = ScriptedPrefer()
    monkeypatch.setattr(prefix_router, "prefer", stand_in)
    return stand_in


def with_loads(router: prefix_router.PrefixAwareRouter, loads: dict[str, int | None]) -> list[FakeReplica]:
    """Replicas by name, and the requests the router last heard each one holds (None: never heard of)."""
    replicas = [FakeReplica(name) for name in loads]
    for replica, load in zip(replicas, loads.values(), strict=True):
        if load is not None:
            router.replica_queue_len_cache.update(replica.replica_id, load)
    return replicas


@pytest.mark.exercise("12.4")
def test_a_prompt_with_an_owner_waits_for_it(scripted_prefer):
    """The owner alone, however loaded: the router's own load guard has already said it is not too far ahead."""
    router = new_router()
    replicas = with_loads(router, {"a": 0, "b": 4, "c": 1})
    scripted_prefer.answer = ("b", "prefix")
    assert ranks_for(router, replicas, hashes(1, 2, 3, 4)) == [["b"]]


@pytest.mark.exercise("12.4")
@pytest.mark.parametrize("reason", ["no_match", "imbalance"])
def test_without_an_owner_any_replica_with_room_will_do_the_less_loaded_first(scripted_prefer, reason):
    router = new_router()
    replicas = with_loads(router, {"a": 5, "b": 1, "c": 9, "d": None})  # d: nothing heard yet, counted as idle
    scripted_prefer.answer = ("c", reason)
    assert ranks_for(router, replicas, hashes(1, 2, 3, 4)) == [["c"], ["d", "b", "a"]]


@pytest.mark.exercise("12.4")
def test_the_choice_is_asked_of_prefer_with_the_routers_state(scripted_prefer):
    router = new_router(imbalance=3, seed=7)
    replicas = with_loads(router, {"a": 2, "b": None})
    scripted_prefer.answer = ("a", "prefix")
    ranks_for(router, replicas, hashes(1, 2, 3, 4))
    ranks_for(router, replicas, None)  # a call that is no generation: no hashes
    first, second = scripted_prefer.calls
    assert list(first["hashes"]) == hashes(1, 2, 3, 4) and list(second["hashes"]) == []
    assert dict(first["loads"]) == {replicas[0].replica_id: 2, replicas[1].replica_id: 0}
    assert (first["owners"], first["imbalance"], first["rng"]) == (router.owners, 3, router.rng)


def test_a_replica_found_for_one_prompt_goes_to_that_request_not_the_oldest():
    """Ray Serve's own loop (the call its Router makes for each request), two requests waiting: the older one's
    owner is full, the newer one's has room. The newer one gets its owner; the older one waits for its own.
    With FIFOMixin, the replica found for the newer one's prompt would go to the older request; with a second
    rank of every other replica, the older one would take it too."""

    async def route() -> None:
        router = new_router()
        full, free = FakeReplica("full", slots=1, held=1), FakeReplica("free", slots=1)
        router.update_replicas([full, free])
        older, newer = pending(1, hashes(1, 2, 3, 4)), pending(2, hashes(5, 6, 7, 8))
        router.owners.record(prefix_router.prefix_hashes(older), full.replica_id)
        router.owners.record(prefix_router.prefix_hashes(newer), free.replica_id)
        waiting_older = asyncio.ensure_future(router._choose_replica_for_request(older))
        assert await asyncio.wait_for(router._choose_replica_for_request(newer), 10) is free
        assert not waiting_older.done()
        full.held = 0
        assert await asyncio.wait_for(waiting_older, 10) is full

    asyncio.run(route())


def test_a_request_that_waits_lets_ray_serve_sleep_between_rounds():
    """Every replica full: Ray Serve asks the router again after each round, but sleeps in between only if the
    router's ranks asked for it; without, its loop probes the replicas as fast as it can."""
    waited_s = 0.5

    async def rounds_while_waiting() -> int:
        router = new_router()
        replicas = [FakeReplica(name, slots=1, held=1) for name in ("a", "b")]
        router.update_replicas(replicas)
        rounds = 0
        choose = router.choose_replicas

        async def counted(*args, **kwargs):
            nonlocal rounds
            rounds += 1
            return await choose(*args, **kwargs)

        router.choose_replicas = counted
        waiting = asyncio.ensure_future(router._choose_replica_for_request(pending(1, hashes(1, 2, 3, 4))))
        await asyncio.sleep(waited_s)
        waiting.cancel()
        return rounds

    # Two rounds without a pause (the first, and its first retry), then one round per backoff at most.
    assert asyncio.run(rounds_while_waiting()) <= waited_s / BACKOFF_S + 2


# --- starting Ray on a busy machine ------------------------------------------------------------


class FlakyRay:
    """``ray.init`` and ``ray.shutdown`` that fail the first ``misses`` starts as Ray does when its node misses the
    start-up deadline on a loaded machine (or with ``error``, at once)."""

    TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet failed to "
               "startup or the GCS has become overloaded.")

    def __init__(self, misses: int, error: str = TIMEOUT) -> None:
        self.misses, self.error, self.inits, self.shutdowns = misses, error, 0, 0

    def init(self, **kwargs) -> None:
        self.inits += 1
        if self.inits <= self.misses:
            raise Exception(self.error)  # noqa: TRY002 - Ray's own: a bare Exception

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_a_ray_start_that_misses_its_deadline_is_tried_once_more(monkeypatch, capsys):
    flaky = FlakyRay(misses=1)
    monkeypatch.setattr(fleet.ray, "init", flaky.init)
    monkeypatch.setattr(fleet.ray, "shutdown", flaky.shutdown)
    fleet.start_ray(2)
    assert (flaky.inits, flaky.shutdowns) == (2, 1)  # what the first try started is shut down before the second
    assert "trying again" in capsys.readouterr().out


def test_a_ray_start_that_misses_twice_says_what_to_do_in_one_line(monkeypatch):
    flaky = FlakyRay(misses=2)
    monkeypatch.setattr(fleet.ray, "init", flaky.init)
    monkeypatch.setattr(fleet.ray, "shutdown", flaky.shutdown)
    with pytest.raises(fleet.RayDidNotStart, match="too busy") as failed:
        fleet.start_ray(2)
    assert flaky.inits == 2 and "\n" not in str(failed.value)


def test_ray_starts_while_other_processes_keep_every_core_busy():
    """What a busy laptop met: Ray's node has 30 s (fixed in Ray) to register, and a learner's machine is rarely
    idle. A busy loop per core holds the whole machine while the fleet's Ray starts, and it still comes up."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(psutil.cpu_count() or 2)]
    try:
        assert not ray.is_initialized()
        fleet.start_ray(2)
        assert ray.cluster_resources()["CPU"] == 2
        assert all(process.poll() is None for process in busy)  # the cores stayed busy the whole time
    finally:
        for process in busy:
            process.kill()
            process.wait()
        ray.shutdown()


def test_any_other_ray_error_is_not_retried(monkeypatch):
    flaky = FlakyRay(misses=1, error="num_cpus must be positive")
    monkeypatch.setattr(fleet.ray, "init", flaky.init)
    monkeypatch.setattr(fleet.ray, "shutdown", flaky.shutdown)
    with pytest.raises(Exception, match="num_cpus must be positive"):
        fleet.start_ray(2)
    assert flaky.inits == 1


# --- the scaling decision (Exercise 12.2) ---------------------------------------------------------


@pytest.mark.exercise("12.2")
@pytest.mark.parametrize(("current", "waiting", "running", "expected"), [
    (1, 0, 0, 1),  # idle, at one replica: stays
    (1, 8, 64, 1),  # 8 waiting: what one replica tolerates
    (1, 9, 64, 2),  # one more: a replica more
    (2, 16 + 97, 128, 4),  # 97 beyond 2 x 8: two replicas of 96 slots
    # Only the excess counts, not the whole queue: 92 beyond 8 fill one new replica (100 waiting would fill two).
    (1, 100, 96, 2),
    (2, 16 + 96, 192, 3),  # an excess of exactly one replica's slots: one more, not two
    (3, 0, 96, 2),  # nothing waits and 96 running fit in half of 2 x 96 slots: one fewer
    (3, 0, 97, 3),  # 97 do not
    (3, 1, 0, 3),  # something waits: never down
    (3, 0, 10, 2),  # a near-empty batch: down by one a decision, not straight to what the batch needs (1)
    (4, 0, 0, 3),  # idle: one at a time too
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


# --- the demo's burst: what it reads of its record, and its figure ----------------------------------------------


def test_the_demo_reads_its_burst_and_draws_it(tmp_path):
    demo = stage(FOLDER, "__main__")
    record = demo.BurstRecord("small", initial_replicas=2, target_queue_depth=4, max_ongoing_requests=4,
                              max_queued_requests=12, stopped_s=6.0)
    record.samples = [demo.Sample(t, states, "HEALTHY", "", in_flight) for t, states, in_flight in [
        (0.0, {"RUNNING": 2}, 20), (1.0, {"RUNNING": 2, "STARTING": 1}, 19), (5.0, {"RUNNING": 3}, 6)]]
    record.streams = [demo.Stream(0.0, 200, 0.1, 0.5, "a"), demo.Stream(0.0, 200, 2.0, 2.4, "b"),
                      demo.Stream(0.5, 503, 0.55, retry_after="1", code="overloaded"),
                      demo.Stream(5.5, 200, 5.6, 6.0, "c")]
    assert (record.decision_s(), record.running_s()) == (1.0, 5.0)  # a third replica asked for, then running
    # serve.status() read late: the third replica's first answer (5.6 s) says it ran before the status did.
    late = demo.BurstRecord("small", initial_replicas=2, target_queue_depth=4, max_ongoing_requests=4,
                            max_queued_requests=12, stopped_s=9.0, streams=record.streams,
                            samples=[*record.samples[:2], demo.Sample(8.0, {"RUNNING": 3}, "HEALTHY", "", 6)])
    assert late.running_s() == 5.6
    late.samples = record.samples[:2]  # never said to run, and never answered: it did not run
    late.streams = record.streams[:3]
    assert late.running_s() is None
    assert [record.waiting(s) for s in record.samples] == [12, 11, 0]  # in flight past 4 per running replica
    assert demo.plot_burst(record, tmp_path / "burst.png").read_bytes()[:4] == b"\x89PNG"


# --- the fleet on Ray ---------------------------------------------------------------------------


# 12 s before a replica goes: the third replica, started by the first burst, comes up during the two bursts (about
# a minute on 2 busy cores) and has 12 s more after them.
FLEET = gateway_config.GatewayConfig(
    min_replicas=2, max_replicas=3, large_replicas=1, replica_cpus=0.25, max_ongoing_requests=8,
    max_queued_requests=40, router_imbalance=2, long_prompt_tokens=200, long_output_tokens=256, target_queue_depth=2,
    upscale_delay_s=0.5, downscale_delay_s=12.0, metrics_interval_s=0.25)


@pytest.fixture(scope="module")
def gateway(model_dir: Path) -> Iterator[SimpleNamespace]:
    # Unquantized (quantization="none"): the replicas' answers are Hugging Face's float tokens (stage 11's tests hold
    # its quantized modes to their own reference).
    engine = stage(FOLDER, "config").EngineConfig(model=str(model_dir), dtype="float32", kv_cache_mb=64,
                                                 speculative="off", max_num_seqs=8, max_num_batched_tokens=64,
                                                 quantization="none")
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


def test_replicas_sharing_a_gpu_each_get_their_share_of_its_memory(monkeypatch):
    """Four replicas at --replica-gpus 0.25 on a (fake) 80 GiB GPU, started one after another, each finding the
    memory of those before it in use. The engine's own rule (no --kv-cache-mb), at the --gpu-memory-utilization
    0.2 the gateway once said would do, leaves the second replica nothing; the pool the gateway sets from each
    replica's share gives all four the same."""
    import torch

    kv_cache = stage(FOLDER, "kv_cache")
    gib, mib = 2**30, 2**20
    total, weights, in_use = 80 * gib, 300 * mib, [0]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - in_use[0], total))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)

    def start_four(kv_cache_mb: int, utilization: float) -> list[int]:
        """Each replica's pool in bytes: it loads its weights, then sizes its pool."""
        in_use[0], pools = 0, []
        for _ in range(4):
            in_use[0] += weights
            pools.append(kv_cache.budget_bytes(torch.device("cuda"), kv_cache_mb, utilization))
            in_use[0] += max(0, pools[-1])
        return pools

    assert start_four(kv_cache_mb=0, utilization=0.2)[1] <= 0
    kv_cache_mb = fleet.shared_kv_cache_mb(total, 0.25, 0.9, weights)
    assert kv_cache_mb == (18 * gib - 300 * mib) // mib  # 0.9 of a quarter of 80 GiB, less the weights
    assert start_four(kv_cache_mb, utilization=0.9) == [kv_cache_mb * mib] * 4
    assert in_use[0] == 72 * gib  # 0.9 of the GPU; the other tenth: the processes' CUDA contexts, activations, graphs
    with pytest.raises(ValueError, match="no room for a KV cache"):
        fleet.shared_kv_cache_mb(8 * gib, 0.05, 0.5, weights)  # 205 MiB of the GPU for 300 MiB of weights


def test_the_gateway_sizes_the_pools_only_of_replicas_that_share_a_gpu(model_dir):
    from dataclasses import replace

    import torch

    engine = stage(FOLDER, "config").EngineConfig(model=str(model_dir))
    quarter = gateway_config.GatewayConfig(replica_gpus=0.25)
    assert fleet.shares_a_gpu(engine, quarter)
    assert not fleet.shares_a_gpu(engine, gateway_config.GatewayConfig(replica_gpus=1))  # its own GPU
    assert not fleet.shares_a_gpu(engine, gateway_config.GatewayConfig(replica_gpus=0))  # on CPUs
    assert not fleet.shares_a_gpu(replace(engine, kv_cache_mb=512), quarter)  # a pool given
    assert not fleet.shares_a_gpu(replace(engine, device="cpu"), quarter)
    # The weights, from the files' headers: the float32 file's size (less its header), half that in bfloat16.
    file_bytes = sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))
    assert 0 < file_bytes - fleet.weight_bytes(engine, torch.float32) < 2**20
    assert fleet.weight_bytes(engine, torch.bfloat16) * 2 == fleet.weight_bytes(engine, torch.float32)
    draft = replace(engine, speculative="draft", draft_model=str(model_dir))  # a draft's weights too
    assert fleet.weight_bytes(draft, torch.float32) == 2 * fleet.weight_bytes(engine, torch.float32)


def chat(url: str, model: str, content: str, **fields) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def replica_states(url: str, model: str) -> dict[str, int]:
    return httpx.get(f"{url}/health", timeout=30).json()["models"][model]["replicas"]


def wait_for(condition, timeout: float, what: str) -> float:
    """Poll ``condition`` every 0.5 s (a /health reads the gateway's snapshot of the replicas' states, refreshed every
    second); the seconds it took to hold."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"{what} within {timeout} s"
        time.sleep(0.5)
    return time.monotonic() - started


def test_greedy_answers_through_the_gateway_are_hugging_faces(gateway, model_dir, hf_greedy):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Pinned (FLEET.large_replicas). (Waited for: the gateway's snapshot may be from before the replica ran.)
    wait_for(lambda: replica_states(gateway.url, gateway.large) == {"RUNNING": 1}, 10, "the large model's replica")
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


# Each: (route, body) that stage 11 refuses with a 400. The gateway must answer exactly the same error object:
# the schema's errors from the same models at the gateway, the engine's own checks from the replica's stage 11 app.
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
    assert theirs.status_code == 400, theirs.text  # (the list holds only what stage 11 refuses)
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
    """Requests kept queued at the gateway, past target_queue_depth per replica for longer than upscale_delay_s: the
    autoscaler adds a third replica, which starts and loads its model.

    The queue is held until that replica runs: a replica that takes longer to load than downscale_delay_s after its
    burst has drained is, rightly, stopped again before it ever runs (on a slow 2-core machine busy with the rest of
    the suite, a replica took over two minutes to build its engine, 2026-12-02, AMD EPYC)."""
    stop = threading.Event()

    async def keep_queued() -> None:
        async def client(i: int) -> None:
            body = {"model": gateway.small, "prompt": f"Number {i}:", "max_tokens": 16, "ignore_eos": True}
            while not stop.is_set():  # 32 clients against 2 x 8 slots: about 16 wait at the gateway
                await http.post(f"{gateway.url}/v1/completions", json=body)

        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as http:
            await asyncio.gather(*(client(i) for i in range(32)))

    load = threading.Thread(target=asyncio.run, args=(keep_queued(),))
    load.start()
    try:  # a bound on waiting, not a speed goal: a fleet that never grows still fails here
        wait_for(lambda: running_replicas(gateway) == 3, 300, "a third replica while requests are queued")
    finally:
        stop.set()
        load.join()


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


def test_the_gateway_shows_the_fleets_engines_and_settings(gateway):
    """/metrics carries each replica's stage 11 metrics, labelled by model and replica; /fleet the settings Ray Serve
    applies (the earlier tests generated tokens on the small model's replicas)."""
    settings = httpx.get(f"{gateway.url}/fleet", timeout=30).json()["models"][gateway.small]["settings"]
    assert (settings["max_ongoing_requests"], settings["max_queued_requests"]) == (FLEET.max_ongoing_requests,
                                                                                  FLEET.max_queued_requests)
    prefix = f'llm_generation_tokens_total{{model="{gateway.small}",replica="'

    def generated() -> list[float]:
        text = httpx.get(f"{gateway.url}/metrics", timeout=30).text
        return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)]

    # A replica started since the last refresh (the one that replaced the killed one) reports within a second or two.
    wait_for(lambda: len(generated()) >= 2, 30, "both replicas of the small model on /metrics")
    assert sum(generated()) > 0


# --- the gateway alone: its probes, its metrics, its imports (no Ray fleet) ----------------------------------------


gateway_module = stage(FOLDER, "gateway")


class FakeHandle:
    """A model's deployment handle without Ray: ``broadcast("report")`` answers ``reports``; a call records its body
    and answers a whole JSON response."""

    def __init__(self, reports: list | None = None) -> None:
        self.reports = reports or []
        self.bodies: list[dict] = []
        self.handle = SimpleNamespace(remote=self.call)

    def broadcast(self, method: str) -> SimpleNamespace:
        async def results_async(return_exceptions: bool = False) -> list:
            return list(self.reports)

        assert method == "report"
        return SimpleNamespace(results_async=results_async)

    def options(self, **_) -> FakeHandle:
        return self

    def call(self, method: str, path: str, body: bytes, prefix_hashes: list[bytes]):
        self.bodies.append(json.loads(body))

        async def answer():
            yield stage(FOLDER, "gateway_messages").ResponseStart(200, [("content-type", "application/json")], "r1")
            yield b'{"choices": []}'

        return answer()


def deployment_details(states: dict[str, str], **config) -> dict:
    """What the controller says of one deployment (the fields the gateway reads)."""
    return {"replicas": [{"replica_id": replica, "state": state} for replica, state in states.items()],
            "deployment_config": {"max_ongoing_requests": 96, "max_queued_requests": 256, **config}}


async def bare_gateway(model_dir: Path, handle: FakeHandle):
    """The gateway's own class (the one Ray Serve's ingress wraps), built on the running event loop as Ray Serve
    builds it, with one model behind a fake handle."""
    cls = gateway_module.Gateway.func_or_class.__bases__[0]
    return cls([gateway_module.ServedModel("small-model", "small", str(model_dir), handle, "model-small")], RULE, 16)


@pytest.fixture
def controller(monkeypatch) -> dict:
    """The controller's description of the deployments, as the test sets it; serve.status() must not be called."""
    details: dict = {}

    def status():
        raise AssertionError("/health and /metrics must not ask the controller: they read the snapshot")

    monkeypatch.setattr(gateway_module.serve, "status", status)
    monkeypatch.setattr(stage(FOLDER, "fleet_view"), "read_deployments", lambda: details)
    return details


def test_health_answers_from_the_snapshot_without_asking_the_controller(model_dir, controller):
    """A probe reads the last snapshot and says how old it is; only the background refresh asks the controller."""

    async def run() -> tuple[dict, int, dict]:
        gateway = await bare_gateway(model_dir, FakeHandle())
        before = json.loads((await gateway.health()).body)  # no snapshot yet: no replica known
        controller["model-small"] = deployment_details({"r1": "RUNNING", "r2": "STARTING"})
        await gateway.fleet.refresh_models()
        response = await gateway.health()
        return before, response.status_code, json.loads(response.body)

    before, status, health = asyncio.run(run())
    assert before["models"]["small-model"]["replicas"] == {}
    assert status == 200 and health["models"]["small-model"]["replicas"] == {"RUNNING": 1, "STARTING": 1}
    assert 0 <= health["snapshot_age_s"] < 60


def test_probe_port_answers_health_while_the_gateway_is_blocked(model_dir, controller):
    """The probe port (--health-port) serves the main port's /health, status and body (but ``in_flight``, the
    ingress's count) from a snapshot of its own thread: it answers while the gateway's event loop is blocked, as a
    flood blocks it, and turns 503 when the model has no running replica left."""
    probe_server = stage(FOLDER, "probe_server")
    controller["model-small"] = deployment_details({"r1": "RUNNING", "r2": "STARTING"})
    view = stage(FOLDER, "fleet_view").FleetView({"small-model": "model-small"}, {})
    server = probe_server.ProbeServer(view, {"small-model": "small"}, "127.0.0.1", 0)

    async def run() -> tuple[dict, dict, int, float]:
        gateway = await bare_gateway(model_dir, FakeHandle())
        await gateway.fleet.refresh_models()
        main = json.loads((await gateway.health()).body)
        started = time.perf_counter()
        side = httpx.get(server.url + "/health", timeout=5)  # a blocking call: the gateway's loop waits for it
        return main, side.json(), side.status_code, time.perf_counter() - started

    try:
        probe_server.wait_first_snapshot(view)
        main, side, status, seconds = asyncio.run(run())
        assert status == 200 and seconds < 1
        assert side == {**main, "models": {"small-model": {**main["models"]["small-model"], "in_flight": None}},
                        "snapshot_age_s": side["snapshot_age_s"]}
        controller["model-small"] = deployment_details({"r1": "STOPPING"})
        deadline = time.monotonic() + 10
        while (answer := httpx.get(server.url + "/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "the probe port's snapshot was not refreshed"
            time.sleep(0.1)
        assert answer.status_code == 503 and answer.json()["status"] == "no running replica of small-model"
    finally:
        server.close()


def engine_report(replica_id: str, generated: int, hits: int):
    """A replica's report as ModelReplica.report makes it: its stage 11 metrics, with some counted."""
    metrics = stage(FOLDER, "metrics").Metrics()
    metrics.generation_tokens.inc(generated)
    metrics.prefix_cache_queries.inc(2 * hits)
    metrics.prefix_cache_hits.inc(hits)
    return stage(FOLDER, "gateway_messages").EngineReport(replica_id, list(metrics.registry.collect()))


def test_metrics_carry_each_replicas_engine_under_stage_09s_names(model_dir, controller):
    """Every replica's stage 11 metrics, labelled by model and replica; a replica state that empties reads 0; the
    settings Ray Serve applies, on /fleet."""
    handle = FakeHandle([engine_report("r1", 5, 32), engine_report("r2", 7, 0)])

    async def run() -> tuple[str, dict]:
        gateway = await bare_gateway(model_dir, handle)
        controller["model-small"] = deployment_details({"r1": "RUNNING", "r2": "STARTING"})
        await gateway.fleet.refresh_models()
        controller["model-small"] = deployment_details(  # r2 has started
            {"r1": "RUNNING", "r2": "RUNNING"}, request_router_config={"request_router_kwargs": {"imbalance": 16}})
        await gateway.fleet.refresh_models()
        await gateway.fleet.refresh_engines("small-model")
        return (await gateway.metrics_text()).body.decode(), json.loads((await gateway.fleet_settings()).body)

    text, fleet_view = asyncio.run(run())
    lines = set(text.splitlines())
    for sample in ('llm_generation_tokens_total{model="small-model",replica="r1"} 5.0',
                   'llm_generation_tokens_total{model="small-model",replica="r2"} 7.0',
                   'llm_prefix_cache_hits_total{model="small-model",replica="r1"} 32.0',
                   'llm_prefix_cache_queries_total{model="small-model",replica="r1"} 64.0',
                   'llm_requests_running{model="small-model",replica="r2"} 0.0',
                   'llm_kv_blocks_used{model="small-model",replica="r1"} 0.0',
                   'llm_gateway_replicas{model="small-model",state="RUNNING"} 2.0',
                   'llm_gateway_replicas{model="small-model",state="STARTING"} 0.0'):
        assert sample in lines, sample
    assert sum(line.startswith("# TYPE llm_generation_tokens_total ") for line in lines) == 1  # one family
    model = fleet_view["models"]["small-model"]
    assert model["settings"]["max_queued_requests"] == 256 and model["settings"]["router_kwargs"] == {"imbalance": 16}
    assert model["replicas"]["r1"] == {"state": "RUNNING", "running": 0.0, "waiting": 0.0}


def chat_request(body: dict):
    """What the gateway's chat route is given: the validated request and the raw one (its body and path)."""
    from starlette.requests import Request

    from common.protocol import ChatCompletionRequest

    async def receive() -> dict:
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b"",
             "scheme": "http", "server": ("gateway", 80)}
    return ChatCompletionRequest(**body), Request(scope, receive)


def test_the_difficulty_rule_reads_the_users_words_only(model_dir, controller, monkeypatch):
    """An application's system prompt asks for reasoning in every chat; what the user asks decides."""
    seen: list[str] = []
    # Ray Serve keeps a copy of the class, made when it was decorated: its methods read names from the copy's globals.
    names = gateway_module.Gateway.func_or_class.pick.__globals__
    real = names["choose_size"]

    def spy(prompt_tokens: int, max_tokens: int | None, text: str, rule):
        seen.append(text)
        return real(prompt_tokens, max_tokens, text, rule)

    monkeypatch.setitem(names, "choose_size", spy)
    body = {"model": "auto", "max_tokens": 8, "messages": [
        {"role": "system", "content": "Explain step by step and prove every claim you make."},
        {"role": "user", "content": "When do you open?"},
        {"role": "assistant", "content": "Let me explain why, step by step."},
        {"role": "user", "content": "And on Sundays?"}]}
    handle = FakeHandle()

    async def run() -> int:
        gateway = await bare_gateway(model_dir, handle)
        return (await gateway.chat_completions(*chat_request(body))).status_code

    status = asyncio.run(run())
    assert seen == ["When do you open?\nAnd on Sundays?"]
    assert status == 200
    assert handle.bodies[0]["messages"] == body["messages"]  # the replica still gets the whole conversation


IMPORT_THE_GATEWAY = """
import importlib, importlib.util, sys
package, init, model = sys.argv[1:]
spec = importlib.util.spec_from_file_location(package, init)  # the stage's folder, as tests/conftest.py loads it
sys.modules[package] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules[package])
importlib.import_module(package + ".gateway")
from common.weights import load_tokenizer
tokenizer = load_tokenizer(model)  # what the gateway's constructor does, then its chat route
tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                        tokenize=False))
engine = {package + "." + name for name in ("engine", "server", "replica", "model_runner")}
print(sorted(name for name in sys.modules if name.split(".")[0] == "torch" or name in engine))
"""


def test_the_gateway_module_loads_neither_torch_nor_the_engine(model_dir):
    """The ingress validates, routes and relays: importing it, loading a tokenizer and tokenizing a chat, as its
    constructor and its routes do, must not load PyTorch or stage 11's engine (in a fresh process: this one has
    both)."""
    import os
    import subprocess
    import sys

    init = Path(gateway_module.__file__).parent / "__init__.py"
    repo = Path(__file__).resolve().parent.parent  # for `common`
    done = subprocess.run([sys.executable, "-c", IMPORT_THE_GATEWAY, FOLDER, str(init), str(model_dir)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def is_ray(process: psutil.Process) -> bool:
    """One of Ray's processes; a child that has exited (a zombie, not yet reaped: any test's) runs nothing."""
    try:
        return "ray" in " ".join(process.cmdline()).lower()
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return False


def descendants(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def is_engine_core(process: psutil.Process) -> bool:
    """A replica's engine core: a process multiprocessing spawned (``core_main``)."""
    try:
        return "spawn_main" in " ".join(process.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return False


def test_nothing_is_left_running_after_shutdown(gateway):
    """Ray's processes, and each replica's engine core (a child of its Ray worker), all exit."""
    ray = [p for p in psutil.Process().children(recursive=True) if is_ray(p)]
    assert ray, "Ray's processes are children of this one"
    ours = set(ray) | {child for p in ray for child in descendants(p)}
    assert sum(is_engine_core(p) for p in ours) >= 3  # one per replica: two of the small model, one of the large
    fleet.stop()
    gateway.stopped = True
    _, alive = psutil.wait_procs(ours, timeout=60)
    assert not alive, [p.cmdline()[:3] for p in alive]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{gateway.url}/health", timeout=5)


@pytest.mark.cuda
def test_replicas_sharing_one_gpu_each_get_their_share_of_its_memory(model_dir):
    """On a GPU (``make gpu-check``, where Ray is installed): two replicas at a quarter of the GPU each both get a KV
    pool, and the same one whatever order they started in (each sizes its pool from its own share, not from what
    the other left free), and serve. A fleet of its own, outside the module's CPU fleet."""
    engine = stage(FOLDER, "config").EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16",
                                                 speculative="off", quantization="none")
    shared = gateway_config.GatewayConfig(min_replicas=2, max_replicas=2, replica_cpus=0.25, replica_gpus=0.25)
    specs = fleet.model_specs(engine, shared, None)
    url, name = fleet.start(specs, shared, port=free_port()), specs[0].name
    prefix = f'llm_kv_blocks_free{{model="{name}",replica="'

    def pools() -> list[float]:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)]

    try:
        wait_for(lambda: len(pools()) == 2, 300, "two replicas reporting their pools")
        free = pools()
        assert min(free) > 0 and max(free) == min(free), free
        assert chat(url, name, "Hello").status_code == 200
    finally:
        fleet.stop()
