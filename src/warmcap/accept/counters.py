"""Speculative acceptance as vLLM's spec-decode counters state it, read from Prometheus text.

One reading serves every source: an in-process engine renders its counters with
:meth:`warmcap.metrics.SpecDecodeMetrics.to_prometheus`, a server (or a P/D proxy's decode server)
serves the same series at ``/metrics``. A reading is a :class:`~warmcap.metrics.SpecDecodeMetrics`,
the engine's own counter type; two readings' difference is ``later.since(earlier)``.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from warmcap.errors import WarmcapError
from warmcap.metrics import SpecDecodeMetrics

_PREFIX = "vllm:spec_decode_"
_DRAFTS = _PREFIX + "num_drafts_total"
_DRAFT_TOKENS = _PREFIX + "num_draft_tokens_total"
_ACCEPTED = _PREFIX + "num_accepted_tokens_total"
_PER_POS = _PREFIX + "num_accepted_tokens_per_pos_total"


def read_acceptance(text: str, *, model_name: str | None = None) -> SpecDecodeMetrics:
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
    ordered = [per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1)]
    return SpecDecodeMetrics(totals[_DRAFTS], totals[_DRAFT_TOKENS], totals[_ACCEPTED], ordered)
