"""The warmup start-up hook: plan -> execute with audit -> scrub; returns what it did."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from warmcap.audit.kv_writes import AuditViolationError
from warmcap.warmup.planner import plan_warmup
from warmcap.warmup.run import WarmupResult, run_warmup

if TYPE_CHECKING:
    from warmcap.startup_hooks import StartupContext
    from warmcap.warmup.plan import WarmupPlan

__all__ = ["AuditViolationError", "warmup_hook"]

#: What a user can do about a stray write: it is a bug, not a setting.
VIOLATION_ADVICE = (
    "the KV cache may hold another request's data, so the engine was not started; this is a warmcap "
    "bug in block reservation or slot mapping: report it with the output of `warmup run --out "
    "report.json` (same model and options)"
)


def warmup_hook(
    ctx: StartupContext,
    *,
    audit: bool = True,
    strict: bool = True,
    plan: WarmupPlan | None = None,
) -> WarmupResult:
    """Plan warmup through the engine's own groups and pool size, run it audited, scrub; the
    engine keeps the result as ``startup_results["warmup"]``.

    The audit is on by default on every device (``audit=False``, ``--no-audit``: the report then
    says "audit off", never zero counts). Any violation raises :class:`AuditViolationError` (so ``LLM(...)`` fails)
    unless ``strict=False``, which leaves judging the result to the caller (``warmup run`` and
    ``warmup serve`` report it first).

    ``plan``: a plan made elsewhere for the same groups and pool (tensor parallelism: rank 0 plans
    once and every rank runs that plan, ``distributed/executor.py``) instead of planning here.
    """
    t0 = time.perf_counter()
    if plan is None:
        plan = plan_warmup(ctx.config, ctx.kv_groups, ctx.num_blocks)
    planned = time.perf_counter() - t0
    ctx.report("warmup", f"planned {len(plan.steps)} steps in {planned:.2f} s", done=0, total=len(plan.steps))
    result = run_warmup(
        ctx.runner,
        ctx.kv_cache_manager,
        plan,
        audit=audit,
        on_step=lambda done, total, name: ctx.report("warmup", f"step {name}", done=done, total=total),
    )
    result.seconds["plan"] = planned
    if strict and not result.audit.ok:
        raise AuditViolationError(f"warmup audit found {result.audit.describe()}; {VIOLATION_ADVICE}")
    return result
