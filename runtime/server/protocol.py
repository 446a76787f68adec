"""Request and response models in OpenAI's wire format, plus the helpers routes need around them.

Requests ignore unknown fields (OpenAI's server tolerates them, and clients send vendor extras)
but validate every known field strictly (no "1" for 1, no true for 1), and every error names the
field, so a client sees which parameter to fix. Responses use OpenAI's exact field names and
shapes; tests check them against the official openai-python types.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_N = 8  # choices per request: each one is a full sequence in the batch
MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_LOGPROBS = 20  # top alternatives per token; the engine's sampler has the same cap
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; a masked token's logprob is sent as this instead

Role = Literal["system", "user", "assistant", "developer", "tool"]
# The engine's third reason, "abort", never goes on the wire: no client is left to answer.
FinishReason = Literal["stop", "length"]


def new_id(prefix: str) -> str:
    """A random response id, e.g. new_id("chatcmpl") -> "chatcmpl-" + 24 hex chars."""
    return f"{prefix}-{secrets.token_hex(12)}"


def _now() -> int:
    return int(time.time())


# --------------------------------------------------------------------------------------------
# Requests


class _Request(BaseModel):
    """Unknown fields are dropped; known ones are checked strictly."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Role
    content: str | list[TextContentPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        # Checked here, not by the union, so a bad part gets one clear message, not one per
        # union member.
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("content must be a string or a list of content parts")
        for i, part in enumerate(v):
            if isinstance(part, TextContentPart):
                continue
            if not isinstance(part, dict) or "type" not in part:
                raise ValueError(f"content part {i} must be an object with a 'type'")
            if part["type"] != "text":
                raise ValueError(
                    f"only text content is supported (part {i} has type {part['type']!r})"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} needs a string 'text'")
        return v

    @property
    def text(self) -> str:
        """The content as one string; text parts are joined with newlines, as vLLM does."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, str]:
        """The message as a chat template expects it: content always a plain string."""
        out = {"role": self.role, "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        return out


class StreamOptions(_Request):
    include_usage: bool = False


def _check_messages(v: list[ChatMessage]) -> list[ChatMessage]:
    if not v:
        raise ValueError("messages must not be empty")
    return v


Messages = Annotated[list[ChatMessage], AfterValidator(_check_messages)]


def _check_stop(v: Any) -> Any:
    if v is None:
        return v
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a string or a list of strings")
    if len(stops) > MAX_STOP:
        raise ValueError(f"stop allows at most {MAX_STOP} strings, got {len(stops)}")
    if not all(stops):
        raise ValueError("stop strings must not be empty")
    return v


class _SamplingRequest(_Request):
    """Fields chat and text completions share. Field order matters: a field validator sees
    only the fields declared before it (info.data), which is how cross-field errors still name
    their field."""

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Annotated[str | list[str] | None, BeforeValidator(_check_stop)] = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch's generator takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted so clients that always send them work, but only at their no-op value.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extensions.
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, v: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if v is not None and info.data.get("stream") is False:
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty_unsupported(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v:
            raise ValueError(f"{info.field_name} is not supported unless 0; use repetition_penalty")
        return v


class ChatCompletionRequest(_SamplingRequest):
    messages: Messages
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("logprobs") is False:
            raise ValueError("top_logprobs requires logprobs to be true")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) wins over max_tokens (deprecated)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


def _check_prompt(v: Any) -> Any:
    # One clear message instead of one per member of the prompt union.
    shape = "prompt must be a string, a list of strings, a list of token ids or a list of lists"
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ValueError(shape)
    if not v:
        raise ValueError("prompt must not be empty")
    if all(isinstance(p, str) for p in v):
        return v
    for ids in v if isinstance(v[0], list) else [v]:
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise ValueError(shape)
        if not ids:
            raise ValueError("prompt token id lists must not be empty")
        if any(t < 0 for t in ids):
            raise ValueError("prompt token ids must be >= 0")
    return v


class CompletionRequest(_SamplingRequest):
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_check_prompt)]
    echo: bool = False  # before max_tokens: its validator reads echo
    # OpenAI's default for completions; 0 only with echo, which scores a prompt (lm-eval).
    max_tokens: int | None = Field(16, ge=0)
    # OpenAI caps this at 5; we allow what the sampler supports.
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("max_tokens")
    @classmethod
    def _zero_needs_echo(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v == 0 and info.data.get("echo") is False:
            raise ValueError("max_tokens may be 0 only with echo=true (to score the prompt)")
        return v

    def prompts(self) -> list[str | list[int]]:
        """Every prompt in the request, each a string or a token id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return list(p)


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_generation_prompt: bool = True  # with messages: end on the assistant's turn
    add_special_tokens: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def sampling_fields(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The request's sampling settings as keyword arguments of the engine's SamplingParams.

    None means "use the engine's default" (callers drop those keys). max_new_tokens is 0 for a
    completion that only scores its prompt (echo with max_tokens=0); the caller handles that.
    """
    if isinstance(req, ChatCompletionRequest):
        max_new_tokens = req.max_new_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_new_tokens = req.max_tokens
        logprobs = req.logprobs
    stop = req.stop if req.stop is not None else []
    return {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": 0 if req.top_k in (None, -1) else req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "seed": req.seed,
        "max_new_tokens": max_new_tokens,
        "stop": (stop,) if isinstance(stop, str) else tuple(stop),
        "ignore_eos": req.ignore_eos,
        "logprobs": logprobs,
    }


class TokenizeResponse(BaseModel):
    """vLLM's /tokenize shape."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# --------------------------------------------------------------------------------------------
# Responses


def _finite(v: float) -> float:
    return LOGPROB_FLOOR if math.isnan(v) or v < LOGPROB_FLOOR else v


Logprob = Annotated[float, AfterValidator(_finite)]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """Only the keys a delta carries are sent, as OpenAI does: {"role": "assistant",
    "content": ""} first, then {"content": "..."}, and {} with the finish_reason."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None  # sent as null until the last chunk


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion; serialize with model_dump_json().

    Every key is always sent: finish_reason and logprobs as null while unset, and usage as
    null on every chunk but the last one of an include_usage stream (choices=[], usage set).
    That is OpenAI's own shape with include_usage; openai-python reads usage: null as None
    whether or not include_usage was asked for.
    """

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs. With echo, the first prompt token has no logprob: its
    token_logprobs and top_logprobs entries are null, as OpenAI sends them."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Logprob | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, Logprob] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None  # sent as null until the last chunk


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion; OpenAI reuses "text_completion" as its
    object. Keys are always sent, as for ChatCompletionChunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "liteserve"
    max_model_len: int
    liteserve: dict[str, Any] = Field(default_factory=dict)  # facts about the served artifact


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --------------------------------------------------------------------------------------------
# Errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body; openai-python raises it as an APIStatusError with this message."""

    error: ErrorInfo


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    return ErrorResponse(
        error=ErrorInfo(message=message, type=type, param=param, code=code)
    ).model_dump()


def _describe(err: dict[str, Any]) -> tuple[str, str | None]:
    loc = list(err.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path"):  # FastAPI's prefix
        loc = loc[1:]
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return (f"invalid JSON body: {detail}" if detail else "invalid JSON body"), None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if not loc:
        return ("request body is missing" if err.get("type") == "missing" else msg), None
    path = ".".join(str(part) for part in loc)
    text = msg if msg == path or msg.startswith(path + " ") else f"{path}: {msg}"
    value = err.get("input")
    if err.get("type") != "missing" and isinstance(value, (bool, int, float, str)):
        shown = repr(value) if not isinstance(value, str) or len(value) <= 40 else None
        if shown is not None:
            text += f" (got {shown})"
    return text, path


def validation_message(exc: ValidationError | Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message for a pydantic or FastAPI validation error, plus the param
    (dotted path of the first bad field, e.g. "messages.0.role"; None for body-level errors)."""
    errors = exc.errors() if isinstance(exc, ValidationError) else list(exc)
    if not errors:
        return "invalid request", None
    described = [_describe(e) for e in errors]
    return "; ".join(text for text, _ in described), described[0][1]
