"""Human and machine views of a :class:`WarmupPlan`: rich tables and the documented JSON schema."""

from __future__ import annotations

import json
from importlib import resources
from typing import TYPE_CHECKING

from rich.table import Table

if TYPE_CHECKING:
    from rich.console import Console

    from warmcap.warmup.plan import WarmupPlan


def plan_schema() -> dict:
    """The JSON Schema that ``warmup plan --json`` output follows."""
    text = resources.files("warmcap").joinpath("schemas/warmup_plan.schema.json").read_text()
    return json.loads(text)


def _blocks(ids: list[int]) -> str:
    return "[" + " ".join(str(i) for i in ids) + "]"


def render_plan(plan: WarmupPlan, console: Console) -> None:
    """One header, one table per step, then skipped steps with their reasons."""
    spec = f"{plan.method}:{plan.num_speculative_tokens}" if plan.method else "none"
    groups = ", ".join(
        f"{g.name} ({g.spec.kind}, bs={g.spec.block_size}"
        + (f", {g.spec.cache_mode}" if hasattr(g.spec, "cache_mode") else "")
        + ")"
        for g in plan.kv_groups
    )
    console.print(
        f"[bold]warmup plan[/] model={plan.model} spec={spec} block_size={plan.block_size} "
        f"max_model_len={plan.max_model_len} lookahead={plan.num_lookahead_tokens} "
        f"pool={plan.num_blocks} blocks (block 0 is null)",
        highlight=False,
    )
    console.print(f"KV groups: {groups}", highlight=False)
    for i, step in enumerate(plan.steps):
        table = Table(
            title=f"step {i}: {step.name} [{step.kind}] — {step.reason}",
            title_justify="left",
            show_edge=False,
        )
        for col in ("request", "computed", "scheduled", "drafts", "lookahead"):
            table.add_column(col, justify="right" if col != "request" else "left")
        for g in plan.kv_groups:
            table.add_column(f"blocks: {g.name}")
        table.add_column("boundary crossed")
        for r in step.requests:
            crossed = ", ".join(f"{g} ({how})" for g, how in r.crossed.items()) or "-"
            table.add_row(
                r.req_id,
                str(r.num_computed_tokens),
                str(r.num_scheduled_tokens),
                str(r.num_spec_tokens),
                str(r.num_lookahead_tokens),
                *(_blocks(r.blocks[g.name]) for g in plan.kv_groups),
                crossed,
            )
        console.print(table)
    for s in plan.skipped:
        console.print(f"[yellow]skipped[/] {s.name}: {s.reason}", highlight=False)
    total = sum(len(s.requests) for s in plan.steps)
    console.print(
        f"{len(plan.steps)} steps, {total} request-steps, {len(plan.req_ids)} requests, "
        f"{len(plan.skipped)} skipped",
        highlight=False,
    )
