"""Start-up checks: tensor parallelism at TP=2, and the warmup audit's start-up cost."""

from __future__ import annotations

import time
from typing import Any

import torch

from warmcap.devtools.device_check.registry import CheckContext, EngineCase, check

#: the TP=2 check's engine
TP_CASE = EngineCase("smollm2-135m", "float32", "draft_model:2")


@check("tensor_parallel", cuda_only=True)
def tensor_parallel(ctx: CheckContext) -> dict[str, Any]:
    """TP=2 over NCCL, one GPU per rank: start-up report rows for both ranks, greedy TP=2 == TP=1."""
    count = torch.cuda.device_count()
    if count < 2:
        return {"ok": True, "skipped": f"{count} CUDA device visible; TP=2 needs 2"}
    from warmcap.sampling_params import SamplingParams
    from warmcap.startup import run_startup

    params = SamplingParams(temperature=0.0, max_tokens=ctx.max_tokens)
    prompts = list(ctx.prompts)
    t0 = time.perf_counter()
    run = run_startup(ctx.config(TP_CASE, tensor_parallel_size=2), ctx.startup())
    startup_s = time.perf_counter() - t0
    try:
        two = [o.token_ids for o in run.engine.generate(prompts, [params] * len(prompts))]
    finally:
        run.engine.shutdown()
    one_engine = run_startup(ctx.config(TP_CASE), ctx.startup()).engine
    try:
        one = [o.token_ids for o in one_engine.generate(prompts, [params] * len(prompts))]
    finally:
        one_engine.shutdown()
    ranks = [
        {
            "rank": r.rank,
            "violations": r.warmup_audit.violations,
            "verified": f"{r.graphs_verified}/{r.graphs}",
        }
        for r in run.report.ranks
    ]
    ranks_ok = len(ranks) == 2 and all(r.ok and r.warmup_audit.enabled for r in run.report.ranks)
    same = sum(a == b for a, b in zip(one, two, strict=True))
    return {
        "ok": ranks_ok and same == len(prompts),
        "engine": TP_CASE.label,
        "startup_s": startup_s,
        "ranks": ranks,
        "greedy_identical": same,
        "prompts": len(prompts),
        "summary": [f"ranks {ranks}; greedy TP=2 == TP=1 for {same}/{len(prompts)} prompts"],
    }


@check("audit_cost")
def audit_cost(ctx: CheckContext) -> dict[str, Any]:
    """``warmup run``'s start-up of one engine with the audit (the default) and without it."""
    from warmcap.startup import run_startup

    runs = {}
    for audit in (True, False):
        t0 = time.perf_counter()
        run = run_startup(ctx.config(ctx.audit_case), ctx.startup(audit=audit))
        total = time.perf_counter() - t0
        run.engine.shutdown()
        a = run.report.warmup_audit
        runs["audit" if audit else "no_audit"] = {
            "startup_s": total,
            "warmup_s": run.report.timings.get("warmup"),
            "audit_enabled": a.enabled,
            "slots_checked": a.slots_checked if a.enabled else None,
            "violations": a.violations if a.enabled else None,
        }
    on, off = runs["audit"], runs["no_audit"]
    ok = (
        on["audit_enabled"] and on["violations"] == 0 and on["slots_checked"] > 0 and not off["audit_enabled"]
    )
    return {
        "ok": ok,
        "engine": ctx.audit_case.label,
        **runs,
        "summary": [
            f"{ctx.audit_case.label}: start-up {on['startup_s']:.2f}s audited "
            f"(warmup {on['warmup_s']:.2f}s, {on['slots_checked']} slots, {on['violations']} violations) "
            f"vs {off['startup_s']:.2f}s without (warmup {off['warmup_s']:.2f}s)"
        ],
    }
