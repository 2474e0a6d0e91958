"""Stages 02 to 04 under load, faults and abuse: every request is answered or refused cleanly, a
failure stays with the request that caused it, and whatever a request held comes back.

The liveness bounds below (2 s to settle, 5 s to serve again) are the issue's promises to a client,
not speed goals: each is a deadline on a poll, far above what a healthy server needs."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from common.limits import Limits

from .conftest import make_engine, serve_stage, stage
from .prompts import TEXT_PROMPTS
from .servers import LiveServer
from .stages import FASTAPI_STAGES, has, stages_with

MODEL = "smollm2-135m-instruct"
STAGES = FASTAPI_STAGES
POISON = "Tell me about the poisoned apple."  # the prompt the injected faults pick out


@pytest.fixture(params=STAGES)
def folder(request) -> str:
    return request.param


@pytest.fixture
def engine(folder, request):
    return request.getfixturevalue(f"engine{folder[:2]}")


@pytest.fixture
def server(folder, request) -> LiveServer:
    return request.getfixturevalue(f"server{folder[:2]}")


def body(prompt: str = "Count: 1, 2, 3,", max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def health(server: LiveServer) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def kv_used(server: LiveServer) -> int:
    return health(server).get("kv_blocks", {}).get("used", 0)  # stage 02 has no pool: nothing to hold


def settled(server: LiveServer, baseline_kv: int, within_s: float) -> dict:
    """Poll /health until nothing runs or waits and the pool is back to ``baseline_kv``; the last answer."""
    deadline = time.monotonic() + within_s
    while True:
        state = health(server)
        idle = state["running"] == 0 and state["waiting"] == 0
        if (idle and state.get("kv_blocks", {}).get("used", 0) == baseline_kv) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def sse_events(response: httpx.Response) -> list[str]:
    """The data fields of a streamed response, [DONE] included."""
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


# --- limits ----------------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_a_413(server):
    huge = body(prompt="x" * (Limits().max_body_bytes + 1))
    response = httpx.post(f"{server.url}/v1/completions", json=huge, timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the server must count as the body arrives
        yield json.dumps(huge).encode()

    response = httpx.post(f"{server.url}/v1/completions", content=chunked(), timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(f"{server.url}/v1/completions", json=body(max_tokens=2), timeout=30).status_code == 200


def test_past_the_request_cap_is_a_503_with_retry_after(folder, engine):
    with serve_stage(folder, engine, Limits(max_requests=2)) as server, httpx.Client(timeout=60) as client:
        url = f"{server.url}/v1/completions"
        with client.stream("POST", url, json=body(max_tokens=1000, stream=True)) as first, \
                client.stream("POST", url, json=body(max_tokens=1000, stream=True)) as second:
            assert first.status_code == second.status_code == 200
            refused = httpx.post(url, json=body(), timeout=10)
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "server_overloaded"
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # only generation is capped
        assert settled(server, 0, within_s=5)["running"] == 0
        assert client.post(url, json=body(max_tokens=2)).json()["usage"]["completion_tokens"] == 2


# --- fault isolation ---------------------------------------------------------------------------------


def inject_fault(monkeypatch, folder: str, engine, error: Exception) -> None:
    """Make the engine raise ``error`` in its work on the poisoned prompt, and only there."""
    poison_ids = engine.encode(POISON)
    if has(folder, "batching"):  # the per-sequence work after the batched forward pass
        append = engine.scheduler._append

        def faulty_append(seq, *args):
            if seq.prompt_ids == poison_ids:
                raise error
            return append(seq, *args)

        monkeypatch.setattr(engine.scheduler, "_append", faulty_append)
    else:
        generate = engine.generate

        def faulty_generate(request_id, prompt_ids, params, trace=None):
            if prompt_ids == poison_ids:
                raise error
            return generate(request_id, prompt_ids, params, trace)

        monkeypatch.setattr(engine, "generate", faulty_generate)


def test_a_failing_request_fails_alone(monkeypatch, folder, engine, server):
    inject_fault(monkeypatch, folder, engine, RuntimeError("injected fault"))
    url = f"{server.url}/v1/completions"

    def poisoned_stream() -> list[str]:
        with httpx.stream("POST", url, json=body(POISON, stream=True), timeout=60) as response:
            assert response.status_code == 200
            return sse_events(response)

    with ThreadPoolExecutor(4) as pool:
        healthy = [pool.submit(httpx.post, url, json=body(p, max_tokens=12), timeout=60) for p in TEXT_PROMPTS[:2]]
        whole = pool.submit(httpx.post, url, json=body(POISON), timeout=60)
        streamed = pool.submit(poisoned_stream)
        assert whole.result().status_code == 500
        assert whole.result().json()["error"]["message"] == "generation failed: RuntimeError: injected fault"
        events = streamed.result()
        assert events[-1] == "[DONE]" and "injected fault" in json.loads(events[-2])["error"]["message"]
        assert [f.result().json()["usage"]["completion_tokens"] for f in healthy] == [12, 12]
    state = settled(server, 0, within_s=5)
    assert (state["running"], state["waiting"], kv_used(server)) == (0, 0, 0)


@pytest.mark.parametrize("bad", [[-1], [49152], [5, 2**40]], ids=["negative", "vocab-size", "huge"])
def test_the_engine_itself_refuses_token_ids_outside_the_vocabulary(folder, engine, bad):
    """Not only the server: on CUDA an out-of-range id reaching the embedding is a device-side assert
    that poisons the GPU for every later request, so the engine checks whoever calls it."""
    params = stage(folder, "sampler").SamplingParams(max_tokens=2, temperature=0.0)
    invalid = stage(folder, "engine").InvalidRequest
    assert engine.model.config.vocab_size == 49152
    with pytest.raises(invalid, match="outside the vocabulary"):
        if has(folder, "batching"):
            engine.add_request("bad-ids", bad, params)
        else:
            next(iter(engine.generate("bad-ids", bad, params)))
    if has(folder, "batching"):
        assert "bad-ids" not in engine.scheduler.sequences and not engine.scheduler.waiting
    if has(folder, "paged_kv"):
        assert engine.block_manager.num_used == 0


class Fatal(BaseException):
    """Not an Exception: nothing on the engine thread catches it, so the thread dies."""


def test_a_gpu_error_stops_the_engine_instead_of_failing_every_later_request(monkeypatch, folder, engine):
    """On CUDA an error such as a device-side assert is sticky: every later kernel fails too. The engine
    must stop (503, /health 503) rather than answer each later request with a 500. Injected here as the
    error PyTorch raises for it (torch.AcceleratorError), where the engine thread runs the model."""
    def gpu_error(*args, **kwargs):
        raise torch.AcceleratorError("CUDA error: device-side assert triggered")

    with serve_stage(folder, engine) as server:
        if has(folder, "batching"):
            monkeypatch.setattr(engine.runner, "execute", gpu_error)
        else:
            monkeypatch.setattr(engine, "generate", gpu_error)
        url = f"{server.url}/v1/completions"
        response = httpx.post(url, json=body(), timeout=30)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_stopped"
        assert "the GPU failed" in response.json()["error"]["message"]
        deadline = time.monotonic() + 5
        while httpx.get(f"{server.url}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "/health still says ok after the GPU failed"
            time.sleep(0.02)
    if has(folder, "paged_kv"):
        assert engine.block_manager.num_used == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_turns_health_503_and_requests_fail_fast(monkeypatch, folder, engine):
    def fatal(*args, **kwargs):
        raise Fatal

    with serve_stage(folder, engine) as server:
        # What the engine thread calls for any request: a step (04), or a whole generation (02, 03).
        monkeypatch.setattr(engine, "step" if has(folder, "batching") else "generate", fatal)
        url = f"{server.url}/v1/completions"
        in_flight = httpx.post(url, json=body(), timeout=30)  # the request that was running when it died
        assert in_flight.status_code == 503 and "EngineStopped" in in_flight.json()["error"]["message"]
        deadline = time.monotonic() + 2  # the thread fails its requests first, then exits
        while httpx.get(f"{server.url}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "/health still says ok after the engine thread died"
            time.sleep(0.02)
        start = time.monotonic()
        after = httpx.post(url, json=body(), timeout=30)
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_stopped"
        assert time.monotonic() - start < 5
    if has(folder, "paged_kv"):
        assert engine.block_manager.num_used == 0  # the dying thread returned every block


# --- load, cancellation, exhaustion --------------------------------------------------------------------


@pytest.mark.parametrize("folder", stages_with("block_manager"))  # the stages with a KV pool
def test_a_disconnected_stream_returns_its_blocks_and_the_server_goes_on(server):
    client = server.client()
    stream = client.completions.create(model=MODEL, prompt="Count forever:", max_tokens=1000, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(4):  # the answer has begun: its blocks are taken
        next(chunks)
    assert server.metric("llm_kv_blocks_used") > 0
    stream.close()
    state = settled(server, 0, within_s=2)
    assert (state["running"], kv_used(server), server.metric("llm_requests_running")) == (0, 0, 0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_a_cancellation_storm_leaves_nothing_behind(server):
    """200 streams of 1000 tokens, each client gone 0.5 s after its answer started: all of it is
    freed, and the server answers the next request at once."""
    baseline = kv_used(server)

    async def storm() -> list[int]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:

            async def one(i: int) -> int:
                payload = body(TEXT_PROMPTS[i % 4], max_tokens=1000, stream=True)
                async with client.stream("POST", "/v1/completions", json=payload) as response:
                    await asyncio.sleep(0.5)
                    return response.status_code  # leaving the block closes the connection mid-stream

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), timeout=120)

    assert asyncio.run(storm()) == [200] * 200
    state = settled(server, baseline, within_s=10)  # a step in flight ends first: seconds on a busy 2-core CPU
    assert (state["running"], state["waiting"], kv_used(server)) == (0, 0, baseline)
    response = httpx.post(f"{server.url}/v1/completions", json=body(max_tokens=4), timeout=5)
    assert response.json()["usage"]["completion_tokens"] == 4


@pytest.mark.e2e  # a whole model or a process: left out of `make test-fast`
def test_128_streaming_clients_all_complete_and_memory_stays_bounded():
    """Stage 04 in its own process, as a user runs it; the soak tool checks every stream's tokens. (Twice its
    ``max_num_seqs`` at once: half of them wait in its queue. The gateway's tests hold 2,000 streams.)"""
    from common.bench import free_port, stage_server
    from common.soak import soak

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with stage_server([sys.executable, "-m", "04_continuous_batching", "--port", str(port)], url) as process:
        result = asyncio.run(soak(url, MODEL, clients=128, rounds=1, max_tokens=8, pid=process.pid))
    print(result.summary())
    assert result.failures == [] and result.requests == 128 and result.output_tokens == 128 * 8
    assert result.peak_rss_mib < result.rss_mib[0] + 512  # holding 128 requests costs well under 512 MiB


def test_16_long_requests_on_a_pool_that_fits_4_all_complete_exactly(model_dir, engine04):
    """3 blocks per request, 12 blocks in the pool: requests queue, are preempted and recomputed, and
    each still gets the tokens it gets with room to spare (which other tests tie to Hugging Face)."""
    sampler = stage("04_continuous_batching", "sampler")
    small = make_engine("04_continuous_batching", model_dir, kv_cache_mb=9)
    assert small.block_manager.num_blocks == 12
    prompts = [small.encode(f"Fact {i}: {TEXT_PROMPTS[i % 4]}") for i in range(16)]
    assert all(len(p) + 24 <= 48 for p in prompts)
    params = sampler.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    squeezed = small.generate_offline(prompts, params)
    assert small.scheduler.num_preemptions > 0 and small.block_manager.num_used == 0
    assert squeezed == engine04.generate_offline(prompts, params)
