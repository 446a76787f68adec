"""Wiring: a loaded pipeline into an app whose lifespan runs the engine thread, and the
uvicorn server that drains it."""

from __future__ import annotations

import asyncio
import logging
import socket
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from runtime.api import Pipeline
from runtime.server.app import ServerSettings, create_app
from runtime.server.async_engine import AsyncEngine
from runtime.server.metrics import Metrics

log = logging.getLogger("liteserve")


def build_app(
    pipe: Pipeline,
    model_name: str,
    api_keys: tuple[str, ...] = (),
    max_concurrent_requests: int = 256,
    max_body_bytes: int = 4 * 2**20,
) -> FastAPI:
    engine = AsyncEngine(pipe.engine, Metrics())
    settings = ServerSettings(
        model_name, api_keys, max_concurrent_requests, max_body_bytes, pipe.chat_template
    )
    app = create_app(engine, settings, pipe.message_text)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        app.state.liteserve.draining = True
        engine.stop()

    app.router.lifespan_context = lifespan
    return app


FORCED_WRITE_S = 0.2  # what a forced exit leaves the handlers to write their 503s


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGTERM) closes the listening socket at once and
    gives requests in flight --grace seconds (timeout_graceful_shutdown) to finish. Those
    still running shortly before the end are ended by the engine, in OpenAI's error shape: a
    503 `service_unavailable`, or a stream's error event and [DONE]. Left to uvicorn they
    would be cancelled mid-write: a plain-text 500, a stream cut without its end."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = self.config.app.state.liteserve
        state.draining = True
        grace = self.config.timeout_graceful_shutdown
        # said, as `--replicas` says it: the exit can come seconds after --grace, when the
        # engine's step in flight (a long CPU prefill) must end before the engine stops
        log.warning(
            "stopping: %d requests in flight get up to --grace %s s to finish",
            state.in_flight,
            "unlimited" if grace is None else f"{grace:g}",
        )
        timer = None
        if grace is not None:
            message = f"the server is shutting down: not finished within --grace {grace:g} s"
            at = grace - min(1.0, grace / 2)  # time left for the errors to reach the clients
            timer = asyncio.get_running_loop().call_later(at, state.engine.fail_in_flight, message)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()
        if self.force_exit:
            # a second Ctrl-C: no grace, but the error shape still, not streams cut mid-event;
            # and the engine stopped after its step, which uvicorn's forced exit skips (its
            # lifespan task was then cancelled with a traceback)
            if state.engine.closing is None:
                state.engine.fail_in_flight("the server was stopped (a second Ctrl-C)")
                await asyncio.sleep(FORCED_WRITE_S)
            await self.lifespan.shutdown()
