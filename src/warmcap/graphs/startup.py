"""Start-up entry point: capture (target, then drafter graphs), verify, attach the graph runner
to the model runner, and describe it for the report."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from warmcap.graphs.capture import CaptureResult, GraphCapturer
from warmcap.graphs.graph_runner import GraphRunner
from warmcap.graphs.report import (
    CaptureReport,
    GraphRecord,
    RankRow,
    SpecDecodeStats,
    SpecInfo,
    WarmupAudit,
)
from warmcap.graphs.verify import GraphCheck, verify_graphs
from warmcap.models.batch_invariant import is_batch_invariant

if TYPE_CHECKING:
    from warmcap.core.kv_cache_manager import KVCacheManager
    from warmcap.runner_v2.model_runner import ModelRunner


def default_backend(runner: ModelRunner) -> str:
    """``cuda`` when the runner is on a CUDA device (and CUDA works), else ``static``."""
    return "cuda" if runner.device.type == "cuda" and torch.cuda.is_available() else "static"


@dataclass(slots=True)
class GraphStartup:
    """What graph start-up produced: the attached graph runner, records for the report, timings."""

    backend: str
    capturer: GraphCapturer
    graph_runner: GraphRunner
    result: CaptureResult
    checks: list[GraphCheck]
    capture_seconds: float
    verify_seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def records(self) -> list[GraphRecord]:
        """One report record per graph, in capture order (largest first)."""
        checks = {c.label: c for c in self.checks}
        out = []
        for g in self.result.graphs:
            d = g.spec.descriptor
            check = checks.get(g.spec.label)
            out.append(
                GraphRecord(
                    phase=g.spec.phase,  # type: ignore[arg-type]
                    mode=d.mode.value,
                    num_tokens=d.num_tokens,
                    num_reqs=d.num_reqs,
                    uniform_query_len=d.uniform_query_len,
                    capture_seconds=g.capture_seconds,
                    memory_bytes=g.memory_bytes,
                    verified=check.verified if check else False,
                    max_abs_diff=check.max_abs_diff if check else None,
                    real_rows_max_abs_diff=check.real_rows_max_abs_diff if check else None,
                    greedy_match=check.greedy_match if check else None,
                    cuda_safe=g.safety.safe if g.safety else None,
                    cuda_unsafe_reason=g.safety.reason if g.safety and not g.safety.safe else "",
                )
            )
        return out

    def report(
        self,
        *,
        model: str,
        device: str,
        spec: SpecInfo | None = None,
        warmup_audit: WarmupAudit | None = None,
        spec_decode: SpecDecodeStats | None = None,
        timings: dict[str, float | None] | None = None,
        ranks: list[RankRow] | None = None,
    ) -> CaptureReport:
        """The capture report, with capture/verify timings filled in."""
        all_timings = dict(timings or {})
        all_timings.setdefault("capture", self.capture_seconds)
        all_timings.setdefault("verify", self.verify_seconds)
        return CaptureReport(
            model=model,
            device=device,
            backend=self.backend,  # type: ignore[arg-type]
            spec=spec or SpecInfo(),
            capture_sizes=list(self.result.plan.capture_sizes),
            graphs=self.records,
            warmup_audit=warmup_audit or WarmupAudit(),
            spec_decode=spec_decode or SpecDecodeStats(),
            timings=all_timings,
            notes=list(self.notes),
            batch_invariant=is_batch_invariant(self.capturer.runner.model),
            ranks=list(ranks or []),
        )


def _silent(*args: object, **kwargs: object) -> None:
    """Progress reporting when nobody listens."""


def capture_graphs(
    runner: ModelRunner,
    kv_cache_manager: KVCacheManager,
    *,
    backend: str | None = None,
    capture_sizes: list[int] | None = None,
    verify: bool = True,
    report: Callable[..., None] | None = None,
) -> GraphStartup:
    """Capture the runner's target and drafter graphs, verify each (I4), and attach them for
    serving (``runner.attach_graphs``). ``report`` is
    :meth:`~warmcap.startup_hooks.StartupContext.report` (start-up progress) or None."""
    say = report or _silent
    chosen = backend or default_backend(runner)
    capturer = GraphCapturer(runner, chosen, capture_sizes=capture_sizes)
    start = time.perf_counter()
    say("graph_capture", f"backend {chosen}: eager pass over every shape")
    result = capturer.capture(
        on_graph=lambda done, total, label: say("graph_capture", f"captured {label}", done=done, total=total)
    )
    captured = time.perf_counter()
    checks: list[GraphCheck] = []
    if verify:
        say("graph_verify", "replay vs eager", done=0, total=len(result.graphs))
        checks = verify_graphs(
            capturer,
            result.graphs,
            kv_cache_manager,
            on_check=lambda done, total, check: say(
                "graph_verify",
                f"{check.label}: {'verified' if check.verified else 'NOT verified'}",
                done=done,
                total=total,
            ),
        )
    verified = time.perf_counter()
    if verify:
        ok = sum(c.verified for c in checks)
        say("graph_verify", f"{ok}/{len(checks)} verified", finished=True, seconds=verified - captured)
    graph_runner = GraphRunner(capturer.subjects, result.graphs)
    runner.attach_graphs(graph_runner)
    notes = list(result.notes)
    notes += [f"{c.label}: not verified ({c.reason})" for c in checks if c.reason]
    return GraphStartup(
        chosen, capturer, graph_runner, result, checks, captured - start, verified - captured, notes
    )
