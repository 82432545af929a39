"""The graph-capture report: records, JSON round trip and its schema.

``CaptureReport.to_json()`` output validates against ``warmcap/schemas/capture_report.schema.json``
(JSON Schema draft 2020-12). Derived numbers (totals, acceptance length) are written for readers
and recomputed on load, so a hand-edited file cannot disagree with its own records.
Rendering lives in :mod:`warmcap.graphs.proof.render`, comparison in :mod:`warmcap.graphs.proof.diff`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources
from typing import Any, Literal

import jsonschema

from warmcap.errors import ConfigError
from warmcap.graphs.capture.descriptors import graph_label

REPORT_VERSION = 1
PHASES: tuple[str, ...] = ("decode", "mixed", "sparse_mla", "draft_prefill", "draft_decode")
#: ``eager``: no graph was captured (``enforce_eager``), every pass ran eagerly
BACKENDS: tuple[str, ...] = ("cuda", "static", "compile", "eager")
TIMING_KEYS: tuple[str, ...] = ("load", "kv_sizing", "warmup", "capture", "verify", "smoke")

Phase = Literal["decode", "mixed", "sparse_mla", "draft_prefill", "draft_decode"]
Backend = Literal["cuda", "static", "compile", "eager"]
#: where a graph's verdict came from: checked in this run, or the start-up cache
VerdictSource = Literal["run", "cache"]


@dataclass(frozen=True, slots=True)
class GraphRecord:
    """One captured graph: its key, cost, and whether replay matched eager (invariant I4)."""

    phase: Phase
    mode: str
    num_tokens: int
    num_reqs: int | None
    uniform_query_len: int | None
    capture_seconds: float
    memory_bytes: int
    verified: bool = False
    max_abs_diff: float | None = None
    real_rows_max_abs_diff: float | None = None
    greedy_match: bool | None = None
    #: would this graph record under CUDA (``graphs.proof.safety``, checked on CPU for the static
    #: and compile backends)? None: not checked (a ``cuda`` capture proves it by recording)
    cuda_safe: bool | None = None
    cuda_unsafe_reason: str = ""
    #: ``run``: ``verified`` was checked in this start-up; ``cache``: taken from the start-up cache
    #: (:mod:`warmcap.graphs.proof.startup_cache`)
    verified_source: VerdictSource = "run"
    #: the same for ``cuda_safe``
    cuda_safe_source: VerdictSource = "run"

    @property
    def key(self) -> tuple[str, str, int, int | None, int | None]:
        """Identity used to match graphs across two reports."""
        return (self.phase, self.mode, self.num_tokens, self.num_reqs, self.uniform_query_len)

    @property
    def label(self) -> str:
        """Short human-readable key, e.g. ``decode FULL t=8 r=4 q=2`` (the capture plan's own)."""
        return graph_label(self.phase, self.mode, self.num_tokens, self.num_reqs, self.uniform_query_len)


@dataclass(frozen=True, slots=True)
class SpecInfo:
    """The speculative setting the graphs were captured for (method None: no speculation)."""

    method: str | None = None
    k: int = 0


@dataclass(frozen=True, slots=True)
class Totals:
    """Sums over all graphs."""

    count: int
    seconds: float
    bytes: int
    all_verified: bool
    #: graphs the CPU check found would not record under CUDA
    cuda_unsafe: int = 0


#: what a report says instead of counts when warmup ran without its audit
AUDIT_OFF = "audit off (--no-audit): no KV write was checked"


@dataclass(frozen=True, slots=True)
class WarmupAudit:
    """Outcome of the warmup KV-write audit (invariant I2). ``enabled`` False: warmup ran without
    it (``--no-audit``); the JSON then carries null counts, never zeros that read as clean."""

    steps: int = 0
    passes: int = 0
    slots_checked: int = 0
    violations: int = 0
    violation_samples: list[str] = field(default_factory=list)
    enabled: bool = True

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.enabled:
            data.update(steps=None, passes=None, slots_checked=None, violations=None)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WarmupAudit:
        """Inverse of :meth:`to_dict` (reports from before ``enabled`` were audited)."""
        return cls(**{k: 0 if v is None else v for k, v in data.items()})


@dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """Speculative-decoding counters of the smoke run; ``per_position[i]`` counts accepted drafts
    at draft position i."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify step: 1 + accepted drafts per draft step (0 with no drafts)."""
        if self.num_drafts == 0:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts


@dataclass(frozen=True, slots=True)
class RankRow:
    """One tensor-parallel rank's start-up: its own warmup audit and graph verification."""

    rank: int
    warmup_audit: WarmupAudit = field(default_factory=WarmupAudit)
    graphs: int = 0
    graphs_verified: int = 0

    @property
    def all_verified(self) -> bool:
        return self.graphs_verified == self.graphs

    @property
    def ok(self) -> bool:
        """This rank audited clean and verified every graph."""
        return self.all_verified and self.warmup_audit.violations == 0


@dataclass(frozen=True, slots=True)
class StartupCacheUse:
    """What the start-up cache (:mod:`warmcap.graphs.proof.startup_cache`) gave one start: which
    verdicts were taken from it rather than proven in this run (invariant I4 rests on an earlier,
    identical start for those). ``enabled`` False: every verdict was proven in this run."""

    enabled: bool
    #: the entry file read and written
    entry: str | None = None
    #: sha256 of the bytes of the weights the graphs run: the part of the key that names them
    weights_digest: str | None = None
    #: labels (:attr:`GraphRecord.label`) of graphs whose replay-vs-eager verdict came from the cache
    verified_from_cache: list[str] = field(default_factory=list)
    #: labels of graphs whose CUDA-safety verdict came from the cache
    cuda_safe_from_cache: list[str] = field(default_factory=list)
    #: the spot check disagreed with a cached verdict: nothing was taken, every graph verified again
    stale: bool = False


@dataclass(frozen=True, slots=True)
class CaptureReport:
    """Everything start-up did to graphs, for one engine on one device."""

    model: str
    device: str
    backend: Backend
    spec: SpecInfo = field(default_factory=SpecInfo)
    capture_sizes: list[int] = field(default_factory=list)
    graphs: list[GraphRecord] = field(default_factory=list)
    warmup_audit: WarmupAudit = field(default_factory=WarmupAudit)
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    timings: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: the model ran with fixed-shape GEMM tiles (``ModelConfig.batch_invariant``)
    batch_invariant: bool = False
    #: one row per tensor-parallel rank (empty on one device; the top-level fields are rank 0's)
    ranks: list[RankRow] = field(default_factory=list)
    #: what the start-up cache gave (None: not said — an eager start, or a report older than it)
    startup_cache: StartupCacheUse | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown graph backend {self.backend!r}: use one of {', '.join(BACKENDS)}")
        unknown = sorted(set(self.timings) - set(TIMING_KEYS))
        if unknown:
            raise ConfigError(f"unknown timing keys {unknown}: known keys are {list(TIMING_KEYS)}")
        for g in self.graphs:
            if g.phase not in PHASES:
                raise ConfigError(f"unknown graph phase {g.phase!r}: use one of {', '.join(PHASES)}")

    @property
    def totals(self) -> Totals:
        """Count, capture seconds, memory and whether every graph verified (on every rank)."""
        return Totals(
            count=len(self.graphs),
            seconds=sum(g.capture_seconds for g in self.graphs),
            bytes=sum(g.memory_bytes for g in self.graphs),
            all_verified=all(g.verified for g in self.graphs) and all(r.all_verified for r in self.ranks),
            cuda_unsafe=sum(g.cuda_safe is False for g in self.graphs),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (schema: ``capture_report.schema.json``)."""
        spec_decode = asdict(self.spec_decode)
        spec_decode["acceptance_length"] = self.spec_decode.acceptance_length
        data: dict[str, Any] = {
            "version": REPORT_VERSION,
            "model": self.model,
            "device": self.device,
            "backend": self.backend,
            "batch_invariant": self.batch_invariant,
            "spec": asdict(self.spec),
            "capture_sizes": list(self.capture_sizes),
            "graphs": [_graph_dict(g) for g in self.graphs],
            "totals": asdict(self.totals),
            "warmup_audit": self.warmup_audit.to_dict(),
            "spec_decode": spec_decode,
            "timings": {k: self.timings.get(k) for k in TIMING_KEYS},
            "notes": list(self.notes),
        }
        if self.ranks:
            # Only under tensor parallelism, so one-device reports keep their exact shape.
            data["ranks"] = [
                {**asdict(r), "warmup_audit": r.warmup_audit.to_dict(), "all_verified": r.all_verified}
                for r in self.ranks
            ]
        if self.startup_cache is not None:
            data["startup_cache"] = asdict(self.startup_cache)
        return data

    def to_json(self, *, indent: int | None = 2) -> str:
        """The report as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CaptureReport:
        """Inverse of :meth:`to_dict`; derived fields (totals, acceptance length) are recomputed."""
        version = data.get("version")
        if version != REPORT_VERSION:
            raise ConfigError(
                f"capture report version {version!r} is not supported (expected {REPORT_VERSION}): "
                "regenerate it with this warmcap"
            )
        problem = schema_problem(data)
        if problem:
            raise ConfigError(f"capture report does not match its schema ({problem}): regenerate it")
        try:
            spec_decode = {k: v for k, v in data["spec_decode"].items() if k != "acceptance_length"}
            return cls(
                model=data["model"],
                device=data["device"],
                backend=data["backend"],
                spec=SpecInfo(**data["spec"]),
                capture_sizes=list(data["capture_sizes"]),
                graphs=[GraphRecord(**g) for g in data["graphs"]],
                warmup_audit=WarmupAudit.from_dict(data["warmup_audit"]),
                spec_decode=SpecDecodeStats(**spec_decode),
                timings={k: v for k, v in data["timings"].items() if v is not None},
                notes=list(data["notes"]),
                batch_invariant=bool(data.get("batch_invariant", False)),
                ranks=[
                    RankRow(
                        rank=r["rank"],
                        warmup_audit=WarmupAudit.from_dict(r["warmup_audit"]),
                        graphs=r["graphs"],
                        graphs_verified=r["graphs_verified"],
                    )
                    for r in data.get("ranks", [])
                ],
                startup_cache=StartupCacheUse(**data["startup_cache"]) if "startup_cache" in data else None,
            )
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"capture report is malformed ({exc}): regenerate it") from None

    @classmethod
    def from_json(cls, text: str) -> CaptureReport:
        """Parse JSON text written by :meth:`to_json`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"capture report is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict):
            raise ConfigError("capture report must be a JSON object")
        return cls.from_dict(data)


def _graph_dict(g: GraphRecord) -> dict[str, Any]:
    data = asdict(g)
    # NOTE: a diverged replay can yield inf/NaN, which JSON cannot carry; such a graph is already
    # unverified, so the number is dropped rather than written as invalid JSON.
    for key in ("max_abs_diff", "real_rows_max_abs_diff"):
        if data[key] is not None and not math.isfinite(data[key]):
            data[key] = None
    return data


@cache
def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of :meth:`CaptureReport.to_dict`."""
    path = resources.files("warmcap").joinpath("schemas/capture_report.schema.json")
    return json.loads(path.read_text())


def schema_problem(data: Any) -> str:
    """The first way ``data`` breaks the report schema, as ``where: what`` (empty when it fits)."""
    validator = jsonschema.Draft202012Validator(report_schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if error is None:
        return ""
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
    return f"{where or 'top level'}: {error.message}"
