"""The ``engines`` check: per engine case and attention backend, capture + verification, replay vs
eager timing, generation identical before and after capture with graphs replayed."""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from warmcap.devtools.device_check.registry import CheckContext, EngineCase, check, timed


def replay_vs_eager(ctx: CheckContext, capturer: Any, graphs: Sequence[Any]) -> list[dict[str, Any]]:
    """Replay against the eager forward on the same (padding-only) static inputs: the largest and
    smallest graph of each phase."""
    by_phase: dict[str, list[Any]] = {}
    for g in graphs:
        by_phase.setdefault(g.spec.phase, []).append(g)  # largest first within a phase
    picks = {id(g): g for gs in by_phase.values() for g in (gs[:1] + gs[-1:])}.values()
    out = []
    with torch.inference_mode():
        for g in picks:
            capturer.load(g.spec)
            replay = timed(ctx, g.replay_fn, ctx.timing_iters)
            eager = timed(ctx, lambda g=g: capturer.forward(g.spec, g.metas), ctx.timing_iters)
            out.append(
                {
                    "graph": g.spec.label,
                    "phase": g.spec.phase,
                    "replay_ms": replay * 1e3,
                    "eager_ms": eager * 1e3,
                    "speedup": eager / replay if replay > 0 else None,
                }
            )
    return out


def check_engine(ctx: CheckContext, case: EngineCase, attention: str = "torch") -> dict[str, Any]:
    """One engine: generate, capture + verify, time replay vs eager, generate again."""
    from warmcap.engine import LLMEngine
    from warmcap.graphs.proof.report import SpecInfo
    from warmcap.graphs.startup import capture_graphs
    from warmcap.sampling_params import SamplingParams

    config = ctx.config(case, attention=attention)
    t0 = time.perf_counter()
    engine = LLMEngine(config, startup_hooks=[])
    load_s = time.perf_counter() - t0
    prompts: list[Any] = list(ctx.prompts)
    if engine.tokenizer is None:
        prompts = [[3 + (7 * i + j) % 90 for j in range(5 + 3 * i)] for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, max_tokens=ctx.max_tokens, ignore_eos=True)] * len(prompts)
    try:
        before = [o.token_ids for o in engine.generate(prompts, params)]
        startup = capture_graphs(
            engine.runner,
            engine.kv_cache_manager,
            backend=ctx.backend,
            plan_backend=ctx.plan_backend,
            capture_sizes=None if ctx.capture_sizes is None else list(ctx.capture_sizes),
        )
        timings = replay_vs_eager(ctx, startup.capturer, startup.result.graphs)
        after = [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        engine.shutdown()
    runner = startup.graph_runner
    replays = sum(runner.replays.values())
    draft_replays = sum(runner.draft_replays.values())
    has_draft_graphs = any(g.spec.subject == "drafter" for g in startup.result.graphs)
    spec = config.speculative
    report = startup.report(
        model=case.model,
        device=ctx.device_name(),
        spec=SpecInfo(spec.method if spec else None, config.num_speculative_tokens),
        timings={"load": load_s},
    )
    if ctx.render_reports:
        from rich.console import Console

        from warmcap.graphs.proof.render import render

        render(report, Console())
    notes = []
    if replays == 0:
        notes.append("generation did not replay any target graph")
    if has_draft_graphs and draft_replays == 0:
        notes.append("generation did not replay any drafter graph")
    if before != after:
        notes.append("generation after capture differs from generation before it")
    totals = report.totals
    if not totals.all_verified:
        notes.append("a graph failed verification")
    real_rows = [g.real_rows_max_abs_diff for g in report.graphs if g.real_rows_max_abs_diff is not None]
    return {
        "engine": case.label,
        "model": case.model,
        "dtype": case.dtype,
        "spec": case.spec,
        "attention": attention,
        "batch_invariant": case.batch_invariant,
        "ok": not notes,
        "graphs": totals.count,
        "all_verified": totals.all_verified,
        "capture_s": startup.capture_seconds,
        "verify_s": startup.verify_seconds,
        "graph_bytes": totals.bytes,
        "real_rows_max_abs_diff": max(real_rows, default=None),
        "generation_identical": before == after,
        "graph_replays_during_generation": replays,
        "draft_graph_replays_during_generation": draft_replays,
        "eager_steps_during_generation": runner.eager_steps,
        "replay_vs_eager": timings,
        "report": report.to_dict(),
        "notes": notes,
    }


def _engine_line(e: dict[str, Any]) -> list[str]:
    head = f"{'PASS' if e['ok'] else 'FAIL'}  {e['engine']} attention={e['attention']}"
    if "error" in e:
        return [f"{head}  error: {e['error']}"]
    lines = [
        f"{head}  graphs={e['graphs']} verified={e['all_verified']} capture={e['capture_s']:.2f}s "
        f"verify={e['verify_s']:.2f}s memory={e['graph_bytes'] / 2**20:.1f}MiB "
        f"identical={e['generation_identical']} replays={e['graph_replays_during_generation']} "
        f"draft_replays={e['draft_graph_replays_during_generation']} "
        f"eager_steps={e['eager_steps_during_generation']} real_rows_max_diff={e['real_rows_max_abs_diff']}"
    ]
    for t in e["replay_vs_eager"]:
        speedup = f" (x{t['speedup']:.1f})" if t["speedup"] else ""
        lines.append(
            f"    {t['graph']}: replay {t['replay_ms']:.3f} ms vs eager {t['eager_ms']:.3f} ms{speedup}"
        )
    lines += [f"    note: {n}" for n in e["notes"]]
    return lines


@check("engines")
def engines(ctx: CheckContext) -> dict[str, Any]:
    rows = []
    for case in ctx.engines:
        for attention in ctx.attentions:
            ctx.log(f"--- {case.label} attention={attention}")
            try:
                rows.append(check_engine(ctx, case, attention))
            except Exception as exc:
                ctx.log(traceback.format_exc())
                rows.append({"engine": case.label, "attention": attention, "ok": False, "error": repr(exc)})
            if ctx.is_cuda:
                torch.cuda.empty_cache()
    return {
        "ok": all(r["ok"] for r in rows),
        "engines": rows,
        "summary": [line for r in rows for line in _engine_line(r)],
    }
