"""Replicas on Ray Serve: `runtime serve ARTIFACT --replicas N [--ray-address ADDR]`.

N engine replicas (Ray Serve deployment `LiteEngine`), each running the very FastAPI app of the
single-process server (`runtime.server.serve.build_app`) in-process, behind a thin ingress
deployment (`LiteIngress`) on Ray Serve's HTTP proxy:

    client -> Ray Serve HTTP proxy -> LiteIngress (reads the body, hashes the prompt's leading
              blocks) -> DeploymentHandle to LiteEngine, routed by PrefixRouter -> one replica
              runs the request through its FastAPI app and streams the ASGI messages back

Why an ingress deployment and not `serve.ingress(app)` on the engine deployment itself: Ray
Serve's HTTP proxy routes a request on its ASGI scope alone (method, path, headers) and streams
the body to the chosen replica afterwards, so a router at the proxy never sees the prompt. The
ingress reads the body first, and the `LiteEngine` handle's request router (Ray Serve's public
`RequestRouter` API, `ray.serve.request_router`) gets the prompt's block hashes with the call.
`PrefixRouter.choose_replicas` asks the pure policy in `runtime/server/routing.py` for a
replica, ranks the rest by load as the fallback (Ray moves to the next rank when a replica's
queue is full), and records where each request went in its prefix table.

`/metrics` on the ingress is every live replica's metrics with a `replica` label (the replica's
Ray Serve id, also sent back on every response as `x-liteserve-replica`), plus the router's
`liteserve:router_requests_total{policy,reason}`. Everything else is relayed unchanged, so the
API (routes, errors, SSE, auth) is the single-process server's.

Importing this module does not import Ray: the `runtime` CLI can take `replica_options`
without the `cluster` extra installed. The Ray-bound classes are built on first use and served
as module attributes (PEP 562 `__getattr__`), so Ray pickles them by reference and a worker
imports them from here.
"""

import asyncio
import contextlib
import importlib
import json
import logging
import os
import signal
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from runtime.server.listen import listen_socket
from runtime.server.routing import (
    MAX_IMBALANCE,
    TABLE_SIZE,
    PrefixTable,
    choose_replica,
    request_hashes,
    round_robin,
)

log = logging.getLogger("liteserve")

ENGINE = "LiteEngine"  # the engine deployment's name
INGRESS = "LiteIngress"
APP = "liteserve"  # the Ray Serve application's default name
REPLICA_HEADER = "x-liteserve-replica"
INSTALL_HINT = "Ray Serve is not installed: pip install liteserve[cluster]"
POLICIES = ("prefix", "round-robin")
HEALTH_TIMEOUT_S = 10  # the ingress's /health answers 503 when no replica answers within it


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        return False
    return True


# ---- what travels from the ingress to a replica ----


@dataclass
class ProxiedRequest:
    """One HTTP request relayed to an engine replica. `prefix` is the routing key (block
    hashes, see routing.request_hashes); `pinned` names the replica a per-replica call (the
    metrics scrape) must reach."""

    method: str = "GET"
    path: str = "/"
    query: bytes = b""
    headers: list = field(default_factory=list)
    body: bytes = b""
    prefix: list = field(default_factory=list)
    pinned: str | None = None
    internal: bool = False  # the ingress's own calls (metrics): not counted as routed
    route: tuple | None = None  # (chosen replica, reason), set by the router


async def asgi_call(app: Callable, req: ProxiedRequest) -> AsyncIterator[dict]:
    """Run one request through an ASGI app in this process; yield the app's messages
    (`http.response.start`, then `http.response.body`s). Leaving early (the caller cancelled:
    the client went away) tells the app the client disconnected, so the engine aborts the
    request and frees its blocks, as the single-process server does."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": req.method,
        "scheme": "http",
        "path": req.path,
        "raw_path": req.path.encode(),
        "root_path": "",
        "query_string": req.query,
        "headers": [(bytes(k), bytes(v)) for k, v in req.headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await out.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    try:
        while True:
            get = asyncio.ensure_future(out.get())
            await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():  # the app returned: pass on what it left, then stop
                get.cancel()
                while not out.empty():
                    yield out.get_nowait()
                task.result()  # its exception, if it raised
                return
            message = get.result()
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body"):
                break
        await task
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()


# ---- the engine replica ----


class EngineReplica:
    """One engine and the single-process server's FastAPI app, in a Ray Serve replica."""

    def __init__(
        self,
        artifact: str,
        engine_kw: dict,
        model_name: str,
        api_keys: tuple[str, ...] = (),
        max_concurrent_requests: int = 256,
        max_body_bytes: int = 4 * 2**20,
        chat_template: str | None = None,
    ) -> None:
        from ray import serve

        from runtime import EngineConfig, pipeline
        from runtime.server.serve import build_app

        pipe = pipeline(
            artifact, EngineConfig(**engine_kw), Path(chat_template) if chat_template else None
        )
        self.app = build_app(
            pipe, model_name, tuple(api_keys), max_concurrent_requests, max_body_bytes
        )
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.state = self.app.state.liteserve
        self.state.engine.start()  # what build_app's lifespan does on entry
        engine, pool = pipe.engine, pipe.engine.pool_stats()
        log.warning(
            "replica %s: %s as %r, backend %s on %s, kv %s, %d blocks",
            self.replica,
            artifact,
            model_name,
            engine.backend,
            engine.ops.device,
            engine.config.kv_quant,
            pool.num_blocks,
        )

    async def http(self, req: ProxiedRequest) -> AsyncIterator[dict]:
        async with contextlib.aclosing(asgi_call(self.app, req)) as messages:
            async for message in messages:
                if message["type"] == "http.response.start":
                    headers = list(message.get("headers", []))
                    headers.append((REPLICA_HEADER.encode(), self.replica.encode()))
                    message = {**message, "headers": headers}
                yield message

    async def metrics_text(self, req: ProxiedRequest) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.state.engine.metrics.registry).decode()

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        if (why := self.state.engine.down()) is not None:
            raise RuntimeError(f"replica {self.replica}: {why}")

    def __del__(self) -> None:  # Ray Serve calls it when it stops the replica gracefully
        state = getattr(self, "state", None)
        if state is not None:
            state.draining = True
            state.engine.stop()


# ---- the Ray-bound classes, built on first use ----

_ROUTERS: dict[tuple[str, str], Any] = {}  # (app, deployment) -> its router in this process
_BUILT: dict[str, type] = {}
_LAZY = ("PrefixRouter", "LiteIngress")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        if not _BUILT:
            _build_ray_classes()
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _home() -> Any:
    """This module, the one in sys.modules. Ray Serve pickles the router class by value,
    with copies of the module globals its methods use: the router reaches the module's
    registry and request class through this instead."""
    return importlib.import_module(__name__)


def register_router(router: Any) -> None:
    _ROUTERS[(router._deployment_id.app_name, router._deployment_id.name)] = router


def registered_router(app_name: str) -> Any:
    """The engine handle's router in this process, once the handle has made it. (A module
    function, so that the ingress's route functions, which Ray Serve pickles by value with a
    copy of the globals they use, reach the module's own registry through it.)"""
    return _ROUTERS.get((app_name, ENGINE))


def _proxied_request(request: Any, body: bytes = b"", prefix: list | None = None) -> ProxiedRequest:
    """The relayed copy of a request the ingress received (a Starlette Request)."""
    return ProxiedRequest(
        request.method,
        request.scope["path"],
        request.scope.get("query_string", b""),
        list(request.scope["headers"]),
        body,
        prefix or [],
    )


def _proxied(pending: Any) -> ProxiedRequest | None:
    args = getattr(pending, "args", None)
    if args and isinstance(args[0], ProxiedRequest):
        return args[0]
    return None


def _build_ray_classes() -> None:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST
    from ray import serve
    from ray.exceptions import RayActorError
    from ray.serve.request_router import RequestRouter

    from runtime.server.app import sse_event
    from runtime.server.protocol import error_body

    class PrefixRouter(RequestRouter):
        """Ray Serve request router for LiteEngine: prefix affinity (routing.choose_replica)
        or round-robin (the baseline)."""

        def initialize_state(
            self,
            policy: str = "prefix",
            max_imbalance: int = MAX_IMBALANCE,
            table_size: int = TABLE_SIZE,
        ) -> None:
            if policy not in POLICIES:
                raise ValueError(f"routing policy {policy!r}: expected one of {POLICIES}")
            self.policy = policy
            self.max_imbalance = max_imbalance
            self.table = PrefixTable(table_size)
            self.turn = 0
            self.routed: Counter[str] = Counter()  # reason -> requests
            self.lock = threading.Lock()  # the ingress (another thread) settles requests
            _home().register_router(self)
            log.info("router for %s: %s routing", self._deployment_id, policy)

        async def _loads(self, replicas: list) -> dict[str, int]:
            """Ongoing requests per replica: the handle's queue-length cache, probing the
            replicas it has no fresh figure for (as Ray's own routers do)."""
            loads, missing = {}, []
            for r in replicas:
                n = self.replica_queue_len_cache.get(r.replica_id)
                if n is None:
                    missing.append(r)
                else:
                    loads[r.replica_id.unique_id] = n
            if missing:
                for r, n in await self._probe_queue_lens(missing, 0):
                    loads[r.replica_id.unique_id] = r.max_ongoing_requests if n is None else n
            return loads

        async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None):
            """The policy's replica first, then the others by load (Ray Serve moves to the
            next rank when a replica's queue is full). The prefix is recorded for the chosen
            replica at once, so the next request of a burst already follows it; the ingress
            corrects the record (`settle`) if another replica ended up serving it."""
            if not candidate_replicas:
                return []
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            req = _home()._proxied(pending_request)
            if req is not None and req.pinned is not None:
                return [[by_id[req.pinned]]] if req.pinned in by_id else []
            loads = await self._loads(candidate_replicas)
            with self.lock:
                if self.policy == "round-robin":
                    chosen, reason = round_robin(self.turn, list(by_id)), "round_robin"
                    self.turn += 1
                else:
                    route = choose_replica(
                        req.prefix if req else [], self.table, loads, self.max_imbalance
                    )
                    chosen, reason = route.replica, route.reason
                    if req is not None and not req.internal:
                        self.table.record(req.prefix, chosen)
            if req is not None:
                req.route = (chosen, reason)
            rest = sorted((i for i in by_id if i != chosen), key=lambda i: (loads.get(i, 0), i))
            return [[by_id[chosen]], [by_id[i] for i in rest]]

        def settle(self, req: Any, replica: str) -> None:
            """The ingress saw `replica` answer `req`: count the decision, and move the prefix
            to that replica if the chosen one was full. (Ray Serve calls on_request_routed
            only when it enforces max_ongoing_requests strictly, so the ingress does this.)"""
            chosen, reason = req.route or (replica, "new")
            with self.lock:
                if chosen != replica:
                    reason = "full"  # the chosen replica's queue was full: the next rank took it
                    if self.policy == "prefix":
                        self.table.record(req.prefix, replica)
                self.routed[reason] += 1

        def update_replicas(self, replicas: list) -> None:
            before = {r.unique_id for r in self._replica_id_set}
            super().update_replicas(replicas)
            with self.lock:
                for gone in before - {r.unique_id for r in self._replica_id_set}:
                    self.table.forget(gone)

        def on_replica_actor_died(self, replica_id: Any) -> None:
            super().on_replica_actor_died(replica_id)
            with self.lock:
                self.table.forget(replica_id.unique_id)

    relay_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    def _error(status: int, message: str, type_: str) -> JSONResponse:
        return JSONResponse(error_body(message, type_, None, status), status_code=status)

    @relay_app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("relaying a request failed")
        return _error(500, f"internal error: {type(exc).__name__}", "internal_error")

    class _Relay(Response):
        """Send a replica's ASGI messages on as they come; cancel the replica's generator
        if the client leaves first. A stream whose replica dies, or that is still running
        when a stop's --grace runs out, ends with an error event and [DONE] in OpenAI's
        shape, as the single-process server ends it, not cut mid-stream."""

        def __init__(self, start: dict, stream: Any, ingress: Any) -> None:
            self.start, self.stream, self.background = start, stream, None
            self.ingress = ingress
            self.ended_by: str | None = None  # why the ingress cancelled the stream
            headers = dict(start.get("headers", []))
            self.sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")

        def end(self, message: str) -> None:
            """End the stream now (the stop's grace ran out), with `message` as its error."""
            self.ended_by = message
            self.stream.cancel()

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            finished = False
            try:
                await send(self.start)
                async for message in self.stream:
                    await send(message)
                finished = True
            except Exception as e:  # the replica died, or end() cancelled the stream
                if not self.sse:
                    raise  # a body cut short: nothing in OpenAI's shape can follow it
                reason = self.ended_by or f"the replica serving this request failed: {e}"
                log.warning("a stream ended early: %s", reason)
                error = error_body(reason, "service_unavailable", None, 503)
                await send(
                    {
                        "type": "http.response.body",
                        "body": (sse_event(error) + "data: [DONE]\n\n").encode(),
                        "more_body": False,
                    }
                )
            finally:
                self.ingress.relays.discard(self)
                if not finished:
                    self.stream.cancel()

    @serve.ingress(relay_app)
    class LiteIngress:
        def __init__(self, engine: Any, max_body_bytes: int = 4 * 2**20) -> None:
            self.engine = engine
            self.max_body_bytes = max_body_bytes
            self.app_name = serve.get_replica_context().app_name
            self.relays: set = set()  # the responses being relayed now
            self.pending = 0  # requests waiting for a replica's first message
            self.draining = False

        def _router(self) -> Any:
            return registered_router(self.app_name)

        async def drain(self, grace: float) -> int:
            """What a stop runs before Serve shuts down: refuse new requests, give those in
            flight `grace` seconds, then end the streams still running with an error event
            (Serve's shutdown would cut them mid-stream). Returns how many were ended."""
            self.draining = True
            deadline = asyncio.get_running_loop().time() + grace
            while (self.relays or self.pending) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
            left = list(self.relays)
            for relay in left:
                relay.end(f"the server is shutting down: not finished within --grace {grace:g} s")
            while self.relays and asyncio.get_running_loop().time() < deadline + 2:
                await asyncio.sleep(0.05)  # the error events on their way
            return len(left)

        @relay_app.get("/health")
        async def health(self, request: Request) -> Response:
            """Answered here when no replica can answer: with none running, a relayed probe
            waited in the router for as long as the prober would wait."""
            if self.draining:
                return _error(503, "not serving: shutting down", "service_unavailable")
            router = self._router()
            if router is not None and not router.curr_replicas:
                return _error(
                    503, "not serving: no engine replica is running", "service_unavailable"
                )
            try:
                return await asyncio.wait_for(
                    self._forward(_proxied_request(request)), HEALTH_TIMEOUT_S
                )
            except asyncio.TimeoutError:
                return _error(
                    503,
                    f"not serving: no engine replica answered within {HEALTH_TIMEOUT_S} s",
                    "service_unavailable",
                )

        @relay_app.get("/metrics")
        async def metrics(self) -> Response:
            if self._router() is None:  # the handle makes its router on its first call
                await self.engine.options(method_name="metrics_text").remote(
                    ProxiedRequest(internal=True)
                )
            router = self._router()
            replicas = sorted(r.unique_id for r in router.curr_replicas)
            # one at a time: Ray Serve gives the handle calls made while serving one request
            # the same internal id, and its router matches a routed replica to a waiting
            # call by that id, so concurrent pinned calls could be handed each other's replica
            per_replica = {}
            for r in replicas:
                call = self.engine.options(method_name="metrics_text").remote(
                    ProxiedRequest(pinned=r)
                )
                try:
                    per_replica[r] = await asyncio.wait_for(call, 5)
                except Exception as e:  # gone meanwhile: the others are still worth showing
                    log.warning("no metrics from replica %s: %s", r, e)
            with router.lock:
                routed = dict(router.routed)
            body = merge_metrics(per_replica, router.policy, routed)
            return Response(body, media_type=CONTENT_TYPE_LATEST)

        @relay_app.api_route(
            "/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
        )
        async def relay(self, path: str, request: Request) -> Response:
            buf = bytearray()
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > self.max_body_bytes:
                    return _error(
                        413,
                        f"request body over {self.max_body_bytes} bytes",
                        "invalid_request_error",
                    )
            body = bytes(buf)
            prefix: list = []
            if request.method == "POST" and body:
                with contextlib.suppress(ValueError, UnicodeDecodeError):
                    prefix = request_hashes(request.url.path, json.loads(body))
            return await self._forward(_proxied_request(request, body, prefix))

        async def _forward(self, req: ProxiedRequest) -> Response:
            if self.draining:
                return _error(503, "the server is shutting down", "service_unavailable")
            self.pending += 1
            try:
                for attempt in range(2):  # a replica that died before answering: once more
                    stream = self.engine.options(method_name="http", stream=True).remote(req)
                    try:
                        start = await stream.__anext__()
                    except asyncio.CancelledError:  # the client left, or /health's timeout
                        stream.cancel()
                        raise
                    except RayActorError as e:
                        if attempt:
                            return _error(
                                503,
                                f"no replica could take the request: {e}",
                                "service_unavailable",
                            )
                        log.warning("a replica died before answering; retrying once: %s", e)
                        continue
                    router = self._router()
                    if router is not None and req.route is not None:
                        served = dict(start.get("headers", [])).get(REPLICA_HEADER.encode(), b"")
                        router.settle(req, served.decode())
                    relay = _Relay(start, stream, self)
                    self.relays.add(relay)  # until its __call__ ends, however it ends
                    return relay
                raise AssertionError("unreachable")
            finally:
                self.pending -= 1

    for cls in (PrefixRouter, LiteIngress):
        cls.__module__ = __name__
    PrefixRouter.__qualname__ = PrefixRouter.__name__ = "PrefixRouter"
    LiteIngress.__qualname__ = LiteIngress.__name__ = "LiteIngress"
    _BUILT.update(PrefixRouter=PrefixRouter, LiteIngress=LiteIngress)


def merge_metrics(per_replica: dict[str, str], policy: str, routed: dict[str, int]) -> bytes:
    """Each replica's Prometheus text under one family per metric, every sample labelled with
    its replica; then the router's counts."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client import Counter as PCounter
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    for replica, text in sorted(per_replica.items()):
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(
                    fam.name, fam.documentation, fam.type, fam.unit
                )
            for s in fam.samples:
                merged.samples.append(
                    Sample(
                        s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar
                    )
                )

    class _Collected:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collected())
    counts = PCounter(
        "liteserve:router_requests",
        "Requests the ingress routed, by policy and reason (affinity: to the replica holding "
        "the prefix; new: unknown prefix, least loaded; overloaded: the prefix's replica was "
        "too busy, least loaded; full: the chosen replica's queue was full, the next one; "
        "round_robin: the baseline policy)",
        ["policy", "reason"],
        registry=registry,
    )
    for reason, n in routed.items():
        counts.labels(policy, reason).inc(n)
    return generate_latest(registry)


# ---- deploying ----


def engine_deployment(
    engine_kw: dict,
    *,
    replicas: int | None = None,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    target_ongoing_requests: float = 8,
    max_ongoing_requests: int = 64,
    routing: str = "prefix",
    routing_imbalance: int = MAX_IMBALANCE,
    replica_cpus: float = 1,
    replica_gpus: float | None = None,
    grace: float = 30.0,
) -> tuple[dict, dict]:
    """(Ray Serve options of the engine deployment, the replicas' engine keywords): a fixed
    replica count, or autoscaling between min and max replicas when either is given. Plain
    data, so it is tested without Ray; `request_router` names the router and its keywords."""
    if routing not in POLICIES:
        raise ValueError(f"routing={routing!r}: expected one of {POLICIES}")
    autoscaled = min_replicas is not None or max_replicas is not None
    if replicas is None:
        replicas = max(min_replicas or 1, 1) if autoscaled else 2
    if replicas < 1:
        raise ValueError(f"replicas={replicas}: expected at least 1")
    ranks = int(engine_kw.get("tp") or 1)  # each replica runs one process per TP rank
    if replica_gpus is None:
        device = str(engine_kw.get("device") or "auto")
        backend = str(engine_kw.get("backend") or "auto")
        on_gpu = device.startswith("cuda") or backend in ("triton", "cuda")
        if device == "auto" and backend == "auto":
            import torch

            on_gpu = torch.cuda.is_available()
        replica_gpus = float(ranks) if on_gpu else 0.0
    engine_kw = {k: v for k, v in engine_kw.items() if v is not None}
    most = max(replicas, max_replicas or 0)
    if not replica_gpus and engine_kw.get("num_blocks") is None and most > 1:
        # CPU replicas on one host would each size their KV pool from the same free RAM
        share = engine_kw.get("cache_max_entry_count", 0.8) / most
        log.warning("CPU replicas: each sizes its KV pool from 1/%d of free memory", most)
        engine_kw["cache_max_entry_count"] = share
    options: dict[str, Any] = dict(
        name=ENGINE,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": replica_cpus * ranks, "num_gpus": replica_gpus},
        request_router=(
            f"{__name__}.PrefixRouter",
            {"policy": routing, "max_imbalance": routing_imbalance},
        ),
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=grace,
    )
    if autoscaled:
        lo = min_replicas if min_replicas is not None else 1
        hi = max_replicas if max_replicas is not None else max(replicas, lo)
        if not 0 <= lo <= hi or hi < 1:
            raise ValueError(f"replica bounds {lo}..{hi}: expected 0 <= min <= max, max >= 1")
        options["autoscaling_config"] = {
            "min_replicas": lo,
            "max_replicas": hi,
            "initial_replicas": min(max(replicas, lo), hi),
            "target_ongoing_requests": target_ongoing_requests,
        }
    else:
        options["num_replicas"] = replicas
    return options, engine_kw


def build_application(
    artifact: str | Path,
    engine_kw: dict,
    model_name: str,
    *,
    api_keys: tuple[str, ...] = (),
    max_concurrent_requests: int = 256,
    max_body_bytes: int = 4 * 2**20,
    chat_template: str | Path | None = None,
    **deployment_kw: Any,
) -> Any:
    """The Ray Serve application: the ingress bound to the engine replicas
    (`engine_deployment`'s keywords choose how many)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    options, engine_kw = engine_deployment(engine_kw, **deployment_kw)
    router_class, router_kwargs = options.pop("request_router")
    options["request_router_config"] = RequestRouterConfig(
        request_router_class=router_class, request_router_kwargs=router_kwargs
    )
    engine = serve.deployment(EngineReplica).options(**options)
    ingress = serve.deployment(__getattr__("LiteIngress")).options(
        name=INGRESS, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024
    )
    return ingress.bind(
        engine.bind(
            str(artifact),
            engine_kw,
            model_name,
            tuple(api_keys),
            max_concurrent_requests,
            max_body_bytes,
            str(chat_template) if chat_template else None,
        ),
        max_body_bytes,
    )


def _init_ray(address: str | None) -> None:
    """Join the named cluster, or start one of this host alone: never one found in
    RAY_ADDRESS or /tmp/ray (its port was not ours, and stopping deleted its Serve apps), and
    with its control plane, which runs any code it is sent, not on every interface."""
    import ray

    if address is not None:
        ray.init(address=address)
    else:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False)


def start(
    application: Any,
    host: str = "127.0.0.1",
    port: int = 23333,
    ray_address: str | None = None,
    name: str = APP,
) -> None:
    """Connect to (or start) Ray, start Serve's HTTP proxy on host:port, deploy, and wait
    until every replica runs."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        _init_ray(ray_address)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application, name=name, route_prefix="/", blocking=False)


def served_name(artifact: str | Path, model_name: str | None) -> str:
    """The id clients pass as `model`: --model-name, else the artifact's directory name as
    given. Not the name a symbolic link points at: a `current -> v7` deploy link changed the
    id every client sends with each release."""
    return model_name or Path(os.path.abspath(artifact)).name


def serve_replicas(
    artifact: str | Path,
    engine_kw: dict,
    *,
    server_name: str = "127.0.0.1",
    server_port: int = 23333,
    ray_address: str | None = None,
    model_name: str | None = None,
    **app_kw: Any,
) -> None:
    """What `runtime serve --replicas N` runs: deploy, log where, serve until SIGINT or
    SIGTERM, then shut Serve down (the replicas drain and stop)."""
    if ray_address is None:  # Serve's proxy will bind here: a port in use fails now, not
        # after Ray's start-up and a hundred lines of its actors' tracebacks (about 25 s)
        try:
            listen_socket(server_name, server_port).close()
        except OSError as e:
            raise click.ClickException(str(e)) from e
    from runtime.artifact.reader import Artifact, ArtifactError

    try:  # bad input fails here, before Ray starts, not in every replica a minute later;
        # checksums too: a damaged shard was a minute of failing replicas and 360 log lines
        Artifact(artifact, checksums=engine_kw.get("verify_checksums", True))
    except ArtifactError as e:
        raise click.ClickException(str(e)) from e
    if not ray_available():
        raise click.ClickException(INSTALL_HINT)
    from ray import serve

    engine_kw = dict(engine_kw)
    if app_kw.get("routing", "prefix") == "prefix" and not engine_kw.get("enable_prefix_caching"):
        log.warning("prefix-affinity routing: turning on prefix caching in the replicas")
        engine_kw["enable_prefix_caching"] = True
    template = engine_kw.pop("chat_template", None)
    if template is not None:
        app_kw.setdefault("chat_template", template)
    name = served_name(artifact, model_name)
    try:
        application = build_application(artifact, engine_kw, name, **app_kw)
    except (ArtifactError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    start(application, server_name, server_port, ray_address)
    log.warning(
        "serving %s as %r on http://%s:%d: %s engine replicas on Ray Serve, %s routing",
        artifact,
        name,
        server_name,
        server_port,
        _replica_count(app_kw),
        app_kw.get("routing", "prefix"),
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1):
        pass
    grace = app_kw.get("grace", 30.0)
    if ray_address is None and not _local_ray_alive():
        log.warning(
            "stopping: Ray's own processes got the signal too and are gone, so nothing can "
            "drain (signal the command's PID alone, e.g. systemd's KillMode=mixed)"
        )
    else:
        log.warning("stopping: requests in flight get up to --grace %g s to finish", grace)
        drain(grace)
    log.warning("stopping: Serve shuts down")
    if ray_address is None:  # the local cluster this command started
        import ray

        serve.shutdown()
        ray.shutdown()
    else:  # a shared cluster: only this application goes; Serve and other apps stay
        serve.delete(APP)


def _local_ray_alive() -> bool:
    """Whether every process of the Ray cluster this command started still runs: a SIGTERM to
    the whole process group (systemd's default) stops them with the command, and a call to
    the ingress then waited a minute for a dead control plane before Ray aborted the process."""
    import time

    from ray._private import worker  # Ray's own handle on the processes it started

    alive = getattr(getattr(worker, "_global_node", None), "remaining_processes_alive", None)
    if alive is None:  # another Ray than the one this was written against: assume alive
        return True
    for _ in range(10):  # signalled with the command, they take a moment to exit
        if not alive():
            return False
        time.sleep(0.1)
    return True


def drain(grace: float, name: str = APP) -> None:
    """Let the ingress finish what is in flight before Serve goes (its shutdown cut the
    streams mid-event), saying how many it had to end."""
    from ray import serve

    try:
        handle = serve.get_app_handle(name)
        ended = handle.options(method_name="drain").remote(grace).result(timeout_s=grace + 30)
    except Exception as e:  # the stop goes on: a drain that failed cuts what is left
        log.warning("stopping: the ingress could not drain: %s", e)
        return
    if ended:
        log.warning("stopping: %d requests not finished within --grace were ended", ended)


def _replica_count(app_kw: dict) -> str:
    lo, hi = app_kw.get("min_replicas"), app_kw.get("max_replicas")
    if lo is None and hi is None:
        return str(app_kw.get("replicas") or 2)
    return f"{lo if lo is not None else 1}..{hi if hi is not None else '?'} (autoscaled)"


# ---- the CLI's options ----


def replica_options(f: Callable) -> Callable:
    """The `runtime serve` options for replicas on Ray Serve (see docs/scale-out.md)."""
    for opt in reversed(
        [
            click.option(
                "--replicas",
                type=click.IntRange(min=1),
                help="Serve with N engine replicas on Ray Serve behind one ingress, routed by "
                "prefix affinity (needs pip install liteserve[cluster]). Default: one process.",
            ),
            click.option(
                "--ray-address",
                help="The Ray cluster to join (e.g. 10.0.0.1:6379 or auto); default: start a "
                "local one.",
            ),
            click.option(
                "--min-replicas",
                type=click.IntRange(min=0),
                help="Autoscale: at least this many replicas.",
            ),
            click.option(
                "--max-replicas",
                type=click.IntRange(min=1),
                help="Autoscale: at most this many replicas.",
            ),
            click.option(
                "--target-ongoing-requests",
                type=float,
                default=8,
                show_default=True,
                help="Autoscale: ongoing requests per replica that Ray Serve aims for.",
            ),
            click.option(
                "--max-ongoing-requests",
                type=click.IntRange(min=1),
                default=64,
                show_default=True,
                help="Requests one replica takes at once; beyond, they wait in the router.",
            ),
            click.option(
                "--routing",
                type=click.Choice(POLICIES),
                default="prefix",
                show_default=True,
                help="prefix: a prompt goes to the replica that served its first blocks "
                "unless it is overloaded; round-robin: the baseline.",
            ),
            click.option(
                "--routing-imbalance",
                type=click.IntRange(min=0),
                default=MAX_IMBALANCE,
                show_default=True,
                help="A replica is overloaded when its ongoing requests exceed the least "
                "loaded replica's by more than this.",
            ),
            click.option(
                "--replica-cpus",
                type=float,
                default=1,
                show_default=True,
                help="CPUs Ray reserves per replica and TP rank (on a GPU host each replica "
                "also takes one GPU per TP rank).",
            ),
        ]
    ):
        f = opt(f)
    return f


REPLICA_KEYS = (
    "replicas",
    "ray_address",
    "min_replicas",
    "max_replicas",
    "target_ongoing_requests",
    "max_ongoing_requests",
    "routing",
    "routing_imbalance",
    "replica_cpus",
)


def pop_replica_options(kw: dict) -> dict:
    """Take replica_options' values out of a command's keyword arguments."""
    return {k: kw.pop(k) for k in REPLICA_KEYS if k in kw}


def wants_replicas(options: dict) -> bool:
    """Whether the popped options ask for Ray Serve (--replicas or autoscaling bounds)."""
    return any(options.get(k) is not None for k in ("replicas", "min_replicas", "max_replicas"))


def refuse_stray_replica_options(ctx: click.Context, options: dict) -> None:
    """A replica option given on a one-process `serve` would be ignored: refuse it, naming
    the flag that turns replicas on."""
    if wants_replicas(options):
        return
    given = [
        "--" + k.replace("_", "-")
        for k in REPLICA_KEYS
        if ctx.get_parameter_source(k) not in (None, click.core.ParameterSource.DEFAULT)
    ]
    if given:
        raise click.UsageError(
            f"{', '.join(given)} {'only apply' if len(given) > 1 else 'only applies'} to "
            "replicas on Ray Serve: add --replicas N "
            "(or --min-replicas/--max-replicas), or leave them out"
        )


# ---- python -m runtime.server.cluster ----


def _main() -> None:
    from runtime.cli import _engine_options

    @click.command()
    @click.argument("artifact", type=click.Path(path_type=Path))
    @click.option("--server-name", default="127.0.0.1", show_default=True)
    @click.option("--server-port", default=23333, show_default=True)
    @click.option("--model-name")
    @click.option("--api-keys")
    @click.option("--max-batch-size", type=int)
    @click.option("--max-prefill-token-num", type=int)
    @replica_options
    @_engine_options
    def command(
        artifact: Path,
        server_name: str,
        server_port: int,
        model_name: str | None,
        api_keys: str | None,
        **kw: Any,
    ) -> None:
        """Serve ARTIFACT with engine replicas on Ray Serve (what `runtime serve --replicas`
        does)."""
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
        app_kw = pop_replica_options(kw)
        app_kw["replicas"] = app_kw.get("replicas") or 2
        serve_replicas(
            artifact,
            kw,
            server_name=server_name,
            server_port=server_port,
            ray_address=app_kw.pop("ray_address"),
            model_name=model_name,
            api_keys=tuple(k.strip() for k in (api_keys or "").split(",") if k.strip()),
            **app_kw,
        )

    command()


if __name__ == "__main__":
    _main()
