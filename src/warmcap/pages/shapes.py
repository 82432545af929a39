"""A warmup step's shape and the target graph that serves it, by the graph dispatcher's own rule.

Graphs are plain dicts with the report's graph keys (``phase``, ``mode``, ``num_tokens``,
``num_reqs``, ``uniform_query_len``), so a page can look a step up among the graphs a report says
were captured, or among the ones the default size policy would capture (``warmup plan``).
"""

from __future__ import annotations

from typing import Any

from warmcap.graphs.capture.descriptors import BatchDescriptor, BatchShape, CUDAGraphMode, Dispatcher
from warmcap.graphs.capture.sizes import default_capture_sizes, uniform_decode_sizes

#: report phases of graphs that serve a target step (the drafter's have their own passes)
TARGET_PHASES = ("decode", "mixed", "sparse_mla")


def step_shape(step: dict[str, Any]) -> BatchShape:
    """The batch a plan step (``WarmupPlan.to_json()['steps'][i]``) hands the runner."""
    lens = [r["num_scheduled_tokens"] for r in step["requests"]]
    return BatchShape.from_query_lens(lens, all_decode=step["kind"] == "decode")


def default_graphs(
    *, max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int, indexed: bool
) -> list[dict[str, Any]]:
    """The target graphs the default size policy captures (``graphs/capture/planning.py``): uniform-decode
    graphs for 1..max_num_seqs requests, mixed ones on the default ladder."""
    k = num_speculative_tokens
    q = 1 + k
    max_tokens = max(max_num_batched_tokens, max_num_seqs * q)
    graphs = [
        _graph("decode", n, n // q, q) for n in uniform_decode_sizes(max_num_seqs, k) if n <= max_tokens
    ]
    phase = "sparse_mla" if indexed else "mixed"
    for size in default_capture_sizes(max_num_seqs, k):
        if size <= max_tokens:
            graphs.append(_graph(phase, size, min(size, max_num_seqs), None))
    return graphs


def _graph(phase: str, num_tokens: int, num_reqs: int | None, q: int | None) -> dict[str, Any]:
    return {
        "phase": phase,
        "mode": CUDAGraphMode.FULL.value,
        "num_tokens": num_tokens,
        "num_reqs": num_reqs,
        "uniform_query_len": q,
    }


def graph_label(graph: dict[str, Any]) -> str:
    """``decode FULL t=8 r=4 q=2``: the label the text report uses."""
    parts = [graph["phase"], graph["mode"], f"t={graph['num_tokens']}"]
    if graph.get("num_reqs") is not None:
        parts.append(f"r={graph['num_reqs']}")
    if graph.get("uniform_query_len") is not None:
        parts.append(f"q={graph['uniform_query_len']}")
    return " ".join(parts)


def graph_for(shape: BatchShape, graphs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The target graph that serves ``shape`` among ``graphs`` (None: the step runs eagerly)."""
    by_key: dict[BatchDescriptor, dict[str, Any]] = {}
    for g in graphs:
        if g["phase"] not in TARGET_PHASES or g["mode"] == CUDAGraphMode.NONE.value:
            continue
        d = BatchDescriptor(
            CUDAGraphMode(g["mode"]), g["num_tokens"], g.get("num_reqs"), g.get("uniform_query_len")
        )
        by_key.setdefault(d, g)
    found = Dispatcher(by_key).dispatch(shape)
    return None if found is None else by_key[found]
