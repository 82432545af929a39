"""Speculative acceptance as vLLM's spec-decode counters state it, read from Prometheus text.

One reading serves every source: an in-process engine renders its counters with
:meth:`warmcap.metrics.SpecDecodeMetrics.to_prometheus`, a server (or a P/D proxy's decode server)
serves the same series at ``/metrics``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from warmcap.errors import WarmcapError

_PREFIX = "vllm:spec_decode_"
_DRAFTS = _PREFIX + "num_drafts_total"
_DRAFT_TOKENS = _PREFIX + "num_draft_tokens_total"
_ACCEPTED = _PREFIX + "num_accepted_tokens_total"
_PER_POS = _PREFIX + "num_accepted_tokens_per_pos_total"


@dataclass(frozen=True, slots=True)
class Acceptance:
    """Spec-decode counter values (or the difference of two readings).

    ``accepted_per_pos[i]`` counts drafts whose first ``i + 1`` tokens were all accepted, so the
    per-position rates never increase with the position.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    @property
    def acceptance_length(self) -> float:
        """Mean tokens a verify step yields: 1 + accepted / drafts (1.0 without drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_rates(self) -> tuple[float, ...]:
        """Fraction of drafts accepted up to and including each position."""
        if not self.num_drafts:
            return tuple(0.0 for _ in self.accepted_per_pos)
        return tuple(c / self.num_drafts for c in self.accepted_per_pos)

    def padded(self, num_positions: int) -> Acceptance:
        """The same counts with the per-position series extended by zeros to ``num_positions``."""
        extra = num_positions - len(self.accepted_per_pos)
        return replace(self, accepted_per_pos=self.accepted_per_pos + (0,) * max(extra, 0))

    def since(self, before: Acceptance) -> Acceptance:
        """What was counted after ``before`` was read (counters only grow)."""
        n = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        now, then = self.padded(n), before.padded(n)
        return Acceptance(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            tuple(a - b for a, b in zip(now.accepted_per_pos, then.accepted_per_pos, strict=True)),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_length": self.acceptance_length,
            "per_position_rates": list(self.per_position_rates),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Acceptance:
        counts = (data["num_drafts"], data["num_draft_tokens"], data["num_accepted_tokens"])
        per_pos = tuple(data["accepted_per_pos"])
        if not all(isinstance(v, int) and v >= 0 for v in (*counts, *per_pos)):
            raise ValueError("counts must be non-negative integers")
        if any(a < b for a, b in itertools.pairwise((counts[0], *per_pos))):
            raise ValueError(
                f"accepted_per_pos {list(per_pos)} rises with the position or exceeds num_drafts "
                f"{counts[0]}: a draft accepted at position i + 1 was accepted at i"
            )
        if sum(per_pos) != counts[2]:
            raise ValueError(
                f"accepted_per_pos sums to {sum(per_pos)} but num_accepted_tokens is {counts[2]}"
            )
        acceptance = cls(*counts, per_pos)
        # NOTE: the rates are written for readers and derived from the counts on load; a hand edit
        # of a rate alone would otherwise be ignored silently.
        derived = [acceptance.acceptance_length, *acceptance.per_position_rates]
        written = [data.get("acceptance_length", derived[0]), *data.get("per_position_rates", derived[1:])]
        if len(written) != len(derived) or not all(
            math.isclose(w, d, rel_tol=1e-9) for w, d in zip(written, derived, strict=True)
        ):
            raise ValueError(
                "acceptance_length or per_position_rates disagree with the counts: edit the counts"
            )
        return acceptance


def read_acceptance(text: str, *, model_name: str | None = None) -> Acceptance:
    """The four spec-decode counters of a Prometheus text exposition.

    Samples labelled with another ``model_name`` are ignored (a scrape may cover several models).
    Raises :class:`WarmcapError` when the text has no spec-decode counters at all.
    """
    totals = {_DRAFTS: 0, _DRAFT_TOKENS: 0, _ACCEPTED: 0}
    per_pos: dict[int, int] = {}
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if model_name is not None and labels.get("model_name", model_name) != model_name:
                continue
            if sample.name in totals:
                totals[sample.name] += int(sample.value)
                seen = True
            elif sample.name == _PER_POS:
                pos = int(labels["position"])
                per_pos[pos] = per_pos.get(pos, 0) + int(sample.value)
    if not seen:
        who = f" for model {model_name!r}" if model_name else ""
        raise WarmcapError(
            f"no {_DRAFTS} counter{who} in the metrics: the endpoint is not a warmcap or vLLM server "
            "with speculative decoding, or it serves another model"
        )
    ordered = tuple(per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1))
    return Acceptance(totals[_DRAFTS], totals[_DRAFT_TOKENS], totals[_ACCEPTED], ordered)
