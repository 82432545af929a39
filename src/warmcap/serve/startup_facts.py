"""The one place the server reads what start-up produced (warmup audit, graphs, timings).

Start-up itself is :func:`warmcap.startup.run_startup`, the code behind ``warmup run``; the server
keeps its report (served at ``/startup``) and turns it into the facts it exports and the reason it
refuses to become ready.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from warmcap.config import EngineConfig, StartupOptions
    from warmcap.engine import LLMEngine


@dataclass(frozen=True, slots=True)
class StartupFacts:
    """Numbers of one start-up, as exported under ``warmcap:``."""

    phase_seconds: dict[str, float]
    graphs_captured: int
    graphs_verified: int
    audit_slots_checked: int
    audit_violations: int
    violation_samples: tuple[str, ...]
    #: the graphs that did not replay like eager: label and what differed (the report's words)
    unverified_graphs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StartedEngine:
    """A started engine with its report; ``refusal`` says why it must not serve (None: clean)."""

    engine: LLMEngine
    report_json: str
    facts: StartupFacts
    refusal: str | None


def start_engine(config: EngineConfig, startup: StartupOptions | None = None) -> StartedEngine:
    """Run the audited start-up of ``warmup run`` with the same options and defaults and judge its
    report (``audit=False``, ``--no-audit``: warmup unaudited, and the report says so).

    With ``enforce_eager`` nothing is captured and the report has no graphs; that is clean too.
    ``startup.audit_serving`` audits every step the engine then serves (a stray write fails that step).
    """
    from warmcap.startup import run_startup

    run = run_startup(config, startup)
    report = run.report
    audit = report.warmup_audit
    facts = StartupFacts(
        phase_seconds={k: float(v) for k, v in report.timings.items() if v is not None},
        graphs_captured=len(report.graphs),
        graphs_verified=sum(1 for g in report.graphs if g.verified),
        audit_slots_checked=audit.slots_checked,
        audit_violations=audit.violations,
        violation_samples=tuple(audit.violation_samples),
        unverified_graphs=tuple(_unverified(g) for g in report.graphs if not g.verified),
    )
    return StartedEngine(run.engine, report.to_json(), facts, _refusal(facts))  # type: ignore[arg-type]


def _refusal(facts: StartupFacts) -> str | None:
    if facts.audit_violations:
        first = "; ".join(facts.violation_samples[:3])
        return (
            f"warmup audit found {facts.audit_violations} stray KV write(s) ({first}); the server will "
            "not serve from a KV cache warmup may have corrupted: `warmup run` with the same flags shows every write"
        )
    unverified = facts.graphs_captured - facts.graphs_verified
    if unverified:
        # The server exits with this line: it names the graphs itself (no /startup to read then).
        named = "; ".join(facts.unverified_graphs[:3]) + ("; ..." if unverified > 3 else "")
        return (
            f"{unverified} of {facts.graphs_captured} captured graph(s) do not replay like eager ({named}); "
            "serve eagerly (leave out --capture-graphs), or see `warmup run --strict` with the same flags"
        )
    return None


def _unverified(graph: object) -> str:
    diff = getattr(graph, "max_abs_diff", None)
    greedy = getattr(graph, "greedy_match", None)
    what = "not verified" if diff is None else f"max |replay - eager| {diff:.3g}"
    if greedy is False:
        what += ", greedy tokens differ"
    return f"{graph.label}: {what}"  # type: ignore[attr-defined]
