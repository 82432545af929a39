"""The engine start-up hook for graphs: capture every shape, verify each, install for serving."""

from __future__ import annotations

from typing import TYPE_CHECKING

from warmcap.graphs.startup import GraphStartup, capture_graphs

if TYPE_CHECKING:
    from warmcap.engine import LLMEngine


def graph_capture_hook(
    engine: LLMEngine,
    *,
    backend: str | None = None,
    capture_sizes: list[int] | None = None,
    verify: bool = True,
) -> GraphStartup | None:
    """Capture the engine runner's graphs (``cuda`` on a GPU, ``static`` elsewhere) after warmup;
    nothing when the config says ``enforce_eager``."""
    if engine.config.model.enforce_eager:
        return None
    startup = capture_graphs(
        engine.runner, engine.kv_cache_manager, backend=backend, capture_sizes=capture_sizes, verify=verify
    )
    engine.graph_startup = startup
    return startup
