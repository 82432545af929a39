"""Start-up entry point: capture (:mod:`warmcap.graphs.capture`: target, then drafter graphs), prove
(:mod:`warmcap.graphs.proof`: the CUDA-safety check, verification, the start-up cache), attach the
graph runner to the model runner, and describe it all for the report. The one module that sees
both halves."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from warmcap.graphs.capture.capturer import CapturedGraph, CaptureResult, GraphCapturer, default_backend_for
from warmcap.graphs.capture.graph_runner import GraphRunner
from warmcap.graphs.proof.report import (
    CaptureReport,
    GraphRecord,
    RankRow,
    SpecDecodeStats,
    SpecInfo,
    StartupCacheUse,
    WarmupAudit,
)
from warmcap.graphs.proof.safety import GraphSafety, phase_safety
from warmcap.graphs.proof.startup_cache import (
    CachedCheck,
    StartupCache,
    StartupKey,
    enable_compile_cache,
    same_verdict,
)
from warmcap.graphs.proof.verify import GraphCheck, verify_graphs
from warmcap.models.batch_invariant import is_batch_invariant

if TYPE_CHECKING:
    from pathlib import Path

    from warmcap.core.kv_cache_manager import KVCacheManager
    from warmcap.runner_v2.model_runner import ModelRunner

log = logging.getLogger("warmcap.startup")


def default_backend(runner: ModelRunner) -> str:
    """``cuda`` when the runner is on a CUDA device (and CUDA works), else ``static``."""
    return default_backend_for(runner.device)


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
    #: labels of graphs whose verification was taken from the start-up cache, not run
    cached_checks: set[str] = field(default_factory=set)
    #: the start-up cache entry this start read and wrote (None: cache off)
    startup_cache: StartupCache | None = None
    #: CUDA-safety verdicts (``static`` / ``compile``) by the label of the graph that stands for
    #: its phase (the largest); no entry: not checked
    safety: dict[str, GraphSafety] = field(default_factory=dict)
    #: labels whose ``safety`` came from the start-up cache, not a trace in this run
    cached_safety: set[str] = field(default_factory=set)
    #: the spot check found the cache entry stale: every graph was verified in this run
    stale: bool = False

    @property
    def records(self) -> list[GraphRecord]:
        """One report record per graph, in capture order (largest first)."""
        checks = {c.label: c for c in self.checks}
        out = []
        for g in self.result.graphs:
            d = g.spec.descriptor
            check = checks.get(g.spec.label)
            safety = self.safety.get(g.spec.label)
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
                    cuda_safe=safety.safe if safety else None,
                    cuda_unsafe_reason=safety.reason if safety and not safety.safe else "",
                    verified_source="cache" if g.spec.label in self.cached_checks else "run",
                    cuda_safe_source="cache" if g.spec.label in self.cached_safety else "run",
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
            startup_cache=self.cache_use,
        )

    @property
    def cache_use(self) -> StartupCacheUse:
        """What the start-up cache gave this start (I4: which verdicts were not checked in it)."""
        cache = self.startup_cache
        if cache is None:
            return StartupCacheUse(enabled=False)
        records = self.records
        return StartupCacheUse(
            enabled=True,
            entry=str(cache.path),
            weights_digest=cache.key.parts["weights"],
            verified_from_cache=[r.label for r in records if r.verified_source == "cache"],
            cuda_safe_from_cache=[r.label for r in records if r.cuda_safe_source == "cache"],
            stale=self.stale,
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
    startup_cache: Path | None = None,
    model_dir: Path | None = None,
    plan_backend: str | None = None,
    record_cpu_graphs: bool = True,
    graph_shapes: str = "all",
) -> GraphStartup:
    """Capture the runner's target and drafter graphs, verify each (I4), and attach them for
    serving (``runner.attach_graphs``). ``report`` is
    :meth:`~warmcap.startup_hooks.StartupContext.report` (start-up progress) or None.

    ``startup_cache``: directory of the start-up cache (:mod:`warmcap.graphs.proof.startup_cache`;
    None: off, every verdict is proven in this run), keyed on the bytes of the weights the graphs
    run and on the files of ``model_dir``. With it, verdicts cached for this exact setup are
    reused, and one graph per phase is still verified for real; ``compile`` points torch's
    inductor caches there too. ``plan_backend``: capture the graphs that backend plans
    (``static`` capture of the ``cuda`` plan: which steps a GPU would replay, on CPU).
    ``record_cpu_graphs``: ``static`` graphs on CPU replay recordings of their forward where they
    can (:mod:`warmcap.graphs.capture.cpu_program`); False: every replay runs the forward.
    ``graph_shapes``: ``every`` request count gets a decode graph, or only the capture sizes
    (``sizes``; ``graphs/capture/planning.py:plan_target``).
    """
    say = report or _silent
    chosen = backend or default_backend(runner)
    capturer = GraphCapturer(
        runner,
        chosen,
        capture_sizes=capture_sizes,
        plan_backend=plan_backend,
        record=record_cpu_graphs,
        graph_shapes=graph_shapes,
    )
    cache = None
    if startup_cache is not None:
        if model_dir is None:
            raise ValueError("capture_graphs: a startup_cache needs the model_dir its verdicts are keyed on")
        cache = _open_cache(startup_cache, model_dir, capturer, kv_cache_manager)
        if chosen == "compile":
            enable_compile_cache(startup_cache)
    start = time.perf_counter()
    total = len(capturer.plan.specs) + len(capturer.draft_plan.specs)
    say("graph_capture", f"backend {chosen}: {total} graphs")
    labels = [*(s.label for s in capturer.plan.specs), *(s.label for s in capturer.draft_plan.specs)]
    layouts = cache.cached_layouts(labels) if cache is not None and chosen == "static" else None
    result = capturer.capture(
        on_graph=lambda done, total, label: say("graph_capture", f"captured {label}", done=done, total=total),
        layouts=layouts,
    )
    safety: dict[str, GraphSafety] = {}
    if chosen != "cuda":
        # A CPU backend cannot show that the forward would record under CUDA: check it on fakes.
        safety = phase_safety(capturer, result.graphs, cache.cached_safety if cache else lambda label: None)
    cached_safety = {label for label in safety if cache is not None and label in cache.safety}
    captured = time.perf_counter()
    checks: list[GraphCheck] = []
    cached_labels: set[str] = set()
    notes = list(result.notes)
    stale: list[str] = []
    if verify:
        checks, cached_labels, stale = _verify(capturer, result.graphs, kv_cache_manager, cache, say)
        notes += stale
    verified = time.perf_counter()
    if verify:
        ok = sum(c.verified for c in checks)
        from_cache = f" ({len(cached_labels)} from the start-up cache)" if cached_labels else ""
        say(
            "graph_verify",
            f"{ok}/{len(checks)} verified{from_cache}",
            finished=True,
            seconds=verified - captured,
        )
    if cache is not None:
        cache.safety.update(safety)
        if chosen == "static":
            cache.layouts = {g.spec.label: g.layout for g in result.graphs}
        if stale:
            # Something outside the key changed; the safety verdicts read from it are suspect too.
            cache.safety = {label: s for label, s in safety.items() if label not in cached_safety}
            # The next start runs the capture's forward passes again and records what they give.
            cache.layouts = {}
        ran = [c for c in checks if c.label not in cached_labels]
        cache.save(checked_now=ran, keep_checks=not stale)
        if cache.ignored:
            notes.append(cache.ignored)
    graph_runner = GraphRunner(capturer.subjects, result.graphs)
    runner.attach_graphs(graph_runner)
    notes += [f"{c.label}: not verified ({c.reason})" for c in checks if c.reason]
    return GraphStartup(
        chosen,
        capturer,
        graph_runner,
        result,
        checks,
        captured - start,
        verified - captured,
        notes,
        cached_labels,
        cache,
        safety,
        cached_safety,
        bool(stale),
    )


def _open_cache(
    directory: Path, model_dir: Path, capturer: GraphCapturer, manager: KVCacheManager
) -> StartupCache:
    runner = capturer.runner
    key = StartupKey.build(
        device=runner.device,
        model_dir=model_dir,
        modules=[m for subject in capturer.subjects.values() for m in subject.modules()],
        config=runner.config,
        # Recorded and unrecorded graphs replay different code: their verdicts are kept apart.
        backend=capturer.backend if capturer.record else f"{capturer.backend} (not recorded)",
        num_blocks=manager.pool.num_blocks,
        specs=[*capturer.plan.specs, *capturer.draft_plan.specs],
    )
    return StartupCache.open(directory, key)


def _verify(
    capturer: GraphCapturer,
    graphs: list[CapturedGraph],
    manager: KVCacheManager,
    cache: StartupCache | None,
    say: Callable[..., None],
) -> tuple[list[GraphCheck], set[str], list[str]]:
    """Every graph's check, the labels taken from ``cache``, and notes on a stale cache.

    With every verdict cached, only the least recently checked graph of each phase runs; if one
    of those disagrees with its cached verdict, the entry is stale and every graph runs."""

    def run(subset: list[CapturedGraph], what: str) -> list[GraphCheck]:
        say("graph_verify", what, done=0, total=len(subset))
        return verify_graphs(
            capturer,
            subset,
            manager,
            on_check=lambda done, total, check: say(
                "graph_verify",
                f"{check.label}: {'verified' if check.verified else 'NOT verified'}",
                done=done,
                total=total,
            ),
        )

    labels = [g.spec.label for g in graphs]
    cached = cache.cached_checks(labels) if cache is not None else None
    if not cached:
        return run(graphs, "replay vs eager"), set(), []
    spot = _spot_graphs(graphs, cached)
    fresh = {c.label: c for c in run(spot, f"{len(graphs) - len(spot)} verdicts cached; spot check")}
    stale = [label for label, c in fresh.items() if not same_verdict(cached[label].check, c)]
    if stale:
        note = (
            f"start-up cache was stale: the spot check of {', '.join(stale)} disagreed with its cached "
            f"verdict; every graph was verified again and the entry rebuilt ({cache.path if cache else ''})"
        )
        log.warning(note)
        return run(graphs, "stale cache: replay vs eager"), set(), [note]
    checks = [fresh.get(label) or cached[label].check for label in labels]
    return checks, set(labels) - set(fresh), []


def _spot_graphs(graphs: list[CapturedGraph], cached: dict[str, CachedCheck]) -> list[CapturedGraph]:
    """The least recently checked graph of each phase, so a few warm starts re-check every graph;
    among equals the smallest (last captured), the cheapest to run."""
    spot: dict[str, CapturedGraph] = {}
    for g in graphs:
        best = spot.get(g.spec.phase)
        if best is None or cached[g.spec.label].checked_at <= cached[best.spec.label].checked_at:
            spot[g.spec.phase] = g
    return [g for g in graphs if g in spot.values()]
