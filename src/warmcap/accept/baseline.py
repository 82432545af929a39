"""Stored acceptance baselines and the comparison of a run with one.

A baseline pins the model, the speculative setting, the prompt set (by hash) and ``max_tokens``,
since acceptance of one workload says nothing about another. The shipped ones live in
``accept/baselines`` as ``<model>_<method>-<k>.json``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from warmcap import __version__
from warmcap.errors import WarmcapError
from warmcap.metrics import SpecDecodeMetrics

if TYPE_CHECKING:
    from warmcap.accept.harness import PromptSet
    from warmcap.config import SpeculativeConfig

BASELINE_FORMAT = 1
DEFAULT_RTOL = 0.05

Status = Literal["PASS", "FAIL", "HIGH"]


def spec_identity(spec: SpeculativeConfig) -> dict[str, Any]:
    """The fields of a speculative setting that change what is drafted (ngram's lookup window only
    for ngram)."""
    ident: dict[str, Any] = {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "model": spec.model,
    }
    if spec.method == "ngram":
        ident |= {"prompt_lookup_min": spec.prompt_lookup_min, "prompt_lookup_max": spec.prompt_lookup_max}
    return ident


@dataclass(frozen=True, slots=True)
class Baseline:
    """The acceptance one setting reached on one prompt set, kept in the repository."""

    model: str
    spec: dict[str, Any]
    prompt_set_sha256: str
    max_tokens: int
    acceptance: SpecDecodeMetrics
    warmcap_version: str = __version__
    #: how it was measured (informational: CPU greedy runs are deterministic)
    notes: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = {
            "format": BASELINE_FORMAT,
            "model": self.model,
            "spec": self.spec,
            "prompt_set_sha256": self.prompt_set_sha256,
            "max_tokens": self.max_tokens,
            "warmcap_version": self.warmcap_version,
            "notes": self.notes,
            "acceptance": self.acceptance.as_dict(),
        }
        return json.dumps(data, indent=1) + "\n"


def check_baseline_target(path: Path) -> None:
    """Refuse a baseline path that cannot be written, before a run spends minutes measuring."""
    if path.is_dir() or not path.parent.is_dir():
        raise WarmcapError(f"cannot write baseline {str(path)!r}: give a file path in an existing folder")


def write_baseline(baseline: Baseline, path: Path) -> None:
    try:
        path.write_text(baseline.to_json(), encoding="utf-8")
    except OSError as exc:
        raise WarmcapError(
            f"cannot write baseline {str(path)!r} ({exc.strerror}): check that its folder exists and is writable"
        ) from None


def default_baseline_path(model: str, spec: SpeculativeConfig) -> Path:
    """Where the shipped baseline for ``model`` and ``spec`` lives (whether or not it exists)."""
    name = f"{Path(model).name}_{spec.method}-{spec.num_speculative_tokens}.json"
    return Path(str(resources.files("warmcap.accept") / "baselines" / name))


def shipped_baselines() -> list[str]:
    folder = resources.files("warmcap.accept") / "baselines"
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".json"))


def load_baseline(path: Path) -> Baseline:
    """Read a baseline file; any defect is a :class:`WarmcapError` naming the file."""
    hint = "write one with `warmup accept --write-baseline --baseline PATH`"
    if not path.is_file():
        shipped = ", ".join(shipped_baselines()) or "none"
        raise WarmcapError(f"baseline {str(path)!r} does not exist (shipped: {shipped}): {hint}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != BASELINE_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {BASELINE_FORMAT}")
        return Baseline(
            model=str(data["model"]),
            spec=dict(data["spec"]),
            prompt_set_sha256=str(data["prompt_set_sha256"]),
            max_tokens=int(data["max_tokens"]),
            acceptance=SpecDecodeMetrics.from_dict(data["acceptance"]),
            warmcap_version=str(data["warmcap_version"]),
            notes=dict(data.get("notes", {})),
        )
    except (
        OSError,
        UnicodeDecodeError,
        json.JSONDecodeError,
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
    ) as exc:
        raise WarmcapError(f"baseline {str(path)!r} is not a valid baseline ({exc}): {hint}") from None


def check_baseline_matches(
    baseline: Baseline,
    path: Path,
    *,
    model: str,
    spec: SpeculativeConfig,
    prompt_set: PromptSet,
    max_tokens: int,
) -> None:
    """Refuse to compare a run with a baseline of another model, setting or workload."""
    wanted = spec_identity(spec)
    mismatches = []
    if baseline.model != model:
        mismatches.append(f"model {baseline.model!r} (this run: {model!r})")
    if baseline.spec != wanted:
        mismatches.append(f"spec {_spec_text(baseline.spec)} (this run: {_spec_text(wanted)})")
    if baseline.prompt_set_sha256 != prompt_set.sha256:
        mismatches.append(
            f"prompt set {baseline.prompt_set_sha256[:12]} (this run: {prompt_set.sha256[:12]})"
        )
    if baseline.max_tokens != max_tokens:
        mismatches.append(f"max_tokens {baseline.max_tokens} (this run: {max_tokens})")
    if mismatches:
        raise WarmcapError(
            f"baseline {str(path)!r} was measured for another run: "
            + "; ".join(mismatches)
            + ": pass the matching --baseline, or record one with --write-baseline"
        )


def _spec_text(ident: dict[str, Any]) -> str:
    text = f"{ident.get('method')}:{ident.get('num_speculative_tokens')}"
    return text + (f"@{ident['model']}" if ident.get("model") else "")


# ---- comparison ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    """One compared number: the acceptance length (``position`` None) or one position's rate."""

    name: str
    position: int | None
    baseline: float
    measured: float
    status: Status

    @property
    def delta(self) -> float:
        return self.measured - self.baseline

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "position": self.position,
            "baseline": self.baseline,
            "measured": self.measured,
            "delta": self.delta,
            "status": self.status,
        }


@dataclass(frozen=True, slots=True)
class Comparison:
    rtol: float
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)


def check_rtol(rtol: float) -> None:
    if not 0 <= rtol < 1:
        raise WarmcapError(f"--rtol must be in [0, 1) (0.05 is 5%); got {rtol}")


def compare(
    baseline: SpecDecodeMetrics, measured: SpecDecodeMetrics, rtol: float = DEFAULT_RTOL
) -> Comparison:
    """Judge each number against the baseline: FAIL when it fell by more than ``rtol`` (relative),
    HIGH when it rose by more (not a regression, but the baseline no longer describes the run)."""
    check_rtol(rtol)
    if len(baseline.accepted_per_pos) != len(measured.accepted_per_pos):
        raise WarmcapError(
            f"the baseline has {len(baseline.accepted_per_pos)} draft positions, the run "
            f"{len(measured.accepted_per_pos)}: they measured different settings"
        )
    pairs = [("acceptance length", None, baseline.acceptance_length, measured.acceptance_length)]
    pairs += [
        (f"position {i}", i, b, m)
        for i, (b, m) in enumerate(zip(baseline.per_position_rates, measured.per_position_rates, strict=True))
    ]
    return Comparison(rtol, tuple(Check(n, p, b, m, _status(b, m, rtol)) for n, p, b, m in pairs))


def _status(baseline: float, measured: float, rtol: float) -> Status:
    # NOTE: isclose first, so a run equal to its baseline passes at rtol 0 despite float rounding.
    if math.isclose(measured, baseline, rel_tol=1e-12, abs_tol=1e-12):
        return "PASS"
    if measured < baseline * (1 - rtol):
        return "FAIL"
    if measured > baseline * (1 + rtol):
        return "HIGH"
    return "PASS"
