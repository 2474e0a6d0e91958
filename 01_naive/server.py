"""HTTP layer: a Flask app that serves one request at a time, on purpose.

While one request generates, the next waits for the whole answer to finish. That is the
problem the rest of the course solves, so this server keeps it in plain sight.
"""

from __future__ import annotations

from typing import Any

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from common.protocol import (
    APIError,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
    check_token_ids,
    new_id,
    now,
    parse_request,
    resolve_max_tokens,
)

from .engine import Engine, GenerationResult
from .sampler import SamplingParams

# OpenAI fields that stage 01 does not implement (stage 02 does). A client that asks for one gets a 400
# naming it: silently ignoring it would hand back an answer computed differently from what was asked.
NOT_IN_STAGE_01 = ("logprobs", "echo", "presence_penalty", "frequency_penalty", "logit_bias")


def refuse_unsupported(req: CompletionRequest) -> None:
    for name in NOT_IN_STAGE_01:
        value, default = getattr(req, name), CompletionRequest.model_fields[name].default
        if value != default and value != {}:
            raise APIError(f"{name}: not supported by stage 01; stage 02 adds it", param=name,
                           code="unsupported_parameter")


def create_app(engine: Engine, model_name: str) -> Flask:
    app = Flask(__name__)

    def run(req: CompletionRequest) -> GenerationResult:
        """Validate what needs the model (name, prompt length), then generate."""
        refuse_unsupported(req)
        if req.model is not None and req.model != model_name:
            raise APIError(f"model {req.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        if isinstance(req.prompt, str):
            prompt_ids = engine.encode(req.prompt)
        else:
            check_token_ids(req.prompt, len(engine.tokenizer))
            prompt_ids = req.prompt
        max_tokens = resolve_max_tokens(len(prompt_ids), req.max_tokens, engine.max_model_len)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
        )
        return engine.generate(prompt_ids, params)

    def completion_request() -> CompletionRequest:
        """Parse the body as JSON whatever its Content-Type, then validate it (400 if either fails)."""
        data = request.get_json(force=True, silent=True)
        if data is None:
            raise APIError("request body is not valid JSON", code="invalid_json")
        return parse_request(CompletionRequest, data)

    @app.post("/generate")
    def generate() -> dict[str, Any]:
        """The course's own simple API: text in, text and timings out."""
        result = run(completion_request())
        return {
            "text": result.text,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "finish_reason": result.finish_reason,
            "prefill_ms": round(result.prefill_ms, 3),
            "decode_ms_per_token": round(result.decode_ms_per_token, 3),
            "kv_cache_bytes": result.kv_cache_bytes,
        }

    @app.post("/v1/completions")
    def completions() -> dict[str, Any]:
        """OpenAI-shaped completions, without streaming (stage 02 adds it)."""
        req = completion_request()
        if req.stream:
            raise APIError("streaming is not supported by stage 01; see stage 02", param="stream")
        result = run(req)
        return CompletionResponse(
            id=new_id("cmpl"),
            created=now(),
            model=model_name,
            choices=[CompletionChoice(text=result.text, finish_reason=result.finish_reason)],
            usage=Usage.of(result.prompt_tokens, result.completion_tokens),
        ).model_dump()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    # --- errors: always the OpenAI error object -------------------------------------------
    @app.errorhandler(APIError)
    def api_error(exc: APIError) -> tuple[Response, int]:
        return jsonify(exc.body()), exc.status_code

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> tuple[Response, int]:
        status = exc.code or 500
        return jsonify(APIError(exc.description or exc.name, status).body()), status

    @app.errorhandler(Exception)
    def internal_error(exc: Exception) -> tuple[Response, int]:
        app.logger.exception("request failed")
        return jsonify(APIError(f"internal error: {type(exc).__name__}", 500).body()), 500

    return app
