"""The OpenAI wire format: request, response, stream-chunk and error shapes as pydantic models.

Every stage's server speaks the same API, so the shapes live here once. Validation is strict
(``"5"`` is not a number) and every rejection becomes the OpenAI error object with status 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# --- errors -----------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class APIError(Exception):
    """An error that reaches the client as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        default_type = "invalid_request_error" if status_code < 500 else "server_error"
        self.detail = ErrorDetail(message=message, type=type or default_type, param=param, code=code)

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.detail).model_dump()


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic's (or FastAPI's) list of validation errors into one 400 with the first of them."""
    first = errors[0]
    loc = field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return APIError(f"request body is not valid JSON: {detail}", code="invalid_json")
    if not loc:  # the body as a whole is wrong: missing, or not a JSON object
        return APIError("request body must be a JSON object (sent with Content-Type: application/json)",
                        code=first.get("type"))
    param = ".".join(loc)
    message = f"{param}: {first['msg']}"
    others = {".".join(field_path(e.get("loc", ()))) for e in errors} - {param}
    if others:  # (a union, e.g. prompt: str | list[int], fails once per branch: that is one field)
        message += f" (and errors in: {', '.join(sorted(others))})"
    return APIError(message, param=param, code=first.get("type"))


_TYPE_TAGS = {"constrained-str", "str", "int", "float", "bool", "list", "dict", "none"}


def field_path(loc: tuple[Any, ...]) -> list[str]:
    """The request field an error is about: drop "body" and the union-branch tags pydantic adds."""
    return [str(p) for p in loc if p != "body" and not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]


def parse_request(model: type[BaseModel], data: Any) -> Any:
    """Validate a decoded JSON body against ``model``; raise APIError (400) if it does not fit."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


# --- requests ---------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


# Constraints in the types, so that the OpenAPI document says what the server accepts.
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]


class SamplingRequest(BaseModel):
    """Fields that completions and chat completions share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None  # None means the one model this server serves
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="Keep the k most likely tokens; 0 or -1 keeps all.")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64, description="What torch.Generator.manual_seed accepts.")
    # Accepts a string or a list; after validation it is always a list of up to 4 strings.
    stop: NonEmptyStr | list[NonEmptyStr] | None = Field(
        None, validate_default=True, description="Up to 4 strings; text ends before any of them."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (for benchmarks).")
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings are allowed")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: NonEmptyStr | Annotated[list[TokenId], Field(min_length=1)] = Field(
        description="Text, or a list of token ids.")
    max_tokens: int | None = Field(16, ge=1)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name for max_tokens.")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- responses --------------------------------------------------------------------------------

FinishReason = Literal["stop", "length"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or (with ``usage`` None until the end) one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llm-course"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- limits -----------------------------------------------------------------------------------


def resolve_max_tokens(prompt_tokens: int, requested: int | None, max_model_len: int) -> int:
    """How many tokens a request may generate; a 400 that names the numbers if it cannot fit."""
    if prompt_tokens >= max_model_len:
        raise APIError(
            f"the prompt has {prompt_tokens} tokens, but this model's context length is "
            f"{max_model_len} tokens (the prompt must leave room for at least one output token)",
            param="prompt",
            code="context_length_exceeded",
        )
    room = max_model_len - prompt_tokens
    if requested is None:
        return room
    if requested > room:
        raise APIError(
            f"the prompt has {prompt_tokens} tokens and max_tokens asks for {requested} more, "
            f"{prompt_tokens + requested} in all, but this model's context length is {max_model_len} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise APIError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="prompt")
