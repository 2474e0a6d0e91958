"""Stage 02: the streaming OpenAI server computes what Hugging Face computes, streams exactly what it
would return whole, cuts stop strings, never sends a broken character, rejects bad input with a 400,
and forgets a client that leaves."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from pydantic import BaseModel

from common.protocol import Usage
from common.trace import RequestTrace

from .conftest import stage
from .prompts import EMOJI_PROMPT, TEXT_PROMPTS

sampler = stage("02_streaming", "sampler")
sequence = stage("02_streaming", "sequence")
engine_module = stage("02_streaming", "engine")
async_engine_module = stage("02_streaming", "async_engine")
server_module = stage("02_streaming", "server")
MODEL = "smollm2-135m-instruct"


def run_engine(engine, prompt_ids, params):
    outputs = list(engine.generate("test", prompt_ids, params))
    return [t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs), outputs[-1]


# --- over HTTP, with the official openai client ------------------------------------------------


def stream_completion(client, **kwargs):
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return chunks, text, finish


@pytest.mark.parametrize("prompt", TEXT_PROMPTS[:2])
def test_http_greedy_equals_hf_and_stream_equals_non_stream(server02, engine02, hf_greedy, prompt):
    client = server02.client()
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
    chunks, text, finish = stream_completion(client, prompt=prompt, max_tokens=32, temperature=0,
                                             stream_options={"include_usage": True})
    prompt_ids = engine02.encode(prompt)
    assert whole.choices[0].text == text == engine02.tokenizer.decode(hf_greedy(prompt_ids, 32))
    assert len(chunks) > 10  # it really streamed, token by token
    assert whole.choices[0].finish_reason == "length" and finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt_ids), 32)
    assert whole.usage.total_tokens == len(prompt_ids) + 32


@pytest.mark.exercise("2.4")
def test_streams_join_to_the_whole_answer(server02):
    client = server02.client()
    kwargs = dict(max_tokens=12, temperature=0)
    whole = client.completions.create(model=MODEL, prompt="The history of the Roman Empire", **kwargs)
    chunks, text, finish = stream_completion(client, prompt="The history of the Roman Empire",
                                             stream_options={"include_usage": True}, **kwargs)
    assert text == whole.choices[0].text and finish == ["length"] and len(chunks) > 5
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    messages = [{"role": "user", "content": "Say hi."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_chat_stream_and_usage_with_eos(server02, engine02, hf_greedy):
    client = server02.client()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    expected = hf_greedy(engine02.encode_chat(messages), 64)  # ends with EOS, before 64 tokens
    assert expected[-1] in engine02.eos_token_ids and len(expected) < 64
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed == engine02.tokenizer.decode(expected, skip_special_tokens=True)
    assert whole.choices[0].finish_reason == "stop"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert whole.usage.completion_tokens == len(expected)  # the EOS token counts: it was generated
    assert chunks[-1].usage == whole.usage


def test_stop_string_spanning_two_tokens(server02, engine02):
    client = server02.client()
    prompt = "The history of the Roman Empire"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0).choices[0].text
    stop = "divided into"  # " divided" and " into" are two tokens
    tokens = [engine02.tokenizer.decode([t]) for t in engine02.encode(full)]
    assert stop in full and not any(stop in t for t in tokens)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=[stop, "zzz"])
    chunks, streamed, finish = stream_completion(client, prompt=prompt, max_tokens=32, temperature=0, stop=stop)
    expected = full[: full.index(stop)]
    assert whole.choices[0].text == streamed == expected
    assert whole.choices[0].finish_reason == "stop" and finish == ["stop"]
    assert not any("divided" in (c.choices[0].text if c.choices else "") for c in chunks)


def test_emoji_and_cjk_stream_without_replacement_characters(server02, engine02, hf_greedy):
    client = server02.client()
    for content in (EMOJI_PROMPT, "Translate to Chinese: I love my cat."):
        messages = [{"role": "user", "content": content}]
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=32, temperature=0, stream=True) if c.choices]
        assert not any("\ufffd" in p for p in pieces)
        reference = engine02.tokenizer.decode(hf_greedy(engine02.encode_chat(messages), 32), skip_special_tokens=True)
        # The reference may end in a half-made character (the 32nd token stopped mid-way): never sent.
        assert "".join(pieces) == reference.rstrip("\ufffd")
        assert any(ord(ch) > 0x2E80 for ch in "".join(pieces))  # really emoji / CJK


def test_same_seed_same_text(server02):
    client = server02.client()
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=1.0, top_p=0.95, seed=1234)
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first
    _, streamed, _ = stream_completion(client, **{k: v for k, v in kwargs.items() if k != "model"})
    assert streamed == first


def test_models_health_and_metrics(server02):
    assert server02.wait_idle()  # the counts below are this test's alone
    client = server02.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server02.url}/health").json() == {"status": "ok", "running": 0, "waiting": 0}
    before = server02.metric("llm_generation_tokens_total"), server02.metric("llm_time_to_first_token_seconds_count")
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    after = server02.metric("llm_generation_tokens_total"), server02.metric("llm_time_to_first_token_seconds_count")
    assert after[0] - before[0] == 5 and after[1] - before[1] == 1
    assert server02.metric("llm_requests_running") == 0 and server02.metric("llm_requests_waiting") == 0


# --- the SSE framing, without a model ------------------------------------------------------------


class Chunk(BaseModel):
    text: str | None
    token_ids: list[int] = []
    finish_reason: str | None
    usage: Usage | None = None


def chunk(step: list | None, usage: Usage | None = None) -> Chunk:
    """What sse_response asks the endpoint for: a chunk of a group of outputs, or (None) the usage chunk."""
    if step is None:
        return Chunk(text=None, finish_reason=None, usage=usage)
    return Chunk(text="".join(o.text for o in step), token_ids=[t for o in step for t in o.token_ids],
                 finish_reason=step[-1].finish_reason)


@pytest.mark.exercise("2.4")
@pytest.mark.parametrize("include_usage", [False, True])
def test_sse_events_frame_each_chunk_and_end_with_done(include_usage):
    outputs = [
        sequence.RequestOutput("r", [11], "Hel", None, prompt_tokens=3, completion_tokens=1),
        sequence.RequestOutput("r", [12], "", None, prompt_tokens=3, completion_tokens=2),  # held back: no event
        sequence.RequestOutput("r", [13], "lo", "stop", prompt_tokens=3, completion_tokens=3),
    ]

    async def produce():
        for output in outputs:
            yield output

    async def read(response) -> list[str]:
        return [event async for event in response.body_iterator]

    opening = Chunk(text="", finish_reason=None)
    response = server_module.sse_response(produce(), [opening], chunk, include_usage, RequestTrace())
    # The held-back output travels with the next chunk: its token (and logprobs) go out with its text.
    expected = [opening, Chunk(text="Hel", token_ids=[11], finish_reason=None),
                Chunk(text="lo", token_ids=[12, 13], finish_reason="stop")]
    if include_usage:
        expected.append(chunk(None, usage=Usage.of(3, 3)))
    assert response.media_type == "text/event-stream"
    assert asyncio.run(read(response)) == [f"data: {c.model_dump_json()}\n\n" for c in expected] + ["data: [DONE]\n\n"]


# --- bad input -------------------------------------------------------------------------------------

LONG = "hello " * 8200  # more tokens than the 8192-token context
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.01}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, "top_k"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/completions", {"prompt": LONG, "stream": True}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 8192, "stream": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}, "max_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS, ids=[f"{p[1:]}:{b}"[:60] for p, b, _ in BAD_REQUESTS])
def test_bad_input_is_a_400_with_the_error_object(server02, path, body, param):
    response = httpx.post(f"{server02.url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_context_errors_name_both_numbers(server02):
    response = httpx.post(f"{server02.url}/v1/completions", json={"prompt": "hi", "max_tokens": 8192, "stream": True})
    message = response.json()["error"]["message"]
    assert "8192" in message and "max_tokens" in message and response.status_code == 400
    response = httpx.post(f"{server02.url}/v1/completions", json={"prompt": LONG})
    assert "8192" in response.json()["error"]["message"] and "8201" in response.json()["error"]["message"]


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b"null"])
def test_malformed_bodies(server02, content):
    response = httpx.post(f"{server02.url}/v1/chat/completions", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"]


def test_openai_client_sees_bad_request_and_server_carries_on(server02):
    client = server02.client()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        list(client.completions.create(model=MODEL, prompt=LONG, stream=True))
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_unknown_route_and_method(server02):
    assert httpx.get(f"{server02.url}/v1/nope").json()["error"]["message"]
    response = httpx.get(f"{server02.url}/v1/completions")
    assert response.status_code == 405 and response.json()["error"]["message"]


# --- clients that leave -----------------------------------------------------------------------------


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_disconnect_mid_stream_frees_the_engine(server02):
    client = server02.client()
    stream = client.completions.create(model=MODEL, prompt="Count forever:", max_tokens=4000, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # the first chunk arrived: generation is running
    assert server02.metric("llm_requests_running") == 1
    stream.close()
    assert server02.wait_idle(timeout=2.0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_disconnect_while_waiting_and_while_not_streaming(server02):
    client = server02.client()
    running = client.completions.create(model=MODEL, prompt="A", max_tokens=4000, stream=True,
                                        extra_body={"ignore_eos": True})
    next(iter(running))

    def impatient() -> None:  # a non-streaming request that gives up while it waits in the queue
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server02.url}/v1/completions", json={"prompt": "B", "max_tokens": 4000}, timeout=0.5)

    thread = threading.Thread(target=impatient)
    thread.start()
    assert wait_until(lambda: server02.metric("llm_requests_waiting") == 1, timeout=2.0)  # one at a time
    thread.join()
    assert wait_until(lambda: server02.metric("llm_requests_waiting") == 0, timeout=2.0)
    running.close()
    assert server02.wait_idle(timeout=2.0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


# --- aborting, on the engine itself -------------------------------------------------------------------


@pytest.mark.exercise("2.3")
@pytest.mark.parametrize(("state", "after"), [("waiting", "aborted"), ("running", "aborted"), ("finished", "finished")])
def test_abort_depends_on_where_the_request_is(engine02, state, after):
    async_engine = async_engine_module.AsyncEngine(engine02)  # thread not started: we call _abort by hand
    if state == "waiting":
        async_engine.metrics.waiting.inc()  # as AsyncEngine.generate counted it when it queued the request
    loop = asyncio.new_event_loop()
    request = sequence.Request("r", [1], sampler.SamplingParams(), loop=loop, state=state)
    async_engine._abort(request)
    loop.close()
    assert request.state == after
    assert async_engine.metrics.registry.get_sample_value("llm_requests_waiting") == 0


@pytest.mark.exercise("2.3")
def test_consumers_that_leave_free_the_engine(engine02):
    async_engine = async_engine_module.AsyncEngine(engine02)
    metric = async_engine.metrics.registry.get_sample_value
    params = sampler.SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    first, second = engine02.encode("A"), engine02.encode("B B")

    async def scenario() -> None:
        running = async_engine.generate(first, params)
        await anext(running)  # its first token came: it runs
        waiting = async_engine.generate(second, params)
        with pytest.raises(TimeoutError):  # it waits behind the running one; its consumer gives up
            await asyncio.wait_for(anext(waiting), timeout=0.2)
        assert metric("llm_requests_waiting") == 0
        await running.aclose()  # the consumer of the running one leaves too
        deadline = time.monotonic() + 10.0  # 4000 tokens take minutes; one more step takes well under 10 s
        while metric("llm_requests_running") != 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert metric("llm_requests_running") == 0

    async_engine.start()
    try:
        asyncio.run(scenario())
    finally:
        async_engine.stop()
    assert metric("llm_prompt_tokens_total") == len(first)  # the waiting one was never prefilled
