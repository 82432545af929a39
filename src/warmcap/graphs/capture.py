"""Graph capture over the runner's static buffers: ``cuda`` records, ``static`` and ``compile`` don't.

Order (DESIGN.md, Graphs): one eager pass over every shape first, then capture largest first into
one shared memory pool. Capture inputs are benign all-padding batches (every slot PAD, every row
``seq_len`` 0), so capture writes nothing but the sink block.

Backends:
- ``cuda``: ``torch.cuda.CUDAGraph`` per shape, one ``graph_pool_handle()`` pool; needs
  ``torch.cuda.is_available()`` and a runner on a CUDA device.
- ``static``: the same code path over the same static buffers without recording; replay runs the
  eager forward on the static buffers and copies into the graph's static output. It proves the
  padding and buffer handling on any machine, not CUDA-graph speed.
- ``compile``: ``torch.compile`` of the forward per shape over the static buffers (no graph).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from warmcap.errors import ConfigError
from warmcap.graphs.planning import GraphPlan, GraphSpec, plan_target_graphs
from warmcap.graphs.static_inputs import empty_step, ensure_spare_row, graph_metadata, load_padded

if TYPE_CHECKING:
    from warmcap.runner_v2.attention.base import AttentionMetadata
    from warmcap.runner_v2.model_runner import ModelRunner

GRAPH_BACKENDS: tuple[str, ...] = ("cuda", "static", "compile")


@dataclass(slots=True)
class CapturedGraph:
    """One captured shape: its static metadata and output, and how to replay it."""

    spec: GraphSpec
    metas: dict[str, AttentionMetadata]
    output: torch.Tensor
    replay_fn: Callable[[], None]
    capture_seconds: float = 0.0
    memory_bytes: int = 0


@dataclass(slots=True)
class CaptureResult:
    """Every captured graph (largest first), the plan, and the order things ran in."""

    plan: GraphPlan
    graphs: list[CapturedGraph]
    #: ``("eager" | "capture", label)`` in the order they ran
    order: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class GraphCapturer:
    """Captures the target graphs of ``runner`` with one backend."""

    def __init__(self, runner: ModelRunner, backend: str = "cuda", *, capture_sizes: list[int] | None = None):
        if backend not in GRAPH_BACKENDS:
            raise ConfigError(f"unknown graph backend {backend!r}: use one of {', '.join(GRAPH_BACKENDS)}")
        if backend == "cuda" and not (torch.cuda.is_available() and runner.device.type == "cuda"):
            raise ConfigError(
                "graph backend 'cuda' needs a CUDA device and a runner on it; "
                f"runner is on {runner.device}: use backend 'static' on this machine"
            )
        self.runner = runner
        self.backend = backend
        self.plan = plan_target_graphs(runner, capture_sizes=capture_sizes)
        ensure_spare_row(runner)
        self._pool: Any = torch.cuda.graph_pool_handle() if backend == "cuda" else None

    def load(self, spec: GraphSpec, step: Any | None = None) -> None:
        """Fill the static buffers with ``step`` (default: all padding) in ``spec``'s shape."""
        buffers = self.runner.buffers
        load_padded(buffers, step if step is not None else empty_step(buffers), spec)

    def eager(self, spec: GraphSpec, metas: dict[str, AttentionMetadata]) -> torch.Tensor:
        """The eager forward over the loaded static buffers with ``spec``'s fixed metadata."""
        return self.runner.forward_batch(spec.num_tokens, metas)

    @torch.inference_mode()
    def capture(self) -> CaptureResult:
        """Eager pass over every shape, then capture largest first."""
        result = CaptureResult(self.plan, [], notes=list(self.plan.notes))
        runner = self.runner
        specs = self.plan.specs
        for spec in specs:
            self.load(spec)
            self.eager(spec, graph_metadata(runner.buffers, spec, runner.max_model_len))
            result.order.append(("eager", spec.label))
        self._sync()
        largest_first = sorted(specs, key=lambda s: (s.num_tokens, s.rows), reverse=True)
        for spec in largest_first:
            result.graphs.append(self._capture_one(spec))
            result.order.append(("capture", spec.label))
        shapes = getattr(runner.drafter, "graph_shapes", None)
        if shapes is not None and shapes():
            result.notes.append(
                f"drafter graphs not captured: {type(runner.drafter).__name__} has no graph-capture seam, "
                "so its passes run eagerly"
            )
        return result

    def _capture_one(self, spec: GraphSpec) -> CapturedGraph:
        runner = self.runner
        self.load(spec)
        metas = graph_metadata(runner.buffers, spec, runner.max_model_len)
        backend = runner.attn_backend
        self._sync()
        start = time.perf_counter()
        if self.backend == "cuda":
            free_before = torch.cuda.mem_get_info(runner.device)[0]
            graph = torch.cuda.CUDAGraph()
            backend.prepare_for_capture(metas)
            with torch.cuda.graph(graph, pool=self._pool):
                output = self.eager(spec, metas)
            self._sync()
            memory = max(0, free_before - torch.cuda.mem_get_info(runner.device)[0])

            def replay() -> None:
                backend.prepare_for_replay(metas)
                graph.replay()

        else:
            forward = self._compiled(spec, metas) if self.backend == "compile" else None
            backend.prepare_for_capture(metas)
            output = forward() if forward is not None else self.eager(spec, metas)
            memory = output.numel() * output.element_size()

            def replay() -> None:
                backend.prepare_for_replay(metas)
                output.copy_(forward() if forward is not None else self.eager(spec, metas))

        seconds = time.perf_counter() - start
        return CapturedGraph(spec, metas, output, replay, seconds, memory)

    def _compiled(self, spec: GraphSpec, metas: dict[str, AttentionMetadata]) -> Callable[[], torch.Tensor]:
        return torch.compile(lambda: self.eager(spec, metas), dynamic=False, fullgraph=False)

    def _sync(self) -> None:
        if self.backend == "cuda":
            torch.cuda.synchronize(self.runner.device)
