"""``warmup run``: a full, audited start-up followed by a smoke generation, as one report.

load -> size KV -> warmup (plan, audited execution, scrub) -> graph capture + verification ->
smoke generation -> :class:`CaptureReport`. With ``enforce_eager`` nothing is captured and the
report says so (backend ``eager``, no graphs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from warmcap.config import EngineConfig, StartupOptions
from warmcap.engine import LLMEngine, startup_hooks_for
from warmcap.graphs.proof.report import CaptureReport, SpecDecodeStats, SpecInfo, WarmupAudit
from warmcap.models.batch_invariant import is_batch_invariant
from warmcap.sampling_params import SamplingParams
from warmcap.startup_hooks import StartupEvent, StartupObserver, current_observer, notify

#: Short, varied prompts: enough to exercise prefill, decode and drafting in a few seconds.
SMOKE_PROMPTS = (
    "The capital of France is",
    "List three colours of the rainbow: red, orange,",
    "def fibonacci(n):\n    ",
    "Repeat after me: one two three, one two three, one two three,",
)


@dataclass(slots=True)
class StartupRun:
    """The started engine, its report and the smoke texts."""

    engine: LLMEngine
    report: CaptureReport
    smoke_texts: list[str]

    @property
    def failed_verification(self) -> bool:
        return not self.report.totals.all_verified

    @property
    def audit_violations(self) -> int:
        """Stray KV writes warmup found: rank 0's, or under tensor parallelism every rank's."""
        if self.report.ranks:
            return sum(r.warmup_audit.violations for r in self.report.ranks)
        return self.report.warmup_audit.violations


def run_startup(
    config: EngineConfig,
    startup: StartupOptions | None = None,
    *,
    smoke_tokens: int = 16,
    num_smoke_prompts: int = 2,
    observer: StartupObserver | None = None,
    **options: Any,
) -> StartupRun:
    """Start an engine with warmup and graph hooks, run a short greedy generation, build the report.

    ``startup`` (or its options by name, as ``LLM`` takes them): :class:`StartupOptions`, whose
    defaults are every caller's. With ``audit=False`` (``--no-audit``) the report says "audit off".
    A warmup audit violation does not raise here: the report carries it (``audit_violations``) and
    the caller refuses (``warmup run`` exits 1, ``warmup serve`` never becomes ready); the smoke
    generation is skipped then, as the cache may be corrupted. ``audit_serving`` audits every step
    the engine runs afterwards, the smoke generation included.
    Each phase is reported to ``observer`` (default: the one set by ``startup_hooks.observing``).
    """
    observer = observer or current_observer()
    startup = StartupOptions.resolve(startup, options)
    hooks = startup_hooks_for(startup, strict=False)
    engine = LLMEngine(config, startup=startup, startup_hooks=hooks, observer=observer)
    warm = engine.warmup_result
    graphs = engine.graph_startup
    if warm is None:
        raise RuntimeError("the warmup hook ran but left no result")

    t1 = time.perf_counter()
    notify(observer, StartupEvent("smoke", f"{num_smoke_prompts} prompts x {smoke_tokens} tokens"))
    params = SamplingParams(temperature=0.0, max_tokens=smoke_tokens)
    prompts = list(SMOKE_PROMPTS[:num_smoke_prompts])
    if engine.tokenizer is None:
        prompts = [[1 + i, 2 + i, 3 + i] for i in range(num_smoke_prompts)]
    ranks = engine.executor.rank_rows() if engine.executor is not None else []
    audit_ok = warm.audit.ok and all(r.warmup_audit.violations == 0 for r in ranks)
    outputs = engine.generate(prompts, [params] * len(prompts)) if audit_ok else []
    smoke = time.perf_counter() - t1
    notify(observer, StartupEvent("smoke", finished=True, seconds=smoke))

    m = engine.spec_metrics
    spec = engine.config.speculative
    warmup_seconds = sum(warm.seconds.values())
    timings = {
        "load": engine.startup_timings.get("load"),
        "kv_sizing": engine.startup_timings.get("kv_sizing"),
        "warmup": warmup_seconds,
        "smoke": smoke,
    }
    common = {
        "model": engine.config.model.model,
        "device": str(engine.device),
        "spec": SpecInfo(spec.method, spec.num_speculative_tokens) if spec else SpecInfo(),
        "warmup_audit": WarmupAudit(**warm.audit.to_json()),
        "spec_decode": SpecDecodeStats(
            m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens, list(m.accepted_per_pos)
        ),
        "timings": timings,
        "ranks": ranks,
    }
    if graphs is not None:
        report = graphs.report(**common)
    else:
        report = CaptureReport(
            backend="eager",
            notes=["graphs were not captured: enforce_eager is set, so every pass ran eagerly"],
            batch_invariant=is_batch_invariant(engine.model),
            **common,
        )
    caching_off = engine.kv_cache_manager.caching_off_reason
    if caching_off:
        # Prefix caching was left to the default and declined: one line in the report, which
        # `warmup run` prints, so the user sees every prompt is computed in full.
        report.notes.append(f"prefix caching is off: {caching_off}")
    return StartupRun(engine, report, [o.text for o in outputs])
