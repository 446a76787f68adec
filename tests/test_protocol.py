"""The server's wire models: request validation, sampling mapping, and OpenAI's response shapes.

Response shapes are checked against the official openai-python types, both by strict
model_validate and by the client itself parsing our bodies and event streams through a mock
HTTP transport: that is what proves the wire format.
"""

from __future__ import annotations

import json
import math

import openai
import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatChunk
from pydantic import ValidationError

try:  # what openai-python's own transport is: httpx2 in current releases, httpx before
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from runtime.server.protocol import (
    LOGPROB_FLOOR,
    MAX_N,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TopLogprob,
    UsageInfo,
    error_body,
    new_id,
    sampling_fields,
)
from runtime.validation import validation_message

MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS, **kw})


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **kw})


# --- valid requests ---------------------------------------------------------------------------


def test_chat_request_parses_every_kind_of_field():
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "developer", "content": "dev"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": "ok", "name": "bot"},
                {"role": "tool", "content": "42", "tool_call_id": "x"},
            ],
            "temperature": 0,
            "top_p": 1,
            "n": MAX_N,
            "stop": ["\n", "END"],
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 20,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logit_bias": {"1": 2},
            "tools": [],
        }
    )
    assert [m.role for m in req.messages] == ["system", "developer", "user", "assistant", "tool"]
    assert req.messages[2].text == "a\nb"
    assert req.messages[0].text == "be brief"
    assert req.messages[3].template_dict() == {"role": "assistant", "content": "ok", "name": "bot"}
    assert req.messages[2].template_dict() == {"role": "user", "content": "a\nb"}
    assert req.temperature == 0.0 and req.n == MAX_N and req.stream_options.include_usage
    assert req.logit_bias == {"1": 2.0}
    assert req.skip_special_tokens is True and req.min_p == 0.0


def test_completion_prompt_forms():
    assert completion(prompt="abc").prompts() == ["abc"]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert completion(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    req = completion(prompt=[5, 6], echo=True, max_tokens=0, logprobs=20)
    assert req.max_tokens == 0 and req.logprobs == 20
    assert completion().max_tokens == 16  # OpenAI's default for completions


def test_tokenize_detokenize_requests():
    t = TokenizeRequest.model_validate({"prompt": "hello"})
    assert t.model is None and t.add_special_tokens is False
    t = TokenizeRequest.model_validate({"model": "m", "messages": MSGS})
    assert t.add_generation_prompt is True and t.messages[0].text == "hi"
    assert DetokenizeRequest.model_validate({"tokens": [0, 5]}).tokens == [0, 5]


# --- invalid requests name their field --------------------------------------------------------


def _error(cls, data: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(data)
    return validation_message(info.value)


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
        ({"temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"n": 100}, "n", f"less than or equal to {MAX_N}"),
        ({"n": True}, "n", "valid integer"),
        ({"messages": []}, "messages", "messages must not be empty"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'developer'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
            "only text content is supported",
        ),
        ({"messages": [{"role": "user"}]}, "messages.0.content", "Field required"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"stop": ["a", ""]}, "stop", "must not be empty"),
        ({"stop": 7}, "stop", "string or a list of strings"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
        ({"top_logprobs": 3}, "top_logprobs", "requires logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
        ({"top_k": -2}, "top_k", "greater than or equal to -1"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"seed": "1"}, "seed", "valid integer"),
        ({"model": None}, "model", "valid string"),
    ],
)
def test_bad_chat_field_is_named(extra, param, needle):
    message, got_param = _error(ChatCompletionRequest, {"model": "m", "messages": MSGS, **extra})
    assert got_param == param
    assert message.startswith(param)
    assert needle in message
    assert "Value error" not in message  # pydantic's prefix is noise to a client


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"max_tokens": 0}, "max_tokens", "only with echo=true"),
        ({"max_tokens": -1, "echo": True}, "max_tokens", "greater than or equal to 0"),
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": [[1], []]}, "prompt", "token id lists must not be empty"),
        ({"prompt": [1, -2]}, "prompt", ">= 0"),
        ({"prompt": [1, "a"]}, "prompt", "list of token ids"),
        ({"prompt": [True]}, "prompt", "list of token ids"),
        ({"prompt": 5}, "prompt", "must be a string"),
        ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"logprobs": True}, "logprobs", "valid integer"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ],
)
def test_bad_completion_field_is_named(extra, param, needle):
    message, got_param = _error(CompletionRequest, {"model": "m", "prompt": "hi", **extra})
    assert got_param == param
    assert message.startswith(param)
    assert needle in message
    assert "Value error" not in message  # pydantic's prefix is noise to a client


def test_own_messages_are_not_prefixed_twice():
    assert _error(ChatCompletionRequest, {"model": "m", "messages": []}) == (
        "messages must not be empty",
        "messages",
    )


def test_several_errors_in_one_message():
    message, param = _error(
        ChatCompletionRequest, {"model": "m", "messages": MSGS, "temperature": 3, "n": 0}
    )
    assert param == "temperature"
    assert "temperature:" in message and "; n:" in message


def test_tokenize_needs_exactly_one_input():
    assert "exactly one of prompt or messages" in _error(TokenizeRequest, {})[0]
    both = {"prompt": "a", "messages": MSGS}
    assert "exactly one of prompt or messages" in _error(TokenizeRequest, both)[0]
    assert _error(TokenizeRequest, {"messages": []})[1] == "messages"
    assert _error(DetokenizeRequest, {"tokens": [1, -1]})[1] == "tokens.1"


def test_validation_message_from_fastapi_errors():
    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def handler(request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.post("/v1/chat/completions")
    def route(req: ChatCompletionRequest) -> dict:
        return {"ok": req.model}

    client = TestClient(app)
    ok = client.post("/v1/chat/completions", json={"model": "m", "messages": MSGS})
    assert ok.json() == {"ok": "m"}
    bad = client.post(
        "/v1/chat/completions", json={"model": "m", "messages": [{"role": "robot", "content": "x"}]}
    )
    err = bad.json()["error"]
    assert err["param"] == "messages.0.role" and err["type"] == "invalid_request_error"
    assert err["message"].startswith("messages.0.role: Input should be 'system'")
    strict = client.post("/v1/chat/completions", json={"model": "m", "messages": MSGS, "stream": 1})
    assert strict.json()["error"]["param"] == "stream"  # strict: 1 is not a boolean
    broken = client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert broken.json()["error"]["message"].startswith("invalid JSON body")
    assert broken.json()["error"]["param"] is None


# --- sampling fields ----------------------------------------------------------------------------

KEYS = {
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "max_new_tokens",
    "stop",
    "ignore_eos",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "skip_special_tokens",
}
UNSET = {
    "presence_penalty": None,
    "frequency_penalty": None,
    "logit_bias": None,
    "stop_token_ids": (),
}


def test_sampling_fields_defaults_are_none():
    f = sampling_fields(chat())
    assert set(f) == KEYS
    assert f == {
        "temperature": None,
        "top_p": None,
        "top_k": None,  # unset: the artifact's default
        "min_p": 0.0,
        "repetition_penalty": None,
        "seed": None,
        "max_new_tokens": None,
        "stop": (),
        "ignore_eos": False,
        "logprobs": None,
        "skip_special_tokens": True,
        **UNSET,
    }
    assert sampling_fields(completion())["max_new_tokens"] == 16


def test_sampling_fields_chat():
    f = sampling_fields(
        chat(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            repetition_penalty=1.1,
            seed=3,
            max_tokens=5,
            max_completion_tokens=9,
            stop="END",
            ignore_eos=True,
            logprobs=True,
            top_logprobs=4,
        )
    )
    assert f == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "seed": 3,
        "max_new_tokens": 9,  # max_completion_tokens wins
        "stop": ("END",),
        "ignore_eos": True,
        "logprobs": 4,
        "skip_special_tokens": True,
        **UNSET,
    }
    assert sampling_fields(chat(max_tokens=5))["max_new_tokens"] == 5
    assert sampling_fields(chat(logprobs=True))["logprobs"] == 0  # the sampled token only
    assert sampling_fields(chat(logprobs=False))["logprobs"] is None
    assert sampling_fields(chat(top_k=-1))["top_k"] == 0


def test_sampling_fields_completion():
    f = sampling_fields(completion(stop=["a", "b"], logprobs=3, max_tokens=7, top_k=5))
    assert f["stop"] == ("a", "b") and f["logprobs"] == 3
    assert f["max_new_tokens"] == 7 and f["top_k"] == 5
    assert sampling_fields(completion(logprobs=0))["logprobs"] == 0
    assert sampling_fields(completion(echo=True, max_tokens=0))["max_new_tokens"] == 0


# --- responses match OpenAI's types ---------------------------------------------------------


def _usage() -> UsageInfo:
    return UsageInfo(
        prompt_tokens=5,
        completion_tokens=2,
        total_tokens=7,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=4),
    )


def _chat_logprobs() -> ChatChoiceLogprobs:
    return ChatChoiceLogprobs(
        content=[
            ChatTokenLogprob(
                token="Hi",
                logprob=-0.1,
                bytes=[72, 105],
                top_logprobs=[
                    TopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105]),
                    TopLogprob(token="Yo", logprob=float("-inf"), bytes=[89, 111]),
                ],
            )
        ]
    )


def _chat_response() -> ChatCompletionResponse:
    return ChatCompletionResponse(
        model="m",
        choices=[
            ChatCompletionChoice(
                index=0,
                message=ChatResponseMessage(content="Hi!"),
                logprobs=_chat_logprobs(),
                finish_reason="stop",
            )
        ],
        usage=_usage(),
    )


def test_chat_response_is_openai_chat_completion():
    resp = _chat_response()
    data = json.loads(resp.model_dump_json())
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    parsed = ChatCompletion.model_validate(data)
    assert parsed.choices[0].message.content == "Hi!"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].finish_reason == "stop"
    top = parsed.choices[0].logprobs.content[0].top_logprobs
    assert top[1].logprob == LOGPROB_FLOOR  # -inf has no JSON form
    assert parsed.usage.total_tokens == 7 and parsed.usage.prompt_tokens_details.cached_tokens == 4
    assert ChatCompletion.model_validate(resp.model_dump()).id == resp.id


def _chat_chunks() -> list[ChatCompletionChunk]:
    common = {"id": new_id("chatcmpl"), "created": 1, "model": "m"}
    return [
        ChatCompletionChunk(
            **common,
            choices=[ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))],
        ),
        ChatCompletionChunk(
            **common,
            choices=[
                ChatChunkChoice(
                    index=0, delta=DeltaMessage(content="Hi"), logprobs=_chat_logprobs()
                )
            ],
        ),
        ChatCompletionChunk(
            **common,
            choices=[ChatChunkChoice(index=0, delta=DeltaMessage(), finish_reason="stop")],
        ),
        ChatCompletionChunk(**common, choices=[], usage=_usage()),
    ]


def test_chat_chunk_serialization():
    first, middle, last, usage = (json.loads(c.model_dump_json()) for c in _chat_chunks())
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None  # key present, null
    assert "finish_reason" in middle["choices"][0] and middle["choices"][0]["delta"] == {
        "content": "Hi"
    }
    assert first["usage"] is None and "usage" in middle
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 7
    for chunk in _chat_chunks():
        parsed = OpenAIChatChunk.model_validate(chunk.model_dump())
        assert parsed.id == chunk.id


def test_completion_response_is_openai_completion():
    resp = CompletionResponse(
        model="m",
        choices=[
            CompletionChoice(
                index=0,
                text=" world",
                logprobs=CompletionLogprobs(
                    tokens=[" world"],
                    token_logprobs=[-0.5],
                    top_logprobs=[{" world": -0.5, " there": -1.5}],
                    text_offset=[5],
                ),
                finish_reason="length",
            )
        ],
        usage=_usage(),
    )
    data = json.loads(resp.model_dump_json())
    assert data["id"].startswith("cmpl-") and data["object"] == "text_completion"
    parsed = Completion.model_validate(data)
    assert parsed.choices[0].text == " world" and parsed.choices[0].finish_reason == "length"
    assert parsed.choices[0].logprobs.top_logprobs == [{" world": -0.5, " there": -1.5}]
    assert parsed.choices[0].logprobs.text_offset == [5]
    final_chunk = CompletionChunk(
        id="cmpl-1",
        created=1,
        model="m",
        choices=[CompletionChunkChoice(index=0, text="!", finish_reason="stop")],
    )
    assert Completion.model_validate(final_chunk.model_dump()).choices[0].text == "!"


def test_echo_logprobs_first_token_is_null():
    lp = CompletionLogprobs(
        tokens=["a", "b"],
        token_logprobs=[None, float("-inf")],
        top_logprobs=[None, {"b": float("nan")}],
        text_offset=[0, 1],
    )
    data = json.loads(lp.model_dump_json())
    assert data["token_logprobs"] == [None, LOGPROB_FLOOR]
    assert data["top_logprobs"] == [None, {"b": LOGPROB_FLOOR}]
    assert all(math.isfinite(x) for x in data["token_logprobs"][1:])


def test_model_card_is_openai_model():
    card = ModelCard(id="smollm2", max_model_len=2048, liteserve={"quant": "awq-w4g128"})
    data = ModelList(data=[card]).model_dump()
    assert data["object"] == "list"
    parsed = Model.model_validate(data["data"][0])
    assert parsed.id == "smollm2" and parsed.object == "model" and parsed.owned_by == "liteserve"
    assert parsed.max_model_len == 2048  # extras are kept by openai's types
    assert parsed.liteserve == {"quant": "awq-w4g128"}


def test_error_body_shape():
    body = error_body("bad temperature", param="temperature")
    assert body == {
        "error": {
            "message": "bad temperature",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }
    assert error_body("x", type="server_error", code=500)["error"]["code"] == 500
    assert ErrorResponse.model_validate(body).error.param == "temperature"


def test_new_id():
    a, b = new_id("chatcmpl"), new_id("chatcmpl")
    assert a != b and a.startswith("chatcmpl-") and len(a) == len("chatcmpl-") + 24
    int(a.removeprefix("chatcmpl-"), 16)


# --- the official client parses our bodies and streams ---------------------------------------


def _client(handler) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.MockTransport(handler))
    return openai.OpenAI(api_key="x", base_url="http://test/v1", http_client=http, max_retries=0)


def _sse(chunks) -> httpx.Response:
    body = "".join(f"data: {c.model_dump_json()}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})


def test_client_parses_chat_response_and_stream():
    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("stream"):
            return _sse(_chat_chunks())
        return httpx.Response(200, json=json.loads(_chat_response().model_dump_json()))

    client = _client(handler)
    resp = client.chat.completions.create(model="m", messages=MSGS)
    assert resp.choices[0].message.content == "Hi!" and resp.usage.completion_tokens == 2
    chunks = list(
        client.chat.completions.create(
            model="m", messages=MSGS, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi"
    assert [c.usage for c in chunks[:-1]] == [None, None, None]
    assert chunks[-1].usage.total_tokens == 7
    assert chunks[2].choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model="m", messages=MSGS) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "Hi" and final.choices[0].finish_reason == "stop"


def test_client_parses_completion_stream_with_echo_logprobs():
    common = {"id": "cmpl-1", "created": 1, "model": "m"}
    chunks = [
        CompletionChunk(
            **common,
            choices=[
                CompletionChunkChoice(
                    index=0,
                    text="ab",
                    logprobs=CompletionLogprobs(
                        tokens=["a", "b"],
                        token_logprobs=[None, -1.0],
                        top_logprobs=[None, {"b": -1.0}],
                        text_offset=[0, 1],
                    ),
                )
            ],
        ),
        CompletionChunk(
            **common, choices=[CompletionChunkChoice(index=0, text="", finish_reason="stop")]
        ),
    ]
    client = _client(lambda request: _sse(chunks))
    got = list(client.completions.create(model="m", prompt="ab", stream=True, echo=True))
    assert got[0].choices[0].text == "ab" and got[0].choices[0].finish_reason is None
    assert got[0].choices[0].logprobs.token_logprobs == [None, -1.0]
    assert got[1].choices[0].finish_reason == "stop"


def test_client_raises_our_error():
    body = error_body("temperature: too hot", param="temperature")
    client = _client(lambda request: httpx.Response(400, json=body))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=MSGS, temperature=3)
    assert info.value.param == "temperature" and info.value.type == "invalid_request_error"
    assert "temperature: too hot" in info.value.message


def test_chat_message_rejects_non_string_content():
    with pytest.raises(ValidationError) as info:
        ChatMessage.model_validate({"role": "user", "content": 3})
    assert validation_message(info.value)[1] == "content"


def test_nullable_openai_fields_take_null_as_their_default():
    """openai-python sends n=None, logprobs=None, ... as explicit nulls; they were 400s."""
    c = chat(n=None, stream=None, logprobs=None)
    assert (c.n, c.stream, c.logprobs) == (1, False, False)
    q = completion(n=None, echo=None, stream=None)
    assert (q.n, q.echo, q.stream) == (1, False, False)


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": 1},
            },
            "stream_options.continuous_usage_stats",
        ),
        ({"messages": [{"role": "user", "content": "hi", "foo": 1}]}, "messages.0.foo"),
        (
            {"response_format": {"type": "json_object", "strict_mode": True}},
            "response_format.strict_mode",
        ),
        ({"messages": [{"role": "assistant", "content": None, "refusal": "no"}]}, "messages.0"),
    ],
)
def test_unknown_nested_fields_are_refused(extra, param):
    """Dropped in silence, a vendor extra inside an object looked like it worked."""
    with pytest.raises(ValidationError) as err:
        chat(**extra)
    assert validation_message(err.value)[1] == param


def test_a_returned_assistant_message_can_be_sent_back():
    """openai-python's message.model_dump() carries refusal, annotations, audio and
    function_call as nulls: the history a client sends back is accepted."""
    import openai.types.chat as t

    returned = t.ChatCompletionMessage(role="assistant", content="Paris.").model_dump()
    req = chat(messages=[*MSGS, returned, {"role": "user", "content": "and Spain?"}])
    assert req.messages[1].template_dict() == {"role": "assistant", "content": "Paris."}
