"""Compare two capture reports (e.g. yesterday's CI run and today's) and flag regressions."""

from __future__ import annotations

from dataclasses import dataclass, field

from warmcap.errors import ConfigError
from warmcap.graphs.proof.report import CaptureReport, GraphRecord, WarmupAudit

# Capture times below this many seconds are noise on any machine; changes under it are not judged.
TIME_FLOOR_S = 0.005


@dataclass(frozen=True, slots=True)
class DiffRow:
    """One compared metric: ``status`` is ``regression``, ``improvement`` or ``same``."""

    metric: str
    old: str
    new: str
    status: str


@dataclass(frozen=True, slots=True)
class DiffResult:
    """Human-readable regressions and improvements, plus every compared row for a table."""

    regressions: list[str] = field(default_factory=list)
    improvements: list[str] = field(default_factory=list)
    rows: list[DiffRow] = field(default_factory=list)

    @property
    def has_regressions(self) -> bool:
        """Whether anything got worse."""
        return bool(self.regressions)


class _Differ:
    def __init__(self, time_tolerance: float, memory_tolerance: float) -> None:
        self.time_tolerance = time_tolerance
        self.memory_tolerance = memory_tolerance
        self.result = DiffResult()

    def add(self, metric: str, old: str, new: str, status: str, message: str = "") -> None:
        self.result.rows.append(DiffRow(metric, old, new, status))
        if status == "regression":
            self.result.regressions.append(message or f"{metric}: {old} -> {new}")
        elif status == "improvement":
            self.result.improvements.append(message or f"{metric}: {old} -> {new}")

    def seconds(self, metric: str, old: float, new: float) -> None:
        status = _relative(old, new, self.time_tolerance, floor=TIME_FLOOR_S)
        pct = f" ({_pct(old, new)})" if old > 0 else ""
        self.add(metric, f"{old:.3f}s", f"{new:.3f}s", status, f"{metric}: {old:.3f}s -> {new:.3f}s{pct}")

    def memory(self, metric: str, old: int, new: int) -> None:
        status = _relative(old, new, self.memory_tolerance, floor=0)
        pct = f" ({_pct(old, new)})" if old > 0 else ""
        self.add(metric, _mib(old), _mib(new), status, f"{metric}: {_mib(old)} -> {_mib(new)}{pct}")


def mismatched_setup(old: CaptureReport, new: CaptureReport) -> list[str]:
    """What makes two reports incomparable: ``field: old vs new`` for each of model, speculative
    method, backend, device and batch invariance that differs."""

    def spec(r: CaptureReport) -> str:
        return f"{r.spec.method}:{r.spec.k}" if r.spec.method else "none"

    pairs = {
        "model": (old.model, new.model),
        "spec": (spec(old), spec(new)),
        "backend": (old.backend, new.backend),
        "device": (old.device, new.device),
        "batch_invariant": (old.batch_invariant, new.batch_invariant),
    }
    return [f"{name} {a!r} vs {b!r}" for name, (a, b) in pairs.items() if a != b]


def diff_reports(
    old: CaptureReport,
    new: CaptureReport,
    *,
    time_tolerance: float = 0.25,
    memory_tolerance: float = 0.10,
    acceptance_tolerance: float = 0.0,
) -> DiffResult:
    """Compare ``new`` against ``old``.

    Regressions: capture time up by more than ``time_tolerance`` (total and per graph; changes under
    5 ms are ignored), memory up by more than ``memory_tolerance`` (total and per graph), acceptance
    length down by more than ``acceptance_tolerance`` (absolute), more audit violations, a graph that
    stopped verifying or stopped being CUDA-safe, a graph that disappeared. The mirror images count as improvements.

    Raises ConfigError when the reports come from different set-ups (:func:`mismatched_setup`):
    their numbers say nothing about a regression.
    """
    mismatch = mismatched_setup(old, new)
    if mismatch:
        raise ConfigError(
            f"the reports are not comparable: {'; '.join(mismatch)}: diff reports of the same model, "
            "--spec, backend and device"
        )
    d = _Differ(time_tolerance, memory_tolerance)
    ot, nt = old.totals, new.totals
    d.seconds("total capture time", ot.seconds, nt.seconds)
    d.memory("total graph memory", ot.bytes, nt.bytes)

    old_acc, new_acc = old.spec_decode.acceptance_length, new.spec_decode.acceptance_length
    if old.spec_decode.num_drafts or new.spec_decode.num_drafts:
        if new_acc < old_acc - acceptance_tolerance:
            status = "regression"
        elif new_acc > old_acc + acceptance_tolerance:
            status = "improvement"
        else:
            status = "same"
        d.add("acceptance length", f"{old_acc:.3f}", f"{new_acc:.3f}", status)

    oa, na = old.warmup_audit, new.warmup_audit
    if oa.enabled and na.enabled:
        ov, nv = oa.violations, na.violations
        status = "regression" if nv > ov else "improvement" if nv < ov else "same"
        d.add("warmup audit violations", str(ov), str(nv), status)
    elif oa.enabled or na.enabled:
        # An unaudited side proves nothing either way: say so rather than compare zeros.
        status = "regression" if oa.enabled else "improvement"
        d.add("warmup audit", _audit_text(oa), _audit_text(na), status)

    old_graphs = {g.key: g for g in old.graphs}
    new_graphs = {g.key: g for g in new.graphs}
    for key, og in old_graphs.items():
        ng = new_graphs.get(key)
        if ng is None:
            d.add(f"graph {og.label}", "captured", "missing", "regression", f"graph {og.label} disappeared")
            continue
        _compare_graph(d, og, ng)
    for key, ng in new_graphs.items():
        if key not in old_graphs:
            d.add(f"graph {ng.label}", "missing", "captured", "improvement", f"new graph {ng.label}")
    return d.result


def _compare_graph(d: _Differ, og: GraphRecord, ng: GraphRecord) -> None:
    d.seconds(f"{og.label} capture time", og.capture_seconds, ng.capture_seconds)
    d.memory(f"{og.label} memory", og.memory_bytes, ng.memory_bytes)
    if og.verified != ng.verified:
        if ng.verified:
            d.add(f"{og.label} verified", "no", "yes", "improvement", f"graph {og.label} now verifies")
        else:
            d.add(f"{og.label} verified", "yes", "no", "regression", f"graph {og.label} stopped verifying")
    if og.cuda_safe is not None and ng.cuda_safe is not None and og.cuda_safe != ng.cuda_safe:
        if ng.cuda_safe:
            d.add(f"{og.label} cuda-safe", "no", "yes", "improvement", f"graph {og.label} is now CUDA-safe")
        else:
            d.add(
                f"{og.label} cuda-safe",
                "yes",
                "no",
                "regression",
                f"graph {og.label} would no longer record under CUDA: {ng.cuda_unsafe_reason}",
            )


def _relative(old: float, new: float, tolerance: float, *, floor: float) -> str:
    if abs(new - old) <= floor:
        return "same"
    if new > old * (1.0 + tolerance):
        return "regression"
    if new < old * (1.0 - tolerance):
        return "improvement"
    return "same"


def _pct(old: float, new: float) -> str:
    return f"{(new - old) / old:+.0%}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _audit_text(audit: WarmupAudit) -> str:
    return f"{audit.violations} violations" if audit.enabled else "off"
