"""The gateway: one OpenAI endpoint in front of every replica of every model.

It is Ray Serve's ingress deployment: Ray Serve's HTTP proxy hands it each request, and it

1. validates the request with the same models as stage 11 (the same 400s, before any replica is used);
2. picks the model: the one the request names, or for ``"model": "auto"`` the one ``routing.choose_size``
   picks (counted by reason on /metrics);
3. tokenizes the prompt with that model's tokenizer and hashes its first blocks as stage 05 does, for the
   prefix router;
4. calls the model's deployment through its Ray Serve handle, which queues the call until a replica has
   room (``max_queued_requests`` bounds that queue: past it, 503 with Retry-After), and relays the replica's
   answer, a stream or a whole response, as it comes.

What the replica answers is stage 11's own response (see replica.py): the gateway adds only headers that say
where the request went (``x-model``, ``x-replica``, ``x-route``). A replica that fails mid-stream gives its
clients an error event; the gateway keeps serving through the others.

/health, /metrics and /fleet answer from the fleet's last snapshot (fleet_view.py), refreshed in the background:
a probe never waits for Ray Serve's controller or a replica. This module imports neither PyTorch nor the engine
(what crosses from a replica is defined in gateway_messages.py): the gateway's process validates, routes and relays.
"""

# No `from __future__ import annotations` here: Ray Serve's ingress rebuilds the routes' signatures, and FastAPI
# must see their types as types, not strings, to know a body from a query parameter.
import asyncio
import functools
import itertools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from common.errors import add_error_handlers
from common.limits import Limits, add_limits
from common.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingRequest,
    now,
)
from common.weights import load_tokenizer

from . import TITLE
from .fleet_view import FleetCollector, FleetView, gauge
from .gateway_config import ROUTING_BLOCKS
from .gateway_messages import ResponseStart
from .prefix_index import HashIndex
from .probe_server import health_answer
from .routing import DifficultyRule, Size, choose_size
from .sse import GENERATION_RESPONSES, sse_event

log = logging.getLogger("llm-course")
AUTO = "auto"  # the model name that lets the gateway choose
RETRY_AFTER_S = 1
# Ray Serve's proxy sends the gateway no more than this many requests at once; past it they wait in the proxy.
GATEWAY_MAX_ONGOING = 16_384


@dataclass(frozen=True)
class ServedModel:
    """A model behind the gateway: its deployment's handle and what routing needs of it."""

    name: str
    size: Size
    folder: str  # its Hugging Face folder: the gateway loads only its tokenizer
    handle: DeploymentHandle
    deployment: str  # the Ray Serve deployment's name (for its replica count)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.routed = Counter("llm_gateway_requests", "Requests sent to a model, by why that model.",
                              ["model", "reason"], registry=r)
        self.in_flight = Gauge("llm_gateway_requests_in_flight", "Requests sent to a model and not answered yet "
                               "(in a replica's batch or queue, or waiting at the gateway for one).", ["model"],
                               registry=r)
        self.refused = Counter("llm_gateway_requests_refused", "Requests answered 503 by the gateway: its queue "
                               "for the model was full (overloaded) or the replica failed (replica_failed).",
                               ["model", "why"], registry=r)


async def prepend(first: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    """``first``, then ``rest``; closing this closes ``rest`` (the client left: the relay cancels the call).

    (Defined before the deployment: Ray Serve serializes the class when it is decorated, with the names it
    uses that exist then.)"""
    try:
        yield first
        async for piece in rest:
            yield piece
    finally:
        await rest.aclose()


class RelayResponse(StreamingResponse):
    """A stream that closes its body iterator however it ends. (When a client leaves while a piece is being
    sent, Starlette stops reading the iterator but leaves it open; closed, the relay cancels the replica's call.)"""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


app = FastAPI(title=TITLE)
add_error_handlers(app)
add_limits(app, Limits(max_requests=GATEWAY_MAX_ONGOING))


@serve.deployment(max_ongoing_requests=GATEWAY_MAX_ONGOING, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Gateway:
    """The ingress: stage 11's API over every model's replicas. ``models``: the small one first (a request
    that names no model goes there); ``rule``: how "auto" picks; ``block_size``: the replicas' KV block, whose
    hashes the prefix router compares."""

    def __init__(self, models: list[ServedModel], rule: DifficultyRule, block_size: int) -> None:
        assert models, "the gateway needs a model"
        self.models = {model.name: model for model in models}
        self.default = models[0]
        self.by_size = {model.size: model for model in reversed(models)}
        self.rule = rule
        self.index = HashIndex(block_size)  # only its hashes() is used: the block hashes of stage 05
        self.tokenizers: dict[str, PreTrainedTokenizerBase] = {
            model.name: load_tokenizer(model.folder) for model in models}
        self.metrics = GatewayMetrics()
        self.in_flight = {name: 0 for name in self.models}  # per model: sent, not answered yet
        for name in self.models:
            self.metrics.in_flight.labels(name).set_function(lambda name=name: self.in_flight[name])
        self.context_lengths: dict[str, int] = {}
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.fleet = FleetView({model.name: model.deployment for model in models},
                               {model.name: model.handle for model in models})
        self.metrics.registry.register(FleetCollector(self.fleet))
        self.watching = self.fleet.watch()  # (Ray Serve builds the ingress on the event loop that serves it)

    # --- the OpenAI routes --------------------------------------------------------------------
    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        text = req.prompt if isinstance(req.prompt, str) else ""

        def tokens(tokenizer: PreTrainedTokenizerBase) -> list[int]:
            return tokenizer(req.prompt).input_ids if isinstance(req.prompt, str) else req.prompt

        return await self.forward(raw, req, text, tokens, req.max_tokens)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(self, req: ChatCompletionRequest, raw: Request) -> Response:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]

        def tokens(tokenizer: PreTrainedTokenizerBase) -> list[int]:  # as stage 11's Engine.encode_chat
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return tokenizer(rendered, add_special_tokens=False).input_ids

        # The difficulty rule reads the user's words only. A system prompt is the application's, the same in every
        # chat: one that says "explain step by step" would send every chat of that application to the large model.
        # (The prompt's length still counts every token: the system prompt costs its prefill all the same.)
        asked = "\n".join(m["content"] for m in messages if m["role"] == "user")
        return await self.forward(raw, req, asked, tokens, req.output_limit)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models(self) -> ModelList:
        if not self.context_lengths:  # asked once, of one replica of each model
            for name, model in self.models.items():
                self.context_lengths[name] = (await model.handle.describe.remote())["max_model_len"]
        cards = [ModelCard(id=name, created=now(), max_model_len=n) for name, n in self.context_lengths.items()]
        auto = ModelCard(id=AUTO, created=now(), max_model_len=min(self.context_lengths.values()))
        return ModelList(data=[*cards, auto])

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 while every model has a running replica (503 otherwise: a load balancer sends elsewhere). From the
        fleet's last snapshot, whose age it gives (``snapshot_age_s``; null before the first): it awaits nothing, so
        a probe is answered at once however busy the gateway is."""
        body, status = health_answer(self.fleet, {name: model.size for name, model in self.models.items()},
                                     self.in_flight)
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics_text(self) -> Response:  # (not `metrics`: the instance's `metrics` is its GatewayMetrics)
        """The gateway's counters, then the fleet from its last snapshot: replicas by state, and every replica's
        stage 11 metrics under stage 11's names, labelled by model and replica."""
        return Response(generate_latest(self.metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get("/fleet")
    async def fleet_settings(self) -> JSONResponse:
        """The fleet as it runs: per model, the settings Ray Serve applies to its deployment (replicas, router, queue
        bound, autoscaling) and each replica's state and load; the difficulty rule. For people and dashboards, apart
        from /health: a probe's answer stays small and says only whether to send traffic here."""
        return JSONResponse({"models": {name: self.describe_model(model) for name, model in self.models.items()},
                             "rule": asdict(self.rule), "routing_blocks": ROUTING_BLOCKS,
                             "block_size": self.index.block_size, "snapshot_age_s": self.fleet.age_s()})

    def describe_model(self, model: ServedModel) -> dict[str, Any]:
        """/fleet's part for one model; each replica's load from its last engine report (none yet: its state only)."""
        fleet = self.fleet.models.get(model.name)
        engines = {report.replica: report for report in self.fleet.reports(model.name)}
        replicas = {replica: {"state": state, **{key: gauge(engines[replica], f"llm_requests_{key}")
                                                 for key in ("running", "waiting") if replica in engines}}
                    for replica, state in (fleet.replicas if fleet else {}).items()}
        return {"size": model.size, "folder": model.folder, "deployment": model.deployment,
                "settings": fleet.settings if fleet else None, "replicas": replicas,
                "in_flight": self.in_flight[model.name]}

    # --- routing and relaying -----------------------------------------------------------------
    def pick(self, req: SamplingRequest, text: str, tokens: Callable[[str], list[int]],
             max_tokens: int | None) -> tuple[ServedModel, str]:
        """The model a request goes to, and the reason (the counter's label)."""
        if req.model is None:
            return self.default, "default"
        if req.model in self.models:
            return self.models[req.model], "named"
        if req.model == AUTO:  # the prompt's length in the default model's tokens decides
            route = choose_size(len(tokens(self.default.name)), max_tokens, text, self.rule)
            if route.size not in self.by_size:  # one model behind the gateway: it takes everything
                return self.default, "only_model"
            return self.by_size[route.size], route.reason
        served = ", ".join(repr(name) for name in [*self.models, AUTO])
        raise APIError(f"model {req.model!r} does not exist; this gateway serves {served}", param="model",
                       code="model_not_found")

    def route(self, req: SamplingRequest, text: str, encode: Callable[[PreTrainedTokenizerBase], list[int]],
              max_tokens: int | None) -> tuple[ServedModel, str, list[bytes]]:
        """The model, the reason, and the hashes of the prompt's first blocks in that model's tokens.

        ``encode(tokenizer)``: the prompt's token ids as that model's replica will see them."""

        @functools.cache
        def tokens(name: str) -> list[int]:  # once per model at most (the rule and the hashes may use the same)
            return encode(self.tokenizers[name])

        model, reason = self.pick(req, text, tokens, max_tokens)
        return model, reason, list(itertools.islice(self.index.hashes(tokens(model.name)), ROUTING_BLOCKS))

    async def forward(self, raw: Request, req: SamplingRequest, text: str,
                      encode: Callable[[PreTrainedTokenizerBase], list[int]], max_tokens: int | None) -> Response:
        """Route the request, call a replica and relay its answer."""
        # Tokenizing takes a millisecond or more, and this loop relays every other stream: on a thread of its own
        # (one: a Hugging Face tokenizer must not be called from two threads at once).
        model, reason, hashes = await asyncio.get_running_loop().run_in_executor(
            self.tokenizing, self.route, req, text, encode, max_tokens)
        body = await raw.json()
        body["model"] = model.name  # the replica's app checks the name it serves ("auto" is the gateway's)
        self.metrics.routed.labels(model.name, reason).inc()
        self.in_flight[model.name] += 1
        call: DeploymentResponseGenerator | None = None
        events: AsyncGenerator[bytes, None] | None = None  # a stream's relay, once started: it then ends the call
        try:
            call = model.handle.options(stream=True).handle.remote(
                "POST", raw.url.path, json.dumps(body).encode(), prefix_hashes=hashes)
            start: ResponseStart = await anext(call)  # waits for a replica, then for the app's first message
            headers = {k: v for k, v in start.headers if k.lower() != "content-length"}
            headers |= {"x-model": model.name, "x-replica": start.replica, "x-route": reason}
            if not headers.get("content-type", "").startswith("text/event-stream"):
                # A whole answer: read all of it here, so that a replica failing halfway gives a clean 503.
                whole = b"".join([piece async for piece in call])
                return Response(whole, status_code=start.status, headers=headers)
            events = self.relay(call, model.name)
            first = await anext(events)  # started, its `finally` runs even if the client leaves before reading
            return RelayResponse(prepend(first, events), status_code=start.status, headers=headers)
        except asyncio.CancelledError:  # the client left while its call waited: the replica's app must see it go
            if call is not None:
                call.cancel()  # (only here: cancelling a call that ended with an error raises that error again)
            raise
        except BackPressureError:
            return self.refuse(model, "overloaded", f"every replica of {model.name!r} is busy and its queue at the "
                               f"gateway is full; retry after {RETRY_AFTER_S} s")
        except StopAsyncIteration:  # the replica ended the call without an answer
            return self.refuse(model, "replica_failed", f"a replica of {model.name!r} gave no answer; retry")
        except Exception as exc:  # the replica died, or its actor is unreachable
            log.warning("a call to %s failed: %r", model.name, exc)
            return self.refuse(model, "replica_failed", f"a replica of {model.name!r} failed: {type(exc).__name__}; "
                               "retry")
        finally:
            if events is None:
                self.in_flight[model.name] -= 1

    def refuse(self, model: ServedModel, why: str, message: str) -> JSONResponse:
        """503 with Retry-After: a client may try again (the ``openai`` client does so by itself)."""
        self.metrics.refused.labels(model.name, why).inc()
        return JSONResponse(APIError(message, 503, code=why).body(), status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    async def relay(self, call: DeploymentResponseGenerator, model: str) -> AsyncGenerator[bytes, None]:
        """The rest of the replica's stream, event by event. If the client leaves, this generator is closed and
        its ``finally`` cancels the call: the replica's app sees the client go, as in stage 11."""
        try:
            async for piece in call:
                yield piece
        except Exception as exc:  # the replica died mid-answer: the headers are sent, the error goes in the stream
            self.metrics.refused.labels(model, "replica_failed").inc()
            error = APIError(f"the replica failed mid-answer: {type(exc).__name__}; retry", 503, code="replica_failed")
            yield sse_event(error.body()).encode()
            yield b"data: [DONE]\n\n"
        except BaseException:  # closed or cancelled mid-stream: the client left, and the replica must stop too
            call.cancel()
            raise
        finally:
            self.in_flight[model] -= 1
