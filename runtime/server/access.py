"""Every HTTP response counted and, at `-v`, logged, each under a request id.

The engine's metrics see only the requests it admitted: a 400, 401, 404, 413 or 429 changed no
metric, and nothing was logged per request, so neither a dashboard nor a log showed clients
being refused. Each response now counts in ``liteserve:http_responses_total{route,status}``
(routes outside the API's own count as "other", so a scan of random paths cannot grow the
series without bound), and one log line at INFO (`runtime -v serve`) gives its id, method,
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

log = logging.getLogger("liteserve")

HEADER = b"x-request-id"
_USABLE = re.compile(rb"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces: safe in a log line


class AccessLog:
    """ASGI middleware, the outermost: it must see the refusals of the ones inside it."""

    def __init__(self, app, responses: Counter, routes: frozenset[str]) -> None:
        self.app, self.responses, self.routes = app, responses, routes

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
            route = path if path in self.routes else "other"
            self.responses.labels(route, str(status)).inc()
            log.info(
                "request %s: %s %r %d, %.3f s",  # %r: a path's %0A is no new log line
                rid,
                scope["method"],
                path[:200],
                status,
                time.perf_counter() - start,
            )
