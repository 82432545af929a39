"""Run the app under uvicorn until SIGINT/SIGTERM, or until start-up fails."""

from __future__ import annotations

import logging
import signal
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from warmcap.serve.app import ServeOptions, build_app

if TYPE_CHECKING:
    from fastapi import FastAPI

    from warmcap.config import EngineConfig


class _Server(uvicorn.Server):
    """uvicorn, but a shutdown signal first ends in-flight requests (with an error) through the
    engine loop; plain uvicorn would wait for every stream to finish on its own."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._app.state.warmcap.loop.shutdown("the server is shutting down (signal received)")
        # NOTE: uvicorn's own handler records the signal and raises it again after shutdown, so the
        # process would die of it; a handled signal here means a clean exit 0.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def serve(config: EngineConfig, options: ServeOptions, *, host: str, port: int) -> str | None:
    """Serve until a signal (returns None) or a failed start-up (returns the reason)."""
    failure: list[str] = []
    server: _Server | None = None

    def on_failure(reason: str) -> None:
        failure.append(reason)
        if server is not None:
            server.should_exit = True

    app = build_app(config, replace(options, on_failure=on_failure))
    server = _Server(
        uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=10), app
    )
    log = logging.getLogger("warmcap.serve")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    server.run()
    return failure[0] if failure else None
