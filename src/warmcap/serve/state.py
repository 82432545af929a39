"""What the server's handlers share (``app.state.warmcap``): the engine loop, the metrics and the
served model's name, with the checks every route makes first."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from warmcap.serve.engine_loop import EngineLoop, State
from warmcap.serve.errors import APIError
from warmcap.serve.metrics import ServingMetrics


@dataclass(slots=True)
class ServerState:
    """What handlers share: the engine loop, metrics and the served model's name."""

    loop: EngineLoop
    metrics: ServingMetrics
    model_name: str
    #: the HTTP side's copy of the engine's tokenizer (``serve/model_api.py``; None until first used)
    tokenizer: Any = None
    tokenizer_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def max_model_len(self) -> int:
        return self.loop.engine.config.max_model_len

    def check_ready(self) -> None:
        if self.loop.state is not State.READY:
            raise APIError(503, not_ready(self.loop), "engine_unavailable")

    def check_model(self, name: str) -> None:
        """404 for a model this server does not serve, as vLLM's server answers (``NotFoundError``
        in the ``openai`` client)."""
        if name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist here; this server serves {self.model_name!r}",
                "model_not_found",
                "model",
            )


def not_ready(loop: EngineLoop) -> str:
    """Why ``loop`` cannot serve now (the 503 message)."""
    if loop.state is State.FAILED:
        return f"start-up failed: {loop.failure}"
    if loop.state is State.STOPPED:
        return "the server is shutting down"
    return "the engine is still starting (warmup, audit, graph capture); retry when GET /health is 200"
