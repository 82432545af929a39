"""Speculative-decoding counters, exposed through ``prometheus_client`` under the names vLLM users
already scrape. The server's other series live in :mod:`warmcap.serve.metrics`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from warmcap.errors import ConfigError

_PREFIX = "vllm:spec_decode_"

# (metric name, help text) in exposition order.
_COUNTERS: tuple[tuple[str, str], ...] = (
    ("num_drafts_total", "Number of spec decoding drafts (steps where a request verified drafts)."),
    ("num_draft_tokens_total", "Number of draft tokens proposed and verified."),
    ("num_accepted_tokens_total", "Number of draft tokens accepted by the target."),
)
_PER_POS = (
    "num_accepted_tokens_per_pos_total",
    "Accepted draft tokens by position in the draft (0 = first draft token).",
)


@dataclass(slots=True)
class SpecDecodeMetrics:
    """Running totals over every verified draft — or, read back from a ``/metrics`` scrape or a
    stored baseline, the counts between two readings (``accept/counters.py``, :meth:`since`).

    A *draft* is one request's proposal verified in one step; ``accepted_per_pos[i]`` counts drafts
    whose first ``i + 1`` tokens were all accepted, so the per-position rates never rise.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Record one request's step: ``num_accepted`` of its ``num_draft_tokens`` drafts accepted."""
        if not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted} of {num_draft_tokens} draft tokens is impossible")
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def merge(self, other: SpecDecodeMetrics) -> None:
        """Add ``other``'s counts to these (e.g. one engine step into the run's totals)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        extra = len(other.accepted_per_pos) - len(self.accepted_per_pos)
        if extra > 0:
            self.accepted_per_pos.extend([0] * extra)
        for pos, count in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[pos] += count

    @property
    def acceptance_length(self) -> float:
        """Mean tokens produced per draft step: ``1 + accepted / drafts`` (1.0 before any draft)."""
        if self.num_drafts == 0:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed draft tokens (0.0 before any draft)."""
        if self.num_draft_tokens == 0:
            return 0.0
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def per_position_rates(self) -> list[float]:
        """Fraction of drafts whose token at each position was accepted."""
        if self.num_drafts == 0:
            return [0.0] * len(self.accepted_per_pos)
        return [count / self.num_drafts for count in self.accepted_per_pos]

    def padded(self, num_positions: int) -> SpecDecodeMetrics:
        """A copy with the per-position series extended by zeros to ``num_positions``."""
        extra = max(num_positions - len(self.accepted_per_pos), 0)
        return SpecDecodeMetrics(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            [*self.accepted_per_pos, *[0] * extra],
        )

    def since(self, before: SpecDecodeMetrics) -> SpecDecodeMetrics:
        """What was counted after ``before`` was read, as a new value (counters only grow)."""
        n = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        now, then = self.padded(n), before.padded(n)
        return SpecDecodeMetrics(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            [a - b for a, b in zip(now.accepted_per_pos, then.accepted_per_pos, strict=True)],
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpecDecodeMetrics:
        """Counts written by :meth:`as_dict` (a stored baseline), checked: non-negative integers,
        per-position counts that never rise and sum to the accepted tokens, and derived rates, when
        written, that agree with the counts. Raises ``ValueError`` saying which does not hold."""
        counts = (data["num_drafts"], data["num_draft_tokens"], data["num_accepted_tokens"])
        per_pos = list(data["accepted_per_pos"])
        if not all(isinstance(v, int) and v >= 0 for v in (*counts, *per_pos)):
            raise ValueError("counts must be non-negative integers")
        if any(a < b for a, b in itertools.pairwise((counts[0], *per_pos))):
            raise ValueError(
                f"accepted_per_pos {per_pos} rises with the position or exceeds num_drafts "
                f"{counts[0]}: a draft accepted at position i + 1 was accepted at i"
            )
        if sum(per_pos) != counts[2]:
            raise ValueError(
                f"accepted_per_pos sums to {sum(per_pos)} but num_accepted_tokens is {counts[2]}"
            )
        metrics = cls(*counts, per_pos)
        # NOTE: the rates are written for readers and derived from the counts on load; a hand edit
        # of a rate alone would otherwise be ignored silently.
        derived = metrics.as_dict()
        for key in ("acceptance_length", "acceptance_rate", "per_position_rates"):
            written, want = data.get(key, derived[key]), derived[key]
            pairs = zip(written, want, strict=False) if isinstance(want, list) else [(written, want)]
            if (isinstance(want, list) and len(written) != len(want)) or not all(
                math.isclose(w, d, rel_tol=1e-9) for w, d in pairs
            ):
                raise ValueError(
                    f"{key} {written} (the counts give {want}) disagree with the counts: edit the counts"
                )
        return metrics

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers for JSON results (same values as the Prometheus counters)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_length": self.acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "per_position_rates": self.per_position_rates,
        }

    def to_prometheus(self, labels: dict[str, str] | None = None) -> str:
        """Prometheus text exposition of the four counters, with ``labels`` on each sample (e.g.
        ``{"model_name": ...}``)."""
        registry = CollectorRegistry()
        registry.register(SpecDecodeCollector(lambda: self, labels or {}))
        return generate_latest(registry).decode()


class SpecDecodeCollector(Collector):
    """Reads a :class:`SpecDecodeMetrics` at every scrape and exposes it under vLLM's names.

    ``num_positions`` (the drafter's k) makes the per-position series exist, at 0, before the first
    draft, as dashboards expect one series per position from start-up.
    """

    def __init__(
        self, source: Callable[[], SpecDecodeMetrics], labels: dict[str, str], num_positions: int = 0
    ) -> None:
        if "position" in labels:
            raise ConfigError("the label 'position' is reserved for the per-position counter: rename it")
        self._source = source
        self._names = list(labels)
        self._values = [labels[k] for k in self._names]
        self._num_positions = num_positions

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = self._source()
        values = (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens)
        for (name, help_text), value in zip(_COUNTERS, values, strict=True):
            family = CounterMetricFamily(_PREFIX + name, help_text, labels=self._names)
            family.add_metric(self._values, value)
            yield family
        per_pos = list(m.accepted_per_pos)
        per_pos += [0] * (self._num_positions - len(per_pos))
        family = CounterMetricFamily(_PREFIX + _PER_POS[0], _PER_POS[1], labels=[*self._names, "position"])
        for pos, count in enumerate(per_pos):
            family.add_metric([*self._values, str(pos)], count)
        yield family


def format_spec_stats(metrics: SpecDecodeMetrics) -> str:
    """One human line for the CLI after generation."""
    if metrics.num_drafts == 0:
        return "spec decode: no drafts verified"
    rates = " ".join(f"{r:.2f}" for r in metrics.per_position_rates)
    return (
        f"spec decode: acceptance length {metrics.acceptance_length:.2f}, "
        f"{metrics.num_accepted_tokens}/{metrics.num_draft_tokens} draft tokens accepted "
        f"({metrics.acceptance_rate:.1%}) over {metrics.num_drafts} drafts; "
        f"per position: {rates}"
    )
