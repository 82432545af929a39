"""A warmup step's shape and the target graph that serves it, by the graph dispatcher's own rule.

Graphs are plain dicts with the report's graph keys (``phase``, ``mode``, ``num_tokens``,
``num_reqs``, ``uniform_query_len``): a page looks a step up among the graphs a report says were
captured, or among the ones the capture planner plans for the config (``warmup plan``:
:func:`planned_graphs` of the plan ``graphs/capture/planning.py`` makes for capture itself). Labels
are the capture plan's and the report's own (:func:`warmcap.graphs.capture.descriptors.graph_label`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from warmcap.graphs.capture.descriptors import (
    BatchDescriptor,
    BatchShape,
    CUDAGraphMode,
    Dispatcher,
    graph_label,
)
from warmcap.graphs.capture.planning import TARGET, subject_of

if TYPE_CHECKING:
    from warmcap.graphs.capture.planning import CapturePlan


def step_shape(step: dict[str, Any]) -> BatchShape:
    """The batch a plan step (``WarmupPlan.to_json()['steps'][i]``) hands the runner."""
    lens = [r["num_scheduled_tokens"] for r in step["requests"]]
    return BatchShape.from_query_lens(lens, all_decode=step["kind"] == "decode")


def planned_graphs(plan: CapturePlan) -> list[dict[str, Any]]:
    """Every graph of ``plan`` (target then drafter, in plan order) with the report's graph keys."""
    return [
        {
            "phase": s.phase,
            "mode": s.descriptor.mode.value,
            "num_tokens": s.descriptor.num_tokens,
            "num_reqs": s.descriptor.num_reqs,
            "uniform_query_len": s.descriptor.uniform_query_len,
        }
        for s in plan.specs
    ]


def label_of(graph: dict[str, Any]) -> str:
    """``decode FULL t=8 r=4 q=2``: the graph's label in the capture plan and the report."""
    return graph_label(
        graph["phase"],
        graph["mode"],
        graph["num_tokens"],
        graph.get("num_reqs"),
        graph.get("uniform_query_len"),
    )


def graph_for(shape: BatchShape, graphs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The target graph that serves ``shape`` among ``graphs`` (None: the step runs eagerly)."""
    by_key: dict[BatchDescriptor, dict[str, Any]] = {}
    for g in graphs:
        if subject_of(g["phase"]) != TARGET or g["mode"] == CUDAGraphMode.NONE.value:
            continue
        d = BatchDescriptor(
            CUDAGraphMode(g["mode"]), g["num_tokens"], g.get("num_reqs"), g.get("uniform_query_len")
        )
        by_key.setdefault(d, g)
    found = Dispatcher(by_key).dispatch(shape)
    return None if found is None else by_key[found]
