"""What each rank's start-up hooks found, sent to rank 0 for the report's per-rank rows.

A hook's result holds live objects (the graph runner, the runner itself) that cannot cross
processes, so each rank reduces it to a small summary (:func:`summarize`); rank 0 gathers them and
makes one :class:`~warmcap.graphs.proof.report.RankRow` per rank (:func:`rank_rows`).
"""

from __future__ import annotations

from typing import Any

from warmcap.graphs.proof.report import RankRow, WarmupAudit


def summarize(name: str, result: Any) -> dict[str, Any]:
    """The part of hook ``name``'s ``result`` the report shows per rank (empty for other hooks)."""
    if name == "warmup" and result is not None:
        return {"warmup_audit": result.audit.to_json()}
    if name == "graph_capture" and result is not None:
        verified = [r.verified for r in result.records]
        return {"graphs": len(verified), "graphs_verified": sum(verified)}
    return {}


def rank_rows(summaries: dict[str, list[dict[str, Any]]], world_size: int) -> list[RankRow]:
    """One row per rank from every hook's gathered summaries (``summaries[hook][rank]``)."""
    rows = []
    for rank in range(world_size):
        merged: dict[str, Any] = {}
        for per_rank in summaries.values():
            merged.update(per_rank[rank])
        rows.append(
            RankRow(
                rank=rank,
                warmup_audit=WarmupAudit.from_dict(merged.get("warmup_audit", {})),
                graphs=merged.get("graphs", 0),
                graphs_verified=merged.get("graphs_verified", 0),
            )
        )
    return rows
