"""Wiring: a loaded pipeline into an app whose lifespan runs the engine thread."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from runtime.api import Pipeline
from runtime.server.app import ServerSettings, create_app
from runtime.server.async_engine import AsyncEngine
from runtime.server.metrics import Metrics


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
    app = create_app(engine, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        app.state.liteserve.draining = True
        engine.stop()

    app.router.lifespan_context = lifespan
    return app
