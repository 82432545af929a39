"""``warmup plan --html``: every warmup step's block layout, per request and KV group, and the graphs
the run captures (the capture planner's plan for the config, handed over as data)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from warmcap.pages.grid import StepOverlay, step_grid
from warmcap.pages.html import document, esc, legend, num
from warmcap.pages.shapes import graph_for, label_of, planned_graphs, step_shape

if TYPE_CHECKING:
    from warmcap.graphs.capture.planning import CapturePlan
    from warmcap.warmup.plan import WarmupPlan


def plan_view(plan: WarmupPlan) -> dict[str, Any]:
    """``plan.to_json()`` (the schema of ``warmup plan --json``) plus what only the text plan shows:
    each step's reason, each request's lookahead and boundary crossings, the skipped steps."""
    view = plan.to_json()
    for step, data in zip(plan.steps, view["steps"], strict=True):
        data["reason"] = step.reason
        for req, rdata in zip(step.requests, data["requests"], strict=True):
            rdata["num_lookahead_tokens"] = req.num_lookahead_tokens
            rdata["crossed"] = dict(req.crossed)
    view["skipped"] = [{"name": s.name, "reason": s.reason} for s in plan.skipped]
    return view


def step_header(index: int, step: dict[str, Any], graphs: list[dict[str, Any]] | None) -> str:
    """``step 3: name [kind] — reason``, then the shape and the graph that serves it."""
    shape = step_shape(step)
    q = (
        f"query length {shape.uniform_query_len}"
        if shape.uniform_query_len
        else f"query lengths up to {shape.max_query_len}"
    )
    graph = ""
    if graphs is not None:
        found = graph_for(shape, graphs)
        graph = (
            f' · warms graph <b class="warms">{esc(label_of(found))}</b>'
            if found
            else " · <b>no graph fits</b>: runs eagerly"
        )
    return (
        f'<h3 id="step-{index}">step {index}: {esc(step["name"])} [{esc(step["kind"])}]'
        f' <span class="dim">— {esc(step.get("reason", ""))}</span></h3>'
        f'<div class="shape">shape <b>{shape.num_tokens}</b> tokens / <b>{shape.num_reqs}</b> requests / {q}'
        f"{' (uniform decode)' if shape.all_decode and shape.uniform_query_len else ''}{graph}</div>"
    )


def plan_steps(
    view: dict[str, Any],
    graphs: list[dict[str, Any]] | None,
    *,
    prefix: str = "",
    overlays: dict[int, StepOverlay] | None = None,
) -> str:
    """Every step of a plan view as a card with its block grid; a step with a stray write is red."""
    overlays = overlays or {}
    cards = []
    for i, step in enumerate(view["steps"]):
        overlay = overlays.get(i)
        bad = " bad" if overlay and overlay.violations else ""
        grid = step_grid(
            i,
            step,
            view["kv_groups"],
            view["num_lookahead_tokens"],
            path=f"{prefix}steps/{i}",
            overlay=overlay,
        )
        cards.append(
            f'<section class="step{bad}" data-step="{i}">{step_header(i, step, graphs)}{grid}</section>'
        )
    for s in view.get("skipped", []):
        cards.append(f'<p class="dim">skipped {esc(s["name"])}: {esc(s["reason"])}</p>')
    return "".join(cards)


def plan_summary(view: dict[str, Any], *, prefix: str = "") -> str:
    spec = view["spec"]
    spec_text = f"{spec['method']}:{spec['num_speculative_tokens']}" if spec["method"] else "none"
    groups = ", ".join(f"{g['name']} ({g['kind']}, bs={g['block_size']})" for g in view["kv_groups"])
    held = sum(len(ids) for s in view["steps"] for r in s["requests"] for ids in r["blocks"].values())
    return (
        f'<p class="meta"><b>model</b> {esc(view["model"])} · <b>spec</b> {esc(spec_text)} · '
        f"<b>block size</b> {num(str(view['block_size']), prefix + 'block_size')} · "
        f"<b>max_model_len</b> {num(str(view['max_model_len']), prefix + 'max_model_len')} · "
        f"<b>lookahead</b> {num(str(view['num_lookahead_tokens']), prefix + 'num_lookahead_tokens')} · "
        f"<b>pool</b> {num(str(view['num_blocks']), prefix + 'num_blocks')} blocks (block 0 is null)<br>"
        f"<b>KV groups</b> {esc(groups)} · {len(view['steps'])} steps, "
        f'<span id="cell-count">{held}</span> block cells</p>'
    )


def graph_list(capture: CapturePlan) -> str:
    """The graphs a start-up captures, target then drafter, each with its label (``data-label``),
    and the plan's notes on what runs eagerly."""
    graphs = planned_graphs(capture)
    items = "".join(
        f'<li class="graph" data-label="{esc(label_of(g))}">{esc(label_of(g))}</li>' for g in graphs
    )
    notes = "".join(f'<li class="dim">{esc(n)}</li>' for n in capture.notes)
    listed = f'<ul class="graphs">{items}</ul>' if graphs else '<p class="dim">no graph is captured</p>'
    return (
        f'<h2 id="graphs">graphs the run captures: <span id="graph-count">{len(graphs)}</span> '
        f'<span class="dim">(backend {esc(capture.backend)})</span></h2>{listed}'
        + (f'<ul class="notes">{notes}</ul>' if notes else "")
    )


def plan_page(view: dict[str, Any], capture: CapturePlan | None) -> str:
    """The whole page of a plan view; ``capture``: the capture plan of the same config, listed and
    looked up for each step (None: no graph is shown)."""
    graphs = None if capture is None else planned_graphs(capture)
    body = (
        f"<h1>warmup plan: {esc(view['model'])}</h1>{plan_summary(view)}{legend()}"
        + ("" if capture is None else graph_list(capture))
        + '<h2>warmup steps</h2><p class="dim">Each step is a real scheduler output the runner executes at start-up. A row of '
        "cells is one request's block table in one KV group; each cell is a block, each mark in it a "
        "token position. Hover a block for its numbers; the same block elsewhere is outlined.</p>"
        + plan_steps(view, graphs)
    )
    return document(f"warmup plan {view['model']}", body, panel_hint="hover or focus a block")
