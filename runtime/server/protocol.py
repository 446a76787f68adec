"""Request and response models in OpenAI's wire format, plus the helpers routes need around them.

Chat and completions requests refuse unknown fields, as OpenAI's API does (a vendor extra dropped
in silence looks like it worked), and validate every known field strictly (no "1" for 1, no true
for 1); every error names the field, so a client sees which parameter to fix. OpenAI fields the
server does not implement are refused with their reason: REFUSED is their one list (a 400 naming
the field). Responses use
OpenAI's exact field names and shapes; tests check them against the official openai-python types.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from runtime.chat_template import TEMPLATE_NAMES

MAX_N = 8  # choices per request: each one is a full sequence in the batch
MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_STOP_IDS = 64  # stop_token_ids (vLLM's extension): checked against every sampled token
MAX_LOGPROBS = 20  # top alternatives per token; the engine's sampler has the same cap
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; a masked token's logprob is sent as this instead

Role = Literal["system", "user", "assistant", "developer", "tool"]
# The engine's third reason, "abort", never goes on the wire: no client is left to answer.
FinishReason = Literal["stop", "length", "tool_calls"]

# OpenAI request fields this server does not implement: name -> (values that change nothing and
# are accepted, why it is refused). Any other value is a 400 naming the field.
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "functions": ((None,), "the deprecated functions API is not supported; use tools"),
    "function_call": ((None,), "the deprecated functions API is not supported; use tool_choice"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "this model has no reasoning mode"),
    "verbosity": ((None,), "verbosity is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "moderation": ((None,), "moderation is not supported"),
    "store": ((None, False), "stored completions are not supported"),
    "metadata": ((None,), "metadata is only kept with store, which is not supported"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "prompt_cache_key": ((None,), "prompt caching is automatic (--enable-prefix-caching)"),
    "prompt_cache_options": ((None,), "prompt caching is automatic (--enable-prefix-caching)"),
    "prompt_cache_retention": ((None,), "prompt caching is automatic (--enable-prefix-caching)"),
    "safety_identifier": ((None,), "safety identifiers are not recorded"),
    "best_of": ((None, 1), "best_of is not supported; use n"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
}


def new_id(prefix: str) -> str:
    """A random response id, e.g. new_id("chatcmpl") -> "chatcmpl-" + 24 hex chars."""
    return f"{prefix}-{secrets.token_hex(12)}"


def _now() -> int:
    return int(time.time())


# --------------------------------------------------------------------------------------------
# Requests


class _Request(BaseModel):
    """Known fields are checked strictly, and unknown ones refused at every depth: a vendor
    extra inside an object (vLLM's `stream_options.continuous_usage_stats`) dropped in
    silence looked like it worked, as one at the top level would."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _null_is(default: Any) -> BeforeValidator:
    """For fields OpenAI declares nullable that have a default here: an explicit null (what
    openai-python sends for n=None, logprobs=None) means the default, not a 400."""
    return BeforeValidator(lambda v: default if v is None else v)


def _field_error(field: str, why: str) -> PydanticCustomError:
    """A 400 whose message starts with the field's name and whose param is that field
    (runtime/validation.py reads both from this shape)."""
    return PydanticCustomError("unsupported_field", "{field}: {why}", {"field": field, "why": why})


def _refuse_unsupported(data: Any) -> Any:
    """A 400 naming the first OpenAI field in REFUSED that is set to something that matters."""
    if isinstance(data, dict):
        for name, (noops, why) in REFUSED.items():
            if name in data and not any(data[name] == v for v in noops):
                raise _field_error(name, why)
    return data


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# What OpenAI's responses put in an assistant message, which clients send back as the history
# (openai-python's message.model_dump()): accepted when empty, as they change nothing.
ECHOED_MESSAGE_FIELDS = ("refusal", "annotations", "audio", "function_call")


class ChatMessage(_Request):
    role: Role
    # tool_calls before content: content's check reads it (info.data holds earlier fields).
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    content: str | list[TextContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = Field(None, validate_default=True)  # a tool message: its call

    @model_validator(mode="before")
    @classmethod
    def _drop_empty_echoes(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in ECHOED_MESSAGE_FIELDS:
            if name in data and data[name] not in (None, [], ""):
                raise ValueError(f"{name} is not supported in a message; leave it out")
        return {k: v for k, v in data.items() if k not in ECHOED_MESSAGE_FIELDS}

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, v: list[ToolCall] | None, info: ValidationInfo) -> Any:
        if v and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        # Checked here, not by the union, so a bad part gets one clear message, not one per
        # union member.
        if v is None or isinstance(v, str):
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

    @field_validator("content")
    @classmethod
    def _content_or_calls(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and not info.data.get("tool_calls"):
            raise ValueError("Field required (only an assistant with tool_calls may omit it)")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("role") != "tool":
            raise ValueError("only tool messages carry tool_call_id")
        if v is None and info.data.get("role") == "tool":
            raise ValueError("Field required (a tool message answers the call whose id it gives)")
        return v

    @property
    def text(self) -> str:
        """The content as one string; text parts are joined with newlines, as vLLM does."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template expects it: content a plain string, tool call
        arguments as objects (what Hugging Face templates render with tojson)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c)},
                }
                for c in self.tool_calls
            ]
        return out


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments


def _check_schema_object(v: dict[str, Any]) -> dict[str, Any]:
    """Cheap shape checks; the grammar compiler judges the rest (its error is a 400 too)."""
    if not isinstance(v, dict):
        raise ValueError("a JSON schema must be an object")
    return v


Schema = Annotated[dict[str, Any], AfterValidator(_check_schema_object)]


class JsonSchemaSpec(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: Schema = Field(alias="schema")
    strict: bool | None = None  # always strict here: the output is constrained to the schema


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self

    def schema(self) -> dict[str, Any] | None:
        """The schema the output must match; None for free text."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.json_schema is not None else None


class FunctionSpec(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # omitted: "a function with an empty parameter list" (OpenAI), so no argument at all
    parameters: Schema = Field(
        default_factory=lambda: {"type": "object", "properties": {}, "additionalProperties": False}
    )
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


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
    n: Annotated[int, _null_is(1)] = Field(1, ge=1, le=MAX_N)
    stop: Annotated[str | list[str] | None, BeforeValidator(_check_stop)] = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch's generator takes
    stream: Annotated[bool, _null_is(False)] = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions.
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_IDS)
    user: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, v: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if v is not None and info.data.get("stream") is False:
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        """REFUSED's fields with their reasons; any other field the endpoint does not know is
        refused too, as OpenAI's own API does ("Unrecognized request argument"): a vendor
        extra dropped in silence (vLLM's min_tokens, guided_choice, ...) looks like it worked."""
        data = _refuse_unsupported(data)
        if not isinstance(data, dict):
            return data
        unknown = [k for k in data if k not in cls.model_fields.keys() | REFUSED.keys()]
        if unknown:
            raise _field_error(
                unknown[0],
                "not a field this endpoint implements (OpenAI's fields and the extensions "
                "listed in the server's docs, docs/server.md); remove it",
            )
        return {k: v for k, v in data.items() if k not in REFUSED}  # their no-op values pass

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys_are_ids(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        if len(v) > MAX_LOGIT_BIAS:  # each entry costs work per request and per step
            raise ValueError(f"logit_bias has {len(v)} entries; at most {MAX_LOGIT_BIAS}")
        # "²" is a digit to str.isdigit, not to int(); a 5000-digit key is past int()'s limit
        if not all(isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10 for k in v):
            raise ValueError("logit_bias keys must be token ids (strings of up to 10 digits)")
        return {k: float(b) if type(b) is int else b for k, b in v.items()}  # JSON: 1 is 1.0


class ChatCompletionRequest(_SamplingRequest):
    messages: Messages
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Annotated[bool, _null_is(False)] = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's chat template extensions.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _template_options_agree(self) -> ChatCompletionRequest:
        if self.continue_final_message and (
            self.add_generation_prompt or self.messages[-1].role != "assistant"
        ):
            raise _field_error(
                "continue_final_message",
                "continues the last message, which must be the assistant's, and needs "
                "add_generation_prompt false",
            )
        taken = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_NAMES)
        if taken:
            raise _field_error(
                "chat_template_kwargs",
                f"{taken[0]!r} is set by the server (from the request's own fields)",
            )
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        choice, names = self.tool_choice, [t.function.name for t in self.tools or []]
        if choice in ("auto", "required") and not names:  # OpenAI refuses it, as vLLM does
            raise _field_error("tool_choice", f"{choice!r} is only allowed with tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _field_error("tool_choice", "names no tool in tools")
        if self.response_format is not None and self.tool_choice_mode() in ("required", "named"):
            raise _field_error("response_format", "cannot be combined with a forced tool call")
        return self

    def tool_choice_mode(self) -> str:
        """none, auto, required or named; OpenAI's default is auto with tools, none without."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

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
    echo: Annotated[bool, _null_is(False)] = False  # before max_tokens: its validator reads it
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
    tools: list[Tool] | None = None  # with messages: rendered as a chat request renders them
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
        "top_k": None if req.top_k is None else max(req.top_k, 0),  # unset: the artifact's
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "logit_bias": {int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        "skip_special_tokens": req.skip_special_tokens,
        "seed": req.seed,
        "max_new_tokens": max_new_tokens,
        "stop": (stop,) if isinstance(stop, str) else tuple(stop),
        "ignore_eos": req.ignore_eos,
        "stop_token_ids": tuple(req.stop_token_ids or ()),
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


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    """content is null when the answer is tool calls alone; tool_calls is sent only when
    there are some."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


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
    # OpenAI's streamed calls: {"index", "id", "type", "function": {"name", "arguments"}}
    # first, then {"index", "function": {"arguments": more}}.
    tool_calls: list[dict[str, Any]] | None = None

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
