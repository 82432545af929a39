"""Run the app under uvicorn until SIGINT/SIGTERM, or until start-up fails."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import uvicorn

from warmcap import env
from warmcap.assembly import resolve_device
from warmcap.errors import ConfigError
from warmcap.serve.app import ServeOptions, build_app
from warmcap.serve.engine_loop import StartFailure
from warmcap.serve.uvicorn_server import QuietExitServer

if TYPE_CHECKING:
    from fastapi import FastAPI

    from warmcap.config import EngineConfig


class _Server(QuietExitServer):
    """uvicorn, but a shutdown signal first ends in-flight requests (with an error) through the
    engine loop; plain uvicorn would wait for every stream to finish on its own."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._app.state.warmcap.loop.shutdown("the server is shutting down (signal received)")
        super().handle_exit(sig, frame)


def serving_model_threads(device: str, requested: int | None) -> int | None:
    """Intra-op threads the model gets while serving on CPU: ``requested``, or else (with no
    ``OMP_NUM_THREADS`` set) one for every core this process may use. None: leave torch's setting
    alone (a GPU, or the environment chose).

    The HTTP side (the event loop, detokenisation, streaming) shares the process and its cores with
    the model threads and pre-empts one of them now and then; on two cores a second model thread
    still serves more at every client level (vLLM's benchmark client at 1, 8 and 32 clients: 1.33x,
    1.77x and 1.75x one thread's output rate, BENCHMARKS.md, "vLLM as the peer again on AVX2").
    vLLM's CPU build likewise binds an OpenMP thread to every core of its node with one rank, and
    keeps a core back only with several ranks.
    """
    if requested is not None:
        if requested < 1:
            raise ConfigError(
                f"--model-threads {requested} must be at least 1 (or left unset for one per core)"
            )
        return requested
    if resolve_device(device).type != "cpu":
        return None
    if env.is_set("OMP_NUM_THREADS"):
        return None
    return len(os.sched_getaffinity(0))


class _StderrHandler(logging.StreamHandler):
    """A log handler writing to whatever ``sys.stderr`` is when a record is emitted: one process
    may serve several times (tests, an embedding app) with ``sys.stderr`` swapped in between, and a
    handler that kept the first stream would write into a closed file."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys.stderr


def serve(
    config: EngineConfig, options: ServeOptions, *, host: str, port: int, model_threads: int | None = None
) -> StartFailure | None:
    """Serve until a signal (returns None) or a failed start-up (returns why).
    ``model_threads``: see :func:`serving_model_threads`."""
    threads = serving_model_threads(config.model.device, model_threads)
    if threads is not None:
        torch.set_num_threads(threads)
    failure: list[StartFailure] = []
    server: _Server | None = None

    def on_failure(reason: StartFailure) -> None:
        failure.append(reason)
        if server is not None:
            server.should_exit = True

    app = build_app(config, replace(options, on_failure=on_failure))
    server = _Server(
        uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=10), app
    )
    log = logging.getLogger("warmcap.serve")
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.info("model threads: %d of %d cores", torch.get_num_threads(), len(os.sched_getaffinity(0)))
    server.run()
    return failure[0] if failure else None
