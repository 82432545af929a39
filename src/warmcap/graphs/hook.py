"""The graph start-up hook: capture every shape, verify each, attach them to the runner."""

from __future__ import annotations

from typing import TYPE_CHECKING

from warmcap.graphs.proof.startup_cache import startup_cache_dir
from warmcap.graphs.startup import GraphStartup, capture_graphs

if TYPE_CHECKING:
    from warmcap.startup_hooks import StartupContext


def graph_capture_hook(
    ctx: StartupContext,
    *,
    backend: str | None = None,
    capture_sizes: list[int] | None = None,
    verify: bool = True,
    startup_cache: bool = False,
    record_cpu_graphs: bool = True,
    graph_shapes: str = "all",
) -> GraphStartup | None:
    """Capture the runner's graphs (``cuda`` on a GPU, ``static`` elsewhere) after warmup; None
    when the config says ``enforce_eager``. The engine keeps the result as
    ``startup_results["graph_capture"]``. ``startup_cache``: reuse and record verdicts in the
    start-up cache (:mod:`warmcap.graphs.proof.startup_cache`). ``record_cpu_graphs``: ``static``
    graphs on CPU replay recordings where they can (:mod:`warmcap.graphs.capture.cpu_program`).
    ``graph_shapes``: a decode graph per request count (``every``) or at the capture sizes."""
    if ctx.config.model.enforce_eager:
        return None
    from warmcap.models.presets import resolve_model_path

    return capture_graphs(
        ctx.runner,
        ctx.kv_cache_manager,
        backend=backend,
        capture_sizes=capture_sizes,
        verify=verify,
        report=ctx.report,
        startup_cache=startup_cache_dir() if startup_cache else None,
        model_dir=resolve_model_path(ctx.config.model.model) if startup_cache else None,
        record_cpu_graphs=record_cpu_graphs,
        graph_shapes=graph_shapes,
    )
