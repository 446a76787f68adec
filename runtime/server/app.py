"""The OpenAI-compatible HTTP API over the async engine.

Every failure a client can cause is a 4xx in OpenAI's error shape and the server keeps serving;
an internal failure is a 500 for that request only. Streams follow OpenAI's SSE format exactly:
`data: {json}` events, the role first, `[DONE]` last.
"""

from __future__ import annotations

import asyncio
import codecs
import hmac
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from datetime import datetime, timezone

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime import __version__
from runtime.chat_template import ChatTemplate, ChatTemplateError
from runtime.engine.engine import ContextLengthError
from runtime.engine.grammar import GrammarError, schema_key
from runtime.engine.sampler import SamplingParams, TokenLogprobs
from runtime.message_text import MessageText
from runtime.server import protocol as p
from runtime.server.access import AccessLog
from runtime.server.async_engine import (
    AsyncEngine,
    ServerClosing,
    StepFailure,
    Update,
    Updates,
    merge,
)
from runtime.server.tools import Delta, ToolCallParser, forced_schema, merge_calls, syntax_for
from runtime.text import check_text, token_ids
from runtime.validation import validation_message

MAX_SEQUENCES = 1024  # prompts x n in one request: a bound on what one body can ask for


@dataclass
class ServerSettings:
    model_name: str
    api_keys: tuple[str, ...] = ()
    max_concurrent_requests: int = 256
    max_body_bytes: int = 4 * 2**20
    chat_template: ChatTemplate | None = None


JSON_TEXT_FIX = "escape a character outside the BMP as both halves of its pair, or send UTF-8"


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        headers: dict | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers or {}
        self.code = code  # OpenAI's named codes where a client acts on one; else the status


def _error(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: dict | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = p.error_body(message, type_, param, code or status)
    return JSONResponse(body, status_code=status, headers=headers)


class _BodyLimit:
    """Refuse bodies over the limit before they are read whole (ASGI middleware)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.limit:
            return await _error(413, f"request body over {self.limit} bytes")(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise ApiError(413, f"request body over {self.limit} bytes")
            return message

        return await self.app(scope, limited, send)


class _Auth:
    """Bearer keys for /v1/* and the tokenizer routes (ASGI middleware: a BaseHTTPMiddleware
    would hide a client's disconnect from the handlers, so a request whose client left would
    run to its end instead of being aborted)."""

    _GUARDED = ("/tokenize", "/detokenize", "/tokenizer_info")

    def __init__(self, app, keys: tuple[str, ...]) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.keys:
            path = scope["path"]
            if path.startswith("/v1") or path in self._GUARDED:
                header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                if not self._allowed(header):
                    return await _error(
                        401,
                        "missing or invalid API key: send 'Authorization: Bearer <key>'",
                        "authentication_error",
                    )(scope, receive, send)
        return await self.app(scope, receive, send)

    def _allowed(self, header: str) -> bool:
        """A known key after `Bearer` (a scheme is case-insensitive, RFC 9110), compared in
        constant time: how long a refusal takes says nothing of how much of a key was right."""
        scheme, _, key = header.strip().partition(" ")
        key_bytes = key.strip().encode("latin-1")
        known = any(hmac.compare_digest(key_bytes, k.encode()) for k in self.keys)
        return scheme.lower() == "bearer" and known


def create_app(engine: AsyncEngine, settings: ServerSettings, message_text: MessageText) -> FastAPI:
    # no /docs or /redoc: their pages load Swagger's scripts from a CDN, which an offline
    # server cannot reach; /openapi.json stays (it is the schema, served without a key)
    app = FastAPI(title="liteserve", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(_Auth, keys=settings.api_keys)  # keys before anything else
    state = _State(engine, settings, message_text)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("loc") == ("body",) and isinstance(e.get("input"), bytes) for e in errors):
            # not parsed as JSON: FastAPI reads JSON only under a JSON content type
            return _error(400, "send the body as JSON with 'Content-Type: application/json'")
        message, param = validation_message(errors)
        return _error(400, message, param=param)

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.type, exc.param, exc.headers, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI turns any failure while reading the body into a bare 400 "There was an error
        # parsing the body"; say what it was.
        cause = exc.__cause__
        if isinstance(cause, ApiError):  # the size limit, hit while a chunked body streamed in
            return _error(cause.status, cause.message, cause.type, cause.param, cause.headers)
        if isinstance(cause, UnicodeDecodeError):
            return _error(400, f"the request body is not valid UTF-8: {cause}")
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        rid = getattr(request.state, "request_id", "?")
        return _error(
            500,
            f"internal error: {type(exc).__name__} (request {rid}; the server's log has it)",
            "internal_error",
        )

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive or state.draining:
            return _error(503, "not serving", "service_unavailable")
        if (why := engine.down()) is not None:
            return _error(503, f"not serving: {why}", "service_unavailable")
        failure = engine.failure
        if failure is not None:
            engine.probe()
            return _error(503, _failing(failure), "service_unavailable")
        e = engine.engine
        return JSONResponse({"status": "ok", "backend": e.backend, "kernels": e.ops.detail})

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return p.ModelList(data=[state.model_card()]).model_dump()

    @app.get("/v1/models/{model:path}")  # :path: ids like org/name hold slashes
    async def model(model: str) -> dict:
        state.check_model(model)
        return state.model_card()

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return state.tokenizer_info()

    # Rendering and tokenizing run on worker threads: a 4 MB message takes seconds, which on
    # the event loop stalled every stream and /health
    @app.post("/tokenize")
    async def tokenize(req: p.TokenizeRequest) -> dict:
        if req.model is not None:
            state.check_model(req.model)
        ids = await run_in_threadpool(state.encode_tokenize, req)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: p.DetokenizeRequest) -> dict:
        if req.model is not None:
            state.check_model(req.model)
        state.check_ids(req.tokens, "tokens")
        # off the event loop: a 4 MB body of ids takes a second to decode
        text = await run_in_threadpool(state.tokenizer.decode, req.tokens, False)
        return {"prompt": text}

    @app.post("/v1/chat/completions")
    async def chat(req: p.ChatCompletionRequest, request: Request) -> Response:
        state.check_model(req.model)
        ids = await run_in_threadpool(state.encode_chat, req)
        return await state.respond(request, req, [ids], chat=True)

    @app.post("/v1/completions")
    async def completions(req: p.CompletionRequest, request: Request) -> Response:
        state.check_model(req.model)
        texts = req.prompts()
        named = range(len(texts)) if len(texts) > 1 else [None]
        prompts = await run_in_threadpool(
            lambda: [state.encode_prompt(x, i) for x, i in zip(texts, named, strict=True)]
        )
        return await state.respond(request, req, prompts, chat=False)

    app.state.liteserve = state
    # outermost, added last: it counts and logs the refusals of the middleware inside it too
    app.add_middleware(AccessLog, responses=engine.metrics.responses, routes=list(app.routes))
    return app


class _EventStream(StreamingResponse):
    """SSE that releases its requests however it ends: finished, failed, its client gone
    mid-stream, or gone before the body started (the body generator then never runs, and
    neither would any cleanup inside it)."""

    def __init__(
        self, body: AsyncGenerator[str, None], release: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self._release()


class _State:
    def __init__(
        self, engine: AsyncEngine, settings: ServerSettings, message_text: MessageText
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.engine.tokenizer
        self.message_text = message_text  # the pipeline's: one copy of the tokenizer
        self.session_len = engine.engine.session_len
        self.vocab = engine.engine.arch.vocab_size
        self.capacity_tokens = engine.engine.pool_stats().capacity_tokens
        # what one request can hold: clients size prompts by it, and a pool smaller than the
        # session holds fewer tokens than session_len
        self.max_model_len = min(self.session_len, self.capacity_tokens)
        self.created = int(time.time())
        self.in_flight = 0
        self.draining = False
        self._pieces: dict[int, tuple[str, bytes]] = {}

    # ---- requests in ----

    def check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server serves {self.settings.model_name!r}",
                "not_found_error",
                "model",
            )

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise ApiError(
                400,
                f"token ids {bad[:5]} are outside the vocabulary (0..{self.vocab - 1})",
                param=param,
            )

    def encode_prompt(self, prompt: str | list[int], index: int | None = None) -> list[int]:
        """A prompt's ids; `index` names it among a request's several prompts."""
        if isinstance(prompt, str):
            ids = self._encode(prompt, "prompt")
        else:
            self.check_ids(prompt)
            ids = list(prompt)
        if not ids:  # the engine's own refusal named no prompt and no field
            which = "the prompt" if index is None else f"prompt {index}"
            raise ApiError(400, f"{which} is empty (no tokens): send some text", param="prompt")
        return ids

    def _encode(self, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of request text; half of a UTF-16 surrogate pair is a 400 naming it."""
        _check_text(text, param)
        return token_ids(self.tokenizer, text, add_special_tokens)

    def encode_chat(
        self, req: p.ChatCompletionRequest, add_generation_prompt: bool = True
    ) -> list[int]:
        template = self.settings.chat_template
        if template is None:
            raise ApiError(
                400,
                "this model has no chat template; use /v1/completions or "
                "start the server with --chat-template FILE",
            )
        messages = [m.template_dict() for m in req.messages]
        for i, m in enumerate(messages):  # named by message, not by an offset in the render
            _check_text(m["content"], f"messages.{i}.content")
        if "developer" not in template.source:  # OpenAI's newer name for the system role
            for m in messages:
                m["role"] = "system" if m["role"] == "developer" else m["role"]
        tools = None
        if req.tools and req.tool_choice_mode() != "none":  # as transformers passes them
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
        options = _RenderOptions(
            add_generation_prompt and req.add_generation_prompt, req.chat_template_kwargs or {}
        )
        outside = {  # what the template renders beside the contents, all the client's
            **{f"messages.{i}": {k: v for k, v in m.items() if k != "content"}
               for i, m in enumerate(messages)},
            "tools": tools,
            "chat_template_kwargs": options.kwargs,
        }  # fmt: skip
        for where, value in outside.items():
            try:
                self.message_text.check_plain(value, where)
            except ValueError as e:
                raise ApiError(400, str(e), param=where.split(".")[0]) from e

        def render(texts: dict[int, str]) -> str:
            """The prompt, with the messages' texts replaced as `texts` says."""
            chat = [{**m, "content": texts[i]} if i in texts else m for i, m in enumerate(messages)]
            text = _render(template, chat, options, tools)
            return _continued(text, chat[-1]["content"]) if req.continue_final_message else text

        full = _render(template, messages, options, tools)
        _check_tools_rendered(template, messages, options, tools, full, req)
        text = render({}) if req.continue_final_message else full
        _check_text(text, "messages")
        try:  # a special token typed in a message stays text (runtime/message_text.py)
            return self.message_text.encode(text, [m["content"] for m in messages], render)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from e

    def encode_tokenize(self, req: p.TokenizeRequest) -> list[int]:
        if req.messages is not None:
            chat = p.ChatCompletionRequest(
                model=self.settings.model_name, messages=req.messages, tools=req.tools
            )
            return self.encode_chat(chat, req.add_generation_prompt)
        return self._encode(req.prompt or "", "prompt", req.add_special_tokens)

    def json_schema(self, req) -> str | None:
        """The compiled schema's key when the output is constrained: a forced tool call's
        arguments, or response_format; an uncompilable schema is a 400 naming its field."""
        mode = req.tool_choice_mode() if isinstance(req, p.ChatCompletionRequest) else "none"
        if mode in ("required", "named"):
            tools = [t.model_dump() for t in req.tools]
            named = req.tool_choice.function.name if mode == "named" else None
            schema, param = forced_schema(tools, named), "tools"
        elif req.response_format is not None:
            schema, param = req.response_format.schema(), "response_format"
        else:
            return None
        if schema is None:
            return None
        try:
            self.engine.engine.grammar.check(schema)
        except GrammarError as e:
            raise ApiError(400, f"{param}: {e}", param=param) from e
        return schema_key(schema)

    def tool_parser(self, req) -> ToolCallParser:
        """How a chat choice's text becomes content and tool_calls (all content without
        tools; completions never parse)."""
        if not isinstance(req, p.ChatCompletionRequest):
            return ToolCallParser("none")
        mode = req.tool_choice_mode()
        template = self.settings.chat_template
        named = req.tool_choice.function.name if mode == "named" else None
        declared = frozenset(t.function.name for t in req.tools or ())
        syntax = syntax_for(template.source if template else None)
        return ToolCallParser(mode, syntax, named, declared)

    def check_length(self, req, prompt_len: int, new: int) -> None:
        """Against the max_model_len /v1/models advertises, named as such: the engine's own
        refusal quoted session_len or KV blocks, limits the client was never told."""
        if prompt_len + new > self.max_model_len:
            raise ApiError(
                400,
                f"the prompt ({prompt_len} tokens) plus max_tokens ({new}) is "
                f"{prompt_len + new} tokens, over this model's max_model_len "
                f"{self.max_model_len}; shorten the prompt or lower max_tokens",
                param="messages" if hasattr(req, "messages") else "prompt",
                code="context_length_exceeded",
            )

    def sampling_fields(self, req) -> dict:
        """The request's sampling settings, checked once for all its prompts and choices: a
        request of 1024 prompts with a large logit_bias or schema checked them 1024 times.
        Run off the event loop (a schema compiles here)."""
        fields = {k: v for k, v in p.sampling_fields(req).items() if v is not None}
        self.check_ids(list(fields.get("logit_bias", {})), "logit_bias")
        self.check_ids(list(fields.get("stop_token_ids", ())), "stop_token_ids")
        fields["json_schema"] = self.json_schema(req)
        if fields["json_schema"] is not None and fields.get("stop"):
            raise ApiError(
                400,
                "stop: stop strings cannot be combined with structured output (response_format "
                "json_object/json_schema or a forced tool call): a stop would cut the JSON "
                "before it is complete, and the output already ends where the JSON does",
                param="stop",
            )
        return fields

    def params(self, req, checked: dict, n_index: int, prompt_len: int) -> SamplingParams:
        """One choice's settings: `checked` (sampling_fields) with its seed and length."""
        fields = dict(checked)
        engine = self.engine.engine
        if "max_new_tokens" not in fields:  # OpenAI's default: what the session has left
            room = min(self.session_len, self.capacity_tokens)
            fields["max_new_tokens"] = max(room - prompt_len, 1)
        if "seed" in fields and n_index:  # n choices with one seed must still differ
            seed = fields["seed"] + n_index
            fields["seed"] = seed - 2**64 if seed >= 2**64 else seed  # torch's range, wrapped
        self.check_length(req, prompt_len, 0 if _scores_prompt(req) else fields["max_new_tokens"])
        if getattr(req, "echo", False):
            fields["prompt_logprobs"] = fields.get("logprobs") or 0
            # max_tokens 0 with echo scores the prompt alone: one token is run, none returned
            fields["max_new_tokens"] = max(fields.get("max_new_tokens", 1), 1)
        params = engine.sampling_params(**fields)
        try:
            params.validate()
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        return params

    # ---- responses out ----

    async def respond(
        self, request: Request, req, prompts: list[list[int]], chat: bool
    ) -> Response:
        checked = await run_in_threadpool(self.sampling_fields, req)
        # no await from here to the slot taken: requests in between cannot pass the limit
        if self.in_flight >= self.settings.max_concurrent_requests:
            raise ApiError(
                429,
                f"over {self.settings.max_concurrent_requests} concurrent requests; retry shortly",
                "rate_limit_error",
                headers={"Retry-After": "1"},
            )
        if len(prompts) * req.n > MAX_SEQUENCES:
            raise ApiError(
                400,
                f"{len(prompts)} prompts x n={req.n} is over {MAX_SEQUENCES} sequences per "
                f"request; split the request",
                param="prompt",
            )
        jobs = [
            (i, pi, ids, self.params(req, checked, i, len(ids)))
            for pi, ids in enumerate(prompts)
            for i in range(req.n)
        ]
        jobs = [(k, pi, ids, params) for k, (_, pi, ids, params) in enumerate(jobs)]
        self.in_flight += 1
        streams: list[Updates] = []
        released = False

        async def release() -> None:
            """Once, however the response ends: the slot back, unfinished requests aborted."""
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1
                for s in streams:
                    await s.aclose()

        try:
            requests = [(ids, params) for _, _, ids, params in jobs]
            scored = _scores_prompt(req)
            streams += await self._open(requests, "messages" if chat else "prompt", scored)
            if req.stream:  # the response releases them when it ends
                return _EventStream(self._sse(req, jobs, streams, chat), release)
        except BaseException:
            await release()
            raise
        try:
            return await self._whole(request, req, jobs, streams, chat)
        finally:
            await release()

    async def _open(
        self,
        requests: list[tuple[list[int], SamplingParams]],
        prompt_param: str,
        scored_only: bool = False,
    ) -> list[Updates]:
        """Start every sequence of a request in one step; the engine's refusal of any (too
        long, bad ids) becomes a 400 here, and none of them runs. Too long for the session
        carries OpenAI's code, context_length_exceeded: clients trim their history on it."""
        try:
            return await self.engine.submit(requests, scored_only)
        except ContextLengthError as e:
            raise ApiError(400, str(e), param=prompt_param, code="context_length_exceeded") from e
        except ServerClosing as e:
            raise ApiError(503, str(e), "service_unavailable") from e
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        except Exception as e:  # logged by the engine thread; a 500 for this request only
            raise ApiError(500, f"internal error: {type(e).__name__}: {e}", "internal_error") from e

    async def _whole(self, request: Request, req, jobs, streams, chat: bool) -> Response:
        async def collect(stream) -> list[Update]:
            return [u async for u in stream]

        gather = asyncio.gather(*(collect(s) for s in streams))
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({gather, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            left = not gather.done()
            if left:  # the client left: stop reading the streams, so release() can abort them
                gather.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.wait({gather})
                if not gather.cancelled():
                    gather.exception()  # retrieved, or asyncio logs it as never retrieved
        if left:
            return Response(status_code=499)
        results = gather.result()
        for updates in results:
            if updates and updates[-1].error:
                raise ApiError(
                    updates[-1].error_status, updates[-1].error, _error_type(updates[-1])
                )
        merged = [_scored_only(req, merge(u)) for u in results]
        usage = self._usage([_Count().add(m) for m in merged], req.n)
        rid = p.new_id("chatcmpl" if chat else "cmpl")
        if chat:
            choices = [
                self._chat_choice(req, k, m) for (k, _, _, _), m in zip(jobs, merged, strict=True)
            ]
            body = p.ChatCompletionResponse(
                id=rid, created=int(time.time()), model=req.model, choices=choices, usage=usage
            )
        else:
            choices = [
                {
                    "index": k,
                    "text": self._echo(req, ids) + m.text,
                    "logprobs": self._completion_logprobs(req, ids, m, _TextOffsets()),
                    "finish_reason": _finish(m.finish_reason),
                }
                for (k, _, ids, _), m in zip(jobs, merged, strict=True)
            ]
            body = p.CompletionResponse(
                id=rid, created=int(time.time()), model=req.model, choices=choices, usage=usage
            )
        return JSONResponse(body.model_dump())

    def _chat_choice(self, req, k: int, m: Update) -> dict:
        parser = self.tool_parser(req)
        d = _joined(parser.feed(m.text), parser.finish())
        calls = merge_calls(_allowed_calls(req, d.tool_calls))
        return {
            "index": k,
            "message": {
                "role": "assistant",
                "content": d.content if d.content or not calls else None,
                "tool_calls": calls or None,
            },
            "logprobs": self._chat_logprobs(m.logprobs) if req.logprobs else None,
            "finish_reason": _chat_finish(req, m.finish_reason, bool(calls)),
        }

    async def _sse(self, req, jobs, streams, chat: bool) -> AsyncIterator[str]:
        rid = p.new_id("chatcmpl" if chat else "cmpl")
        parsers = [self.tool_parser(req) for _ in jobs]
        offsets = [_TextOffsets() for _ in jobs]
        created = int(time.time())
        counts = [_Count() for _ in streams]
        echoed: set[int] = set()
        if chat:
            for k, *_ in jobs:
                yield sse_event(
                    p.ChatCompletionChunk(
                        id=rid,
                        created=created,
                        model=req.model,
                        choices=[
                            {
                                "index": k,
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                            }
                        ],
                    )
                )
        async with aclosing(_interleave(streams)) as updates:  # a break stops every pump
            async for k, update in updates:
                if update.error:
                    kind = _error_type(update)
                    yield sse_event(p.error_body(update.error, kind, None, update.error_status))
                    break
                update = _scored_only(req, update)
                counts[k].add(update)
                first = k not in echoed
                echoed.add(k)
                chunk = self._chunk(
                    req, rid, created, jobs[k], update, chat, first, parsers[k], offsets[k]
                )
                yield sse_event(chunk)
            else:
                if req.stream_options is not None and req.stream_options.include_usage:
                    cls = p.ChatCompletionChunk if chat else p.CompletionChunk
                    yield sse_event(
                        cls(
                            id=rid,
                            created=created,
                            model=req.model,
                            choices=[],
                            usage=self._usage(counts, req.n),
                        )
                    )
        yield "data: [DONE]\n\n"

    def _chunk(
        self,
        req,
        rid: str,
        created: int,
        job,
        u: Update,
        chat: bool,
        first: bool,
        parser: ToolCallParser,
        offsets: _TextOffsets,
    ) -> p.ChatCompletionChunk | p.CompletionChunk:
        k, _, ids, _ = job
        finish = _finish(u.finish_reason) if u.finish_reason else None
        if chat:
            d = parser.feed(u.text)
            if finish:
                d = _joined(d, parser.finish())
            calls = _allowed_calls(req, d.tool_calls)
            delta: dict = {"content": d.content} if d.content or not (finish or calls) else {}
            if calls:
                delta["tool_calls"] = calls
            choice = {
                "index": k,
                "delta": delta,
                "logprobs": self._chat_logprobs(u.logprobs) if req.logprobs else None,
                "finish_reason": finish and _chat_finish(req, finish, parser.called),
            }
            return p.ChatCompletionChunk(id=rid, created=created, model=req.model, choices=[choice])
        text = (self._echo(req, ids) if first else "") + u.text
        choice = {
            "index": k,
            "text": text,
            "logprobs": self._completion_logprobs(req, ids, u, offsets, echo=first),
            "finish_reason": finish,
        }
        return p.CompletionChunk(id=rid, created=created, model=req.model, choices=[choice])

    def _echo(self, req, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""

    def _usage(self, counts: list[_Count], n: int) -> dict:
        prompt = sum(c.prompt_tokens for c in counts[::n])
        completion = sum(c.completion_tokens for c in counts)
        cached = sum(c.cached_tokens for c in counts[::n])
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """A token as logprobs show it: its text and its own bytes. A token holding part of a
        UTF-8 character has no text of its own; it is written ``bytes:\\xNN...`` (OpenAI's
        legacy form), so tokens stay distinct where each would otherwise be U+FFFD."""
        found = self._pieces.get(token_id)
        if found is None:
            raw = self.engine.engine.token_bytes(token_id)
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            found = self._pieces[token_id] = (text, raw)
        return found

    def _chat_logprobs(self, lps: list[TokenLogprobs]) -> dict:
        def entry(token_id: int, lp: float) -> dict:
            text, raw = self.piece(token_id)
            return {"token": text, "logprob": lp, "bytes": list(raw)}

        return {
            "content": [
                {**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                for x in lps
            ]
        }

    def _completion_logprobs(
        self, req, ids: list[int], u: Update, offsets: _TextOffsets, echo: bool = True
    ) -> dict | None:
        """OpenAI's legacy logprobs of one chunk (or a whole completion); ``offsets`` carries
        the text position across a stream's chunks."""
        if req.logprobs is None:
            return None
        scored: list[tuple[int, float | None, list[tuple[int, float]] | None]] = []
        if req.echo and echo:
            scored.append((ids[0], None, None))
            scored += [(x.token_id, x.logprob, x.top) for x in u.prompt_logprobs]
        scored += [(x.token_id, x.logprob, x.top) for x in u.logprobs]
        return {
            "tokens": [self.piece(t)[0] for t, _, _ in scored],
            "token_logprobs": [v for _, v, _ in scored],
            "top_logprobs": [self._top_with_chosen(t, v, top) for t, v, top in scored],
            "text_offset": [offsets.next(self.piece(t)[1]) for t, _, _ in scored],
        }

    def _top_with_chosen(
        self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None
    ) -> dict | None:
        """The legacy API's alternatives always hold the chosen token, first (up to
        logprobs + 1 entries, as OpenAI documents and vLLM returns; with `logprobs: 0`, the
        chosen token alone): lm-eval and other clients look the chosen token up in them."""
        if top is None:
            return None
        out = {self.piece(token_id)[0]: logprob}
        for t, v in top:
            out.setdefault(self.piece(t)[0], v)
        return out

    def model_card(self) -> dict:
        m = self.engine.engine.artifact.manifest
        return p.ModelCard(
            id=self.settings.model_name,
            created=self.created,
            max_model_len=self.max_model_len,
            liteserve={
                "source": m.source.id,
                "family": m.architecture.family,
                "quantization": f"{m.quantization.method} int{m.quantization.bits} "
                f"g{m.quantization.group_size}",
                "kv_quant": self.engine.engine.config.kv_quant,
                "backend": self.engine.engine.backend,
            },
        ).model_dump()

    def tokenizer_info(self) -> dict:
        template = self.settings.chat_template
        tokens = template.special_tokens if template else {}
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": self.session_len,
            "chat_template": template.source if template else None,
            **tokens,
        }


def _error_type(u: Update) -> str:
    return {400: "invalid_request_error", 503: "service_unavailable"}.get(
        u.error_status, "internal_error"
    )


@dataclass(frozen=True)
class _RenderOptions:
    add_generation_prompt: bool
    kwargs: dict  # chat_template_kwargs: the template's own variables (enable_thinking, ...)


def _render(
    template: ChatTemplate, messages: list[dict], options: _RenderOptions, tools: list | None
) -> str:
    try:
        extra = {**options.kwargs, **({"tools": tools} if tools else {})}
        return template.render(
            messages, add_generation_prompt=options.add_generation_prompt, **extra
        )
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param="messages") from e


def _continued(text: str, final: str) -> str:
    """The prompt cut after the final (assistant) message's text, so the model goes on with it
    instead of after its end-of-turn (continue_final_message, vLLM's way: the text's last
    occurrence in the rendered prompt)."""
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ApiError(
            400,
            "continue_final_message: the chat template does not render the last message's text "
            "as given, so there is nothing to continue; send it as a completions prompt",
            param="continue_final_message",
        )
    return text[: at + len(final)]


def _check_tools_rendered(
    template: ChatTemplate,
    messages: list[dict],
    options: _RenderOptions,
    tools: list | None,
    text: str,
    req: p.ChatCompletionRequest,
) -> None:
    """Refuse what the template would drop without a word (the prompt is the same without
    it): tools the model is free to call (tool_choice auto), and earlier tool_calls. Forced
    calls still work without the tools in the prompt: the grammar holds the output to them."""
    if (
        tools
        and req.tool_choice_mode() == "auto"
        and text == _render(template, messages, options, None)
    ):
        raise ApiError(
            400,
            "this model's chat template does not render tools, so the model would never see "
            "them: name the function in tool_choice (or 'required'; the output is then held "
            "to a call of the tools' schema), or serve with --chat-template FILE whose "
            "template renders `tools`",
            param="tools",
        )
    calls = [i for i, m in enumerate(messages) if m.get("tool_calls")]
    if not calls:
        return
    plain = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
    if text == _render(template, plain, options, tools):
        raise ApiError(
            400,
            f"this model's chat template drops the tool_calls of messages[{calls[0]}]: serve "
            "with --chat-template FILE whose template renders them, or send the calls as the "
            "assistant's content",
            param=f"messages.{calls[0]}.tool_calls",
        )


class _TextOffsets:
    """Where each token of a completion starts in its text, in characters, across the chunks
    of a stream: the tokens' bytes go through one UTF-8 decoder, so a character split over
    several tokens is counted once, at the token that completes it."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._at = 0

    def next(self, raw: bytes) -> int:
        at = self._at
        self._at += len(self._decoder.decode(raw))
        return at


def _failing(failure: StepFailure) -> str:
    """Why /health is 503: what the last step raised, when, and how many failed in a row."""
    when = datetime.fromtimestamp(failure.at, timezone.utc).isoformat(timespec="seconds")
    ago = max(time.time() - failure.at, 0.0)
    return (
        f"the engine's steps are failing ({failure.count} since the last success, the last "
        f"{ago:.1f} s ago at {when}): {failure.message}"
    )


def _check_text(text: str, param: str) -> None:
    try:
        check_text(text, param, JSON_TEXT_FIX)
    except ValueError as e:
        raise ApiError(400, str(e), param=param) from e


def _scores_prompt(req) -> bool:
    """max_tokens 0 with echo asks for the prompt's logprobs alone (lm-eval's loglikelihood)."""
    return getattr(req, "echo", False) and req.max_tokens == 0


def _scored_only(req, u: Update) -> Update:
    """A request that scores its prompt gets nothing of the token that was run for it."""
    if _scores_prompt(req):
        return replace(
            u, text="", token_ids=[], logprobs=[], finish_reason=u.finish_reason and "length"
        )
    return u


def _finish(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def _chat_finish(req, reason: str | None, called: bool) -> str | None:
    """OpenAI's reason: "tool_calls" when the model chose to call (auto, required); a named
    call the request forced ends with "stop"; a cut-short answer stays "length"."""
    reason = _finish(reason)
    if called and reason == "stop" and req.tool_choice_mode() in ("auto", "required"):
        return "tool_calls"
    return reason


def _joined(a: Delta, b: Delta) -> Delta:
    return Delta(a.content + b.content, a.tool_calls + b.tool_calls)


def _allowed_calls(req, calls: list[dict]) -> list[dict]:
    """parallel_tool_calls=false: the first call only."""
    return calls if req.parallel_tool_calls else [c for c in calls if c["index"] == 0]


@dataclass
class _Count:
    """One choice's usage, kept as its updates stream by (their text is not kept)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, u: Update) -> _Count:
        self.prompt_tokens = max(self.prompt_tokens, u.prompt_tokens)
        self.completion_tokens += len(u.token_ids)
        self.cached_tokens = max(self.cached_tokens, u.cached_tokens)
        return self


def sse_event(obj: dict | BaseModel) -> str:
    """One SSE event; a chunk model serializes itself (pydantic's JSON encoder: half the time
    of model_dump() and json.dumps, paid for every streamed chunk)."""
    body = (
        obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj, ensure_ascii=False)
    )
    return f"data: {body}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)


async def _interleave(streams: list[AsyncIterator[Update]]) -> AsyncIterator[tuple[int, Update]]:
    """Updates of several choices as they come (n > 1 streams in one response)."""
    if len(streams) == 1:  # the common case, without a task and a queue between
        async for update in streams[0]:
            yield 0, update
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, stream: AsyncIterator[Update]) -> None:
        try:
            async for update in stream:
                await queue.put((k, update))
        finally:
            await queue.put((k, None))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    open_ = len(tasks)
    try:
        while open_:
            k, update = await queue.get()
            if update is None:
                open_ -= 1
                continue
            yield k, update
    finally:
        # Wait for the pumps to leave their streams (a cancelled one aborts its request), so
        # that closing a stream later never meets a pump still inside it.
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
