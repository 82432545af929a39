"""The warmup start-up hook: plan -> execute with audit -> scrub; returns what it did."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from warmcap.errors import WarmcapError
from warmcap.warmup.planner import plan_warmup
from warmcap.warmup.run import WarmupResult, run_warmup

if TYPE_CHECKING:
    from warmcap.startup_hooks import StartupContext


class AuditViolationError(WarmcapError):
    """Warmup wrote KV outside the blocks a request holds (invariant I2)."""


def warmup_hook(ctx: StartupContext, *, audit: bool | None = None, strict: bool = False) -> WarmupResult:
    """Plan warmup through the engine's own groups and pool size, run it audited, scrub; the
    engine keeps the result as ``startup_results["warmup"]``.

    The audit copies slot mappings to the host, so on CUDA it is opt-in (``audit=True``); on CPU it
    is on by default. ``strict`` turns any violation into :class:`AuditViolationError`.
    """
    if audit is None:
        audit = ctx.device.type != "cuda"
    t0 = time.perf_counter()
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
        first = "; ".join(str(v) for v in result.audit.violations[:3])
        raise AuditViolationError(
            f"warmup audit found {len(result.audit.violations)} stray KV write(s): {first}"
        )
    return result
