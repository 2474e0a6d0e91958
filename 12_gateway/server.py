"""HTTP layer: an OpenAI-compatible FastAPI server that streams tokens as server-sent events.

The handlers only validate, tokenize and translate; generation happens in the engine core's own process.
Each token travels core -> pipe -> asyncio queue -> SSE chunk as soon as it is sampled; when a step
brings a choice several tokens at once (its accepted guesses), they travel as one chunk.

A request must fit in the KV-cache pool: one that never could is refused before it starts. With
``n`` > 1 it gets n choices, each a sample of its own, all sharing the prompt's cached blocks. Usage
reports the prompt tokens found in the prefix cache (``prompt_tokens_details.cached_tokens``), and
/health the pool's blocks, the cache's hit rate, and how many guesses were proposed and accepted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import asdict

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from common.errors import add_error_handlers
from common.limits import Limits, add_limits
from common.logprobs import AnswerWriter, Echo
from common.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    Usage,
    check_token_ids,
    new_id,
    now,
    resolve_max_tokens,
)
from common.trace import NO_TRACE, RequestTrace, Tracer

from . import TITLE
from .async_engine import AsyncEngine
from .detokenizer import IncrementalDetokenizer
from .messages import EngineStopped, InvalidRequest
from .sampler import SamplingParams
from .sequence import RequestOutput
from .sse import GENERATION_RESPONSES, sse_event


def create_app(engine: AsyncEngine, model_name: str, limits: Limits | None = None,
               tracer: Tracer = NO_TRACE) -> FastAPI:
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title=TITLE, lifespan=lifespan)
    add_error_handlers(app)
    add_limits(app, limits or Limits())

    def sampling_params(req: SamplingRequest, prompt_ids: list[int], max_tokens: int | None,
                        logprobs: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        """Checks that need the engine (running, its model's name and context length), then its params."""
        if not engine.alive:  # fail fast: nothing would ever answer
            raise APIError("the engine has stopped; the server must be restarted", 503, code="engine_stopped")
        if req.model is not None and req.model != model_name:
            raise APIError(f"model {req.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        check_token_ids(list(req.token_bias), len(tokenizer), param="logit_bias")
        return SamplingParams(
            max_tokens=fit_in_pool(len(prompt_ids), max_tokens),
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=req.token_bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def fit_in_pool(prompt_tokens: int, requested: int | None) -> int:
        """The context-length check, then the pool's: a sequence can never hold more than every block.

        Without ``max_tokens`` the request may run until the pool is full; with it, a request that
        could never fit is refused now rather than failing halfway through its generation.
        """
        max_tokens = resolve_max_tokens(prompt_tokens, requested, max_model_len)
        capacity, block_size = engine.kv_capacity_tokens, engine.stats().kv_blocks.block_size
        if prompt_tokens + max_tokens <= capacity:
            return max_tokens
        if requested is None and prompt_tokens < capacity:
            return capacity - prompt_tokens
        raise APIError(
            f"the prompt has {prompt_tokens} tokens and the request may generate {max_tokens} more, "
            f"{prompt_tokens + max_tokens} in all, but the KV cache holds at most {capacity} tokens "
            f"({capacity // block_size} blocks of {block_size}); start the server with a larger --kv-cache-mb",
            param="max_tokens" if requested is not None else "prompt",
            code="kv_cache_too_small",
        )

    def decode(token_id: int) -> str:
        return tokenizer.decode([token_id])

    def echo_of(prompt_ids: list[int]) -> Echo:
        """The prompt for ``echo``: each token's text as the detokenizer releases it, so they join exactly."""
        detokenizer = IncrementalDetokenizer(tokenizer, stop=[])
        texts = [detokenizer.add(token_id) for token_id in prompt_ids]
        texts[-1] += detokenizer.flush()
        return Echo(prompt_ids, texts)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        rid, created = new_id("cmpl"), now()
        trace = tracer.new(rid)
        with trace.span("tokenize"):
            if isinstance(req.prompt, str):
                prompt_ids = engine.encode(req.prompt)
            else:
                check_token_ids(req.prompt, len(tokenizer))
                prompt_ids = req.prompt
        # Prompt logprobs cost a log-softmax per prompt position: computed only for echo + logprobs.
        prompt_logprobs = req.logprobs if req.echo else None
        if req.echo and req.n > 1:
            raise APIError("echo is supported with n = 1 only: the prompt is scored once", param="n")
        params = sampling_params(req, prompt_ids, req.max_tokens, req.logprobs, prompt_logprobs)
        writers = [AnswerWriter(decode, req.logprobs is not None, echo_of(prompt_ids) if req.echo else None)
                   for _ in range(req.n)]  # one per choice
        outputs = engine.generate(prompt_ids, params, trace, req.n)

        def chunk(step: list[RequestOutput] | None, usage: Usage | None = None) -> CompletionResponse:
            """A chunk (or the whole answer) with the text and logprobs of ``step``; None: the usage chunk."""
            choices = []
            for index, group in by_choice(step or []):
                text, logprobs = writers[index].completion(group)
                choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                finish_reason=group[-1].finish_reason))
            return CompletionResponse(id=rid, created=created, model=model_name, choices=choices, usage=usage)

        if req.stream:
            return sse_response(outputs, [], chunk, req.include_usage, trace,
                                engine.metrics.stream_write.observe)
        if (everything := await collect(outputs, raw)) is None:
            return client_gone()
        return respond(chunk(everything, usage_of(everything)), trace)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_RESPONSES)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        rid, created = new_id("chatcmpl"), now()
        trace = tracer.new(rid)
        with trace.span("tokenize"):
            prompt_ids = engine.encode_chat([{"role": m.role, "content": m.text()} for m in req.messages])
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, prompt_ids, req.output_limit, logprobs)
        writers = [AnswerWriter(decode, req.logprobs) for _ in range(req.n)]  # one per choice
        outputs = engine.generate(prompt_ids, params, trace, req.n)

        def chunk(step: list[RequestOutput] | None, usage: Usage | None = None) -> ChatCompletionChunk:
            choices = []
            for index, group in by_choice(step or []):
                text, logprobs = writers[index].chat(group)
                choices.append(ChatChunkChoice(index=index, delta=ChatDelta(content=text), logprobs=logprobs,
                                               finish_reason=group[-1].finish_reason))
            return ChatCompletionChunk(id=rid, created=created, model=model_name, choices=choices, usage=usage)

        if req.stream:
            # The first chunk names the role of every choice, as OpenAI's does; content follows.
            roles = [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(req.n)]
            opening = ChatCompletionChunk(id=rid, created=created, model=model_name, choices=roles)
            return sse_response(outputs, [opening], chunk, req.include_usage, trace,
                                engine.metrics.stream_write.observe)
        if (everything := await collect(outputs, raw)) is None:
            return client_gone()
        choices = []
        for index, group in by_choice(everything):
            text, logprobs = writers[index].chat(group)
            choices.append(ChatChoice(index=index, message=ChatMessageOut(content=text), logprobs=logprobs,
                                      finish_reason=group[-1].finish_reason))
        response = ChatCompletionResponse(id=rid, created=created, model=model_name, choices=choices,
                                          usage=usage_of(everything))
        return respond(response, trace)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=now(), max_model_len=max_model_len)])

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        stats = engine.stats()
        speculation = {"acceptance_rate": stats.speculation.acceptance_rate,
                       "mean_accepted_length": stats.speculation.mean_accepted_length}
        return JSONResponse({"status": "ok", **asdict(stats), "prefix_cache_hit_rate": stats.prefix_cache.hit_rate,
                             "speculation": asdict(stats.speculation) | speculation})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def client_gone() -> Response:
    """The answer to a client that has left: nobody reads it (499 is nginx's "client closed request")."""
    return Response(status_code=499)


def respond(payload: BaseModel, trace: RequestTrace) -> JSONResponse:
    """The whole answer as JSON; the request's trace is written once it has been sent."""
    return JSONResponse(payload.model_dump(), background=BackgroundTask(trace.finish, time.perf_counter()))


def by_choice(outputs: list[RequestOutput]) -> list[tuple[int, list[RequestOutput]]]:
    """Outputs grouped by the choice (sample) they belong to, in order of choice index."""
    groups: dict[int, list[RequestOutput]] = {}
    for output in outputs:
        groups.setdefault(output.index, []).append(output)
    return sorted(groups.items())


def usage_of(outputs: list[RequestOutput]) -> Usage:
    """The request's usage: its prompt once (and what of it was cached), the tokens of every choice."""
    last = [group[-1] for _, group in by_choice(outputs)]
    return Usage.of(last[0].prompt_tokens, sum(output.completion_tokens for output in last), last[0].cached_tokens)


def error_of(output: RequestOutput) -> APIError:
    """The one place where an engine's error becomes an HTTP status (and the stream's error event)."""
    error = output.error
    if isinstance(error, EngineStopped):
        return APIError(f"{type(error).__name__}: {error}; the server must be restarted", 503, code="engine_stopped")
    if isinstance(error, InvalidRequest):
        return APIError(str(error), 400)
    return APIError(f"generation failed: {type(error).__name__}: {error}", 500)


# --- streaming -------------------------------------------------------------------------------


def sse_response(
    outputs: AsyncIterator[RequestOutput],
    first: list[BaseModel],
    chunk: Callable[..., BaseModel],
    include_usage: bool,
    trace: RequestTrace,
    on_write: Callable[[float], None] | None = None,
) -> StreamingResponse:
    """Stream ``first``, then a chunk per group of outputs that has text to send, then usage if asked.

    ``chunk(step)`` builds the endpoint's chunk for a list of outputs (their text and logprobs);
    ``chunk(None, usage=...)`` builds the closing usage chunk, with no choices. ``on_write`` is given the
    seconds each event took to write out (a metric's ``observe``).
    """

    async def events() -> AsyncIterator[str]:
        # If the client disconnects, Starlette cancels this generator; closing ``outputs`` then
        # aborts the request in the engine core (see AsyncEngine.generate).
        try:
            ### BEGIN SOLUTION 2.4
            for item in first:
                yield sse_event(item)
            pending: dict[int, list[RequestOutput]] = {}  # per choice: outputs whose text is held back
            finished: list[RequestOutput] = []  # each choice's last output
            async for output in outputs:
                if output.error is not None:
                    yield sse_event(error_of(output).body())  # the headers are sent: the error goes in the stream
                    finished = []
                    break
                pending.setdefault(output.index, []).append(output)
                # "" means held back: nothing new to say yet, so the output waits for the next chunk
                # (its logprobs travel with the text it finally released).
                if output.text or output.finished:
                    yield sse_event(chunk(pending.pop(output.index)))
                if output.finished:
                    finished.append(output)
            if include_usage and finished:
                yield sse_event(chunk(None, usage=usage_of(finished)))  # choices: [], usage: {...}
            ### END SOLUTION
        except Exception as exc:  # a bug of the server's own (the engine's errors are outputs, above)
            yield sse_event(APIError(f"streaming failed: {type(exc).__name__}: {exc}", 500).body())
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(trace.sending(events(), on_write), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def collect(outputs: AsyncIterator[RequestOutput], raw: Request) -> list[RequestOutput] | None:
    """Gather every output of a request, or None if the client disconnected first (the request is dropped).

    A failed request raises its error object (see ``error_of``)."""

    async def gather() -> list[RequestOutput]:
        everything = [output async for output in outputs]
        assert everything and everything[-1].finished
        return everything

    async def disconnected() -> None:
        # The body has been read, so the next ASGI message is the client going away.
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.create_task(gather()), asyncio.create_task(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()  # raises inside ``outputs``, whose ``finally`` drops the request
            with suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        return None
    everything = work.result()
    if everything[-1].error is not None:
        raise error_of(everything[-1])
    return everything
