"""The FastAPI app: built from an engine config without binding a port.

The engine starts (audited start-up, then the step loop) when the app's lifespan starts, so
``/health`` answers 503 while start-up runs and 200 once the engine serves.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from warmcap import __version__
from warmcap.config import StartupOptions
from warmcap.serve.engine_loop import EngineLoop, StartFailure, State
from warmcap.serve.errors import error_response, install_error_handlers
from warmcap.serve.metrics import ServingMetrics
from warmcap.serve.model_api import router as model_router
from warmcap.serve.openai_api import router
from warmcap.serve.startup_facts import StartedEngine, start_engine
from warmcap.serve.state import ServerState, not_ready

if TYPE_CHECKING:
    from warmcap.config import EngineConfig


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """Server settings beyond the engine config."""

    #: clients must send ``Authorization: Bearer <api_key>`` to ``/v1/*`` (None: no check)
    api_key: str | None = None
    #: how start-up proves the engine, with ``warmup run``'s and ``LLM``'s defaults (``--no-audit``:
    #: ``GET /startup`` says the audit was off; ``audit_serving``: a stray write fails that step)
    startup: StartupOptions = field(default_factory=StartupOptions)
    #: called from the engine thread with why when start-up fails or is refused
    on_failure: Callable[[StartFailure], None] | None = field(default=None, compare=False)
    #: seconds the lifespan waits for the engine thread at shutdown
    shutdown_timeout: float = 30.0
    #: fill every free KV block with a poison value once start-up is done (a debugging check, ``serve/poison.py``)
    poison_free_kv: bool = False


def build_app(
    config: EngineConfig,
    options: ServeOptions | None = None,
    *,
    start: Callable[[], StartedEngine] | None = None,
) -> FastAPI:
    """An OpenAI-compatible app over one engine. ``start`` replaces the audited start-up (tests use
    it to hold start-up back or to fail it)."""
    opts = options or ServeOptions()
    spec = config.speculative
    k = spec.num_speculative_tokens if spec is not None else 0
    model_name = config.model.model
    loop: EngineLoop
    metrics = ServingMetrics(model_name, lambda: loop.spec_metrics(), k, lambda: loop.serving_audit_counts())
    starter = start or partial(start_engine, config, opts.startup)
    if opts.poison_free_kv:
        starter = partial(_poisoned, starter)
    loop = EngineLoop(starter, metrics, num_spec_positions=k, on_failure=opts.on_failure)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            loop.shutdown()
            loop.join(opts.shutdown_timeout)

    app = FastAPI(title="warmcap", version=__version__, lifespan=lifespan)
    app.state.warmcap = ServerState(loop, metrics, model_name)
    install_error_handlers(app)
    if opts.api_key is not None:
        app.add_middleware(_BearerAuth, api_key=opts.api_key)
    app.include_router(router)
    app.include_router(model_router)

    @app.get("/health")
    async def health() -> Response:
        if loop.state is State.READY:
            return Response(status_code=200)
        return error_response(503, not_ready(loop), "engine_unavailable")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/startup")
    async def startup_report() -> Response:
        if loop.started is None:
            return error_response(503, not_ready(loop), "engine_unavailable")
        # The start-up report, plus the serving audit's counts so far (null: --audit-serving off).
        report = json.loads(loop.started.report_json)
        counts = loop.serving_audit_counts()
        report["serving_audit"] = None if counts is None else counts.to_json()
        return JSONResponse(report)

    return app


def _poisoned(start: Callable[[], StartedEngine]) -> StartedEngine:
    from warmcap.serve.poison import poison_free_blocks

    started = start()
    poison_free_blocks(started.engine)
    return started


class _BearerAuth:
    """``/v1/*`` needs the API key as a bearer token; health, metrics and version stay open.

    NOTE: plain ASGI rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware``
    wraps ``receive``, and handlers read the client's disconnect from it (``openai_api._Run``).
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                seen = "no bearer token" if not token else "a wrong bearer token"
                response = error_response(
                    401,
                    f"invalid API key: sent {seen}; send 'Authorization: Bearer <key>' with the server's --api-key",
                    "invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
