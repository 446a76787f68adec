"""Every HTTP response counted and, at `-v`, logged, each under a request id.

The engine's metrics see only the requests it admitted: a 400, 401, 404, 413 or 429 changed no
metric, and nothing was logged per request, so neither a dashboard nor a log showed clients
being refused. Each response now counts in ``liteserve:http_responses_total{route,status}``
(labelled with the route's template, `/v1/models/{model:path}` for a model's lookup; paths
outside the API's own count as "other", so a scan of random paths cannot grow the series
without bound), and one log line at INFO (`runtime -v serve`) gives its id, method,
path, status and time; never a prompt or a key.

The id is the client's ``X-Request-Id`` when it sends a usable one (as vLLM and most proxies
do), else a new one; the response carries it back in ``X-Request-Id`` and a 500's message
names it, so a client's report can be matched to the server's log line and traceback.
"""

from __future__ import annotations

import logging
import re
import secrets
import time

from prometheus_client import Counter
from starlette.routing import BaseRoute, Match

log = logging.getLogger("liteserve")

HEADER = b"x-request-id"
_USABLE = re.compile(rb"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces: safe in a log line


class AccessLog:
    """ASGI middleware, the outermost: it must see the refusals of the ones inside it."""

    def __init__(self, app, responses: Counter, routes: list[BaseRoute]) -> None:
        self.app, self.responses = app, responses
        self.paths = frozenset(r.path for r in routes if "{" not in r.path)
        self.templated = [r for r in routes if "{" in r.path]

    def route(self, scope: dict) -> str:
        """The label: the path itself, or the template it matched (found by path alone, as a
        refusal before routing, such as a 401, never reaches the router), or "other"."""
        if scope["path"] in self.paths:
            return scope["path"]
        for r in self.templated:  # PARTIAL: the path matched, the method did not (a 405)
            if r.matches(scope)[0] != Match.NONE:
                return r.path
        return "other"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(HEADER, b"")
        rid = given.decode() if _USABLE.fullmatch(given) else secrets.token_hex(12)
        scope.setdefault("state", {})["request_id"] = rid
        status = 500  # what the client gets if the app fails before it starts a response
        start = time.perf_counter()

        async def send_with_id(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = scope["path"]
            self.responses.labels(self.route(scope), str(status)).inc()
            log.info(
                "request %s: %s %r %d, %.3f s",  # %r: a path's %0A is no new log line
                rid,
                scope["method"],
                path[:200],
                status,
                time.perf_counter() - start,
            )
