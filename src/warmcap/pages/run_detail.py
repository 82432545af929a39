"""What a ``warmup run`` knows beyond its JSON report: the plan it ran, what each audited pass
wrote, and every violation as a record — the data the report page draws on the block grids."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from warmcap.pages.grid import StepOverlay
from warmcap.pages.plan_page import plan_view

if TYPE_CHECKING:
    from warmcap.warmup.run import WarmupResult

#: most violations drawn on a page (a plan broken everywhere can stray thousands of times)
MAX_DRAWN = 200


def run_detail(result: WarmupResult) -> dict[str, Any]:
    """The plan view, per step the passes (phase, group, slots written, per request
    ``[position, slot]`` pairs), every violation (first ``MAX_DRAWN``) and the warmup timings."""
    steps = []
    for records in result.step_writes:
        passes = []
        for rec in records:
            qsl = rec.query_start_loc
            pos, slots = rec.positions.tolist(), rec.slot_mapping.tolist()
            writes = {
                req: [[pos[t], slots[t]] for t in range(qsl[i], qsl[i + 1]) if slots[t] >= 0]
                for i, req in enumerate(rec.req_ids)
            }
            passes.append({"phase": rec.phase, "group": rec.group, "slots": len(slots), "writes": writes})
        steps.append(passes)
    violations = [
        {
            "index": i,
            "step": v.step,
            "phase": v.phase,
            "request": v.request,
            "group": v.group,
            "position": v.position,
            "slot": v.slot,
            "block": v.block,
            "reason": v.reason,
            "text": str(v),
        }
        for i, v in enumerate(result.audit.violations[:MAX_DRAWN])
    ]
    return {
        "plan": plan_view(result.plan),
        "passes": steps,
        "violations": violations,
        "num_violations": len(result.audit.violations),
        "seconds": dict(result.seconds),
    }


def overlays(detail: dict[str, Any]) -> dict[int, StepOverlay]:
    """Per step index: its writes and violations, for :func:`warmcap.pages.grid.step_grid`."""
    index = {s["name"]: i for i, s in enumerate(detail["plan"]["steps"])}
    out: dict[int, StepOverlay] = {}
    for i, passes in enumerate(detail["passes"]):
        ov = out.setdefault(i, StepOverlay())
        for p in passes:
            for req, pairs in p["writes"].items():
                ov.writes.setdefault((req, p["group"]), []).extend((p["phase"], a, b) for a, b in pairs)
    for v in detail["violations"]:
        out.setdefault(index[v["step"]], StepOverlay()).violations.append(v)
    return out
