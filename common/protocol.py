"""The OpenAI wire format: request, response, stream-chunk and error shapes as pydantic models.

Every stage's server speaks the same API, so the shapes live here once. Validation is strict
(``"5"`` is not a number) and every rejection becomes the OpenAI error object with status 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

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
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def only(*allowed: Any, why: str) -> AfterValidator:
    """A field OpenAI defines but this server cannot honour: its default values pass, anything else is a
    400 naming the field. Silently ignoring it would hand the client a result it did not ask for."""

    def check(value: Any) -> Any:
        if value not in allowed:
            raise PydanticCustomError("unsupported_parameter", why)
        return value

    return AfterValidator(check)


N_LATER = "only one choice per prompt is supported before stage 05 (which shares the prompt's blocks)"


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
    n: int = Field(1, ge=1, le=128, description="Choices (samples) per prompt; 1 before stage 05.")
    presence_penalty: Penalty = Field(
        0.0, description="Subtracted once from the logit of every token already generated (before temperature).")
    frequency_penalty: Penalty = Field(
        0.0, description="Subtracted from a token's logit once per time it was generated (before temperature).")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="Token id (as a string) -> a bias added to its logit, -100 to 100 (before temperature).")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (for benchmarks).")
    user: str | None = None
    # OpenAI fields that change nothing for this server's output are accepted as they are:
    # metadata, user, prompt_cache_key, safety_identifier, service_tier "auto"/"default".
    service_tier: Annotated[str | None, only(None, "auto", "default", why="only the default tier exists")] = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings are allowed")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids written as strings, not {key!r}")
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` with int keys (the JSON object's keys are strings)."""
        return {int(key): value for key, value in (self.logit_bias or {}).items()}


class CompletionRequest(SamplingRequest):
    prompt: NonEmptyStr | Annotated[list[TokenId], Field(min_length=1)] = Field(
        description="Text, or a list of token ids.")
    max_tokens: int | None = Field(16, ge=0, description="0 is allowed with echo: score the prompt only.")
    logprobs: TopLogprobs | None = Field(
        None, description="Return each token's logprob and the k most likely alternatives (0 to 20).")
    echo: bool = Field(False, description="Put the prompt before the completion (with logprobs: scored too).")
    best_of: Annotated[int | None, Field(ge=1), only(None, 1, why="only 1 is supported")] = None
    suffix: Annotated[str | None, only(None, "", why="insertion (text after the completion) is not supported")] = None

    @model_validator(mode="after")
    def _zero_tokens_only_with_echo(self) -> CompletionRequest:
        # A rule across two fields: raised as the API error itself, so that it still names one field.
        if self.max_tokens == 0 and not self.echo:
            raise APIError("max_tokens: 0 is only allowed with echo (to score the prompt)", param="max_tokens",
                           code="greater_than_equal")
        return self


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


NO_TOOLS = "tools and function calling are not supported"


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name for max_tokens.")
    logprobs: bool = Field(False, description="Return the logprob of each output token.")
    top_logprobs: TopLogprobs | None = Field(
        None, description="With logprobs: also the k most likely tokens at each position (0 to 20).")
    # What this server cannot do: the defaults pass, anything else is a 400 that names the field.
    tools: Annotated[list[Any] | None, only(None, [], why=NO_TOOLS)] = None
    tool_choice: Annotated[Any, only(None, "none", why=NO_TOOLS)] = None
    functions: Annotated[list[Any] | None, only(None, [], why=NO_TOOLS)] = None
    function_call: Annotated[Any, only(None, "none", why=NO_TOOLS)] = None
    response_format: Annotated[Any, only(None, {"type": "text"}, why="only {'type': 'text'} is supported")] = None
    modalities: Annotated[list[str] | None, only(None, ["text"], why="only ['text'] is supported")] = None
    audio: Annotated[Any, only(None, why="audio output is not supported")] = None
    prediction: Annotated[Any, only(None, why="predicted outputs are not supported")] = None
    reasoning_effort: Annotated[Any, only(None, why="not supported: the models served here do not reason")] = None
    verbosity: Annotated[Any, only(None, why="not supported by the models served here")] = None
    web_search_options: Annotated[Any, only(None, why="web search is not supported")] = None
    store: Annotated[bool | None, only(None, False, why="this server stores no completions")] = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- responses --------------------------------------------------------------------------------

FinishReason = Literal["stop", "length"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens found in the prefix cache, not computed again (05 on).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        """Stages without a prefix cache (before 05) compute every prompt token: 0 cached."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(BaseModel):
    """The completions API's logprobs: parallel lists, one entry per token (the prompt's first with echo).

    ``top_logprobs`` maps token strings to logprobs: the k best and the chosen token, as OpenAI does.
    ``text_offset`` is where each token's text starts in the choice's ``text`` (across chunks when
    streaming). A prompt's first token has no logprob: nothing comes before it to predict it.
    """

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or (with ``usage`` None until the end) one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the k most likely tokens at this position, best first


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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


def check_token_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise APIError(f"{param} token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param=param)
