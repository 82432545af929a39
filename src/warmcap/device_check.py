"""Device validation of the graph path, as importable checks: ``scripts/gpu_check.py`` runs them on a
CUDA device, and CI runs the same code on CPU (``static`` graphs, tiny presets), so a renamed
method fails a test instead of the next GPU session.

A check is a function of a :class:`CheckContext` returning a JSON-ready dict with an ``ok`` key
(and optionally ``summary``: readable lines, ``skipped``: why it did not run). Checks live in the
registry :data:`CHECKS`, in the order they run; add one with the :func:`check` decorator::

    @check("attention_triton")
    def attention_triton(ctx: CheckContext) -> dict[str, Any]:
        ...
        return {"ok": equal, "summary": [f"triton paged attention == torch: {equal}"]}

``cuda_only=True`` checks report ``skipped`` off CUDA (the script exits 2 without CUDA anyway).
:func:`run_checks` runs a selection, turns an exception into that check's failure (one broken
check never hides the others) and :func:`summary_lines` renders the results.

Built in:
- ``engines``: per engine case and attention backend (torch; FlashInfer when importable), build the
  engine, generate greedily, capture every target and drafter graph with the device's backend,
  verify each (I4), time replay against the eager forward on the same static inputs, generate
  again: tokens identical, target graphs replayed (drafter graphs too when it has any);
- ``slot_mapping`` (CUDA): the Triton slot-mapping kernel, compiled for real, against torch;
- ``tensor_parallel`` (CUDA, 2+ GPUs): ``warmup run`` at TP=2 audited and verified on both ranks,
  greedy TP=2 == TP=1;
- ``audit_cost``: start-up with the warmup audit and without it (``--no-audit``), same engine;
- ``host_syncs`` (CUDA): synchronising CUDA calls a decode step (one: the step's token fetch).
"""

from __future__ import annotations

import datetime as dt
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

CheckFn = Callable[["CheckContext"], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class EngineCase:
    """One engine to check: preset, dtype, speculative spec, fixed-shape GEMMs."""

    model: str
    dtype: str
    spec: str | None = None
    batch_invariant: bool = False

    @property
    def label(self) -> str:
        return f"{self.model} {self.dtype} spec={self.spec}" + (
            " batch_invariant" if self.batch_invariant else ""
        )


#: what ``scripts/gpu_check.py`` runs on a GPU. MLA + MoE, sparse MLA and the Mamba hybrid are
#: graph-safe on CPU's fake-tensor check; the cuda plan leaves the hybrid's ragged passes eager.
GPU_ENGINES: tuple[EngineCase, ...] = (
    EngineCase("tiny-llama", "float32"),
    EngineCase("tiny-llama", "float32", "ngram:2"),
    EngineCase("tiny-llama", "float32", "draft_model:2"),
    EngineCase("tiny-llama", "float32", "eagle3:2"),
    EngineCase("tiny-llama", "float32", "dflash:2"),
    EngineCase("smollm2-135m", "bfloat16"),
    EngineCase("smollm2-135m", "bfloat16", "draft_model:2"),
    EngineCase("tiny-deepseek-v3", "float32"),
    EngineCase("tiny-deepseek-v3", "float32", "mtp:2"),
    EngineCase("tiny-deepseek-v32", "float32"),
    EngineCase("tiny-hybrid", "float32", "ngram:2"),
    EngineCase("tiny-hybrid", "float32", "draft_model:2@self"),
    # Fixed-shape GEMM tiles: real rows of every graph match the unpadded eager batch far tighter.
    EngineCase("smollm2-135m", "float32", "draft_model:2", batch_invariant=True),
)
PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Count: one, two, three,",
    "def add(a, b):",
    "Once upon a time",
)


@dataclass(slots=True)
class CheckContext:
    """What every check reads: the device, the graph backend, the engines and their sizes."""

    device: torch.device
    engines: Sequence[EngineCase] = GPU_ENGINES
    #: attention backends the engine check runs each case on
    attentions: Sequence[str] = ("torch",)
    #: graph backend (default: ``cuda`` on a CUDA device, else ``static``)
    backend: str = ""
    #: capture the graphs this backend plans (``static`` capture of the ``cuda`` plan on CPU)
    plan_backend: str | None = None
    #: mixed-graph ladder (None: the default one)
    capture_sizes: Sequence[int] | None = None
    prompts: Sequence[str] = PROMPTS
    max_tokens: int = 24
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    max_model_len: int = 512
    num_blocks: int = 1024
    mamba_cache_mode: str = "none"
    timing_iters: int = 20
    #: the engine whose start-up is timed with and without the audit
    audit_case: EngineCase = EngineCase("smollm2-135m", "bfloat16", "draft_model:2")
    #: progress lines (the script prints them)
    log: Callable[[str], None] = field(default=lambda line: None)
    #: print each engine's capture report (rich) as it is made
    render_reports: bool = False

    def __post_init__(self) -> None:
        if not self.backend:
            self.backend = "cuda" if self.device.type == "cuda" else "static"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.is_cuda else str(self.device)

    def config(self, case: EngineCase, *, attention: str = "auto", tensor_parallel_size: int = 1) -> Any:
        from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig

        return EngineConfig(
            model=ModelConfig(
                model=case.model,
                dtype=case.dtype,
                device=self.device.type,
                batch_invariant=case.batch_invariant,
                attention_backend=attention,
            ),
            cache=CacheConfig(
                block_size=16, num_blocks=self.num_blocks, mamba_cache_mode=self.mamba_cache_mode
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,
            ),
            speculative=SpeculativeConfig.parse(case.spec),
            tensor_parallel_size=tensor_parallel_size,
        )


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    run: CheckFn
    cuda_only: bool = False


#: every check, by name, in the order :func:`run_checks` runs them
CHECKS: dict[str, Check] = {}


def check(name: str, *, cuda_only: bool = False) -> Callable[[CheckFn], CheckFn]:
    """Register ``fn`` as the check ``name`` (a name may be registered once)."""

    def register(fn: CheckFn) -> CheckFn:
        if name in CHECKS:
            raise ValueError(f"device check {name!r} is registered twice")
        CHECKS[name] = Check(name, fn, cuda_only)
        return fn

    return register


def run_checks(ctx: CheckContext, names: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the checks ``names`` (default: all) and return one JSON-ready dict: environment facts,
    ``checks`` (name -> result) and ``ok`` (every check passed or was skipped)."""
    unknown = sorted(set(names or ()) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown device check(s) {unknown}: known are {', '.join(CHECKS)}")
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": ctx.device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "backend": ctx.backend,
        "plan_backend": ctx.plan_backend or ctx.backend,
        "attentions": list(ctx.attentions),
        "checks": {},
    }
    for name, entry in CHECKS.items():
        if names is not None and name not in names:
            continue
        ctx.log(f"\n=== {name}")
        t0 = time.perf_counter()
        if entry.cuda_only and not ctx.is_cuda:
            result: dict[str, Any] = {"ok": True, "skipped": f"needs CUDA; ran on {ctx.device}"}
        else:
            try:
                result = entry.run(ctx)
            except Exception as exc:
                ctx.log(traceback.format_exc())
                result = {"ok": False, "error": repr(exc)}
        result["seconds"] = time.perf_counter() - t0
        results["checks"][name] = result
    results["ok"] = all(r["ok"] for r in results["checks"].values())
    return results


def summary_lines(results: dict[str, Any]) -> list[str]:
    """One PASS/FAIL/SKIP line per check, then that check's own summary lines, indented."""
    lines = [f"{results['device']}  torch {results['torch']}  backend {results['backend']}"]
    for name, r in results["checks"].items():
        verdict = "SKIP" if "skipped" in r else "PASS" if r["ok"] else "FAIL"
        tail = f"  ({r['skipped']})" if "skipped" in r else f"  error: {r['error']}" if "error" in r else ""
        lines.append(f"{verdict}  {name}  {r['seconds']:.1f}s{tail}")
        lines += [f"    {line}" for line in r.get("summary", [])]
    lines.append(f"{'ALL PASSED' if results['ok'] else 'SOME CHECKS FAILED'}")
    return lines


def timed(ctx: CheckContext, fn: Callable[[], Any], iters: int) -> float:
    """Mean seconds a call after one warm call, synchronised on CUDA."""
    fn()
    ctx.sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    ctx.sync()
    return (time.perf_counter() - start) / iters


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


@check("slot_mapping", cuda_only=True)
def slot_mapping(ctx: CheckContext) -> dict[str, Any]:
    from warmcap.runner_v2.slot_mapping import compute_slot_mapping
    from warmcap.runner_v2.triton_slot_mapping import triton_slot_mapping

    dev = ctx.device
    gen = torch.Generator(device=dev).manual_seed(0)
    reqs, width, bs, num_tokens = 64, 128, 16, 4096
    table = torch.randint(1, 10_000, (reqs, width), dtype=torch.int32, device=dev, generator=gen)
    lens = torch.full((reqs,), num_tokens // reqs, dtype=torch.int32, device=dev)
    qsl = torch.zeros(reqs + 1, dtype=torch.int32, device=dev)
    qsl[1:] = torch.cumsum(lens, 0)
    starts = torch.randint(0, width * bs - num_tokens // reqs, (reqs,), device=dev, generator=gen)
    positions = (
        starts.repeat_interleave(lens.long()) + torch.arange(num_tokens, device=dev) % lens[0]
    ).long()
    ref = torch.empty(num_tokens + 128, dtype=torch.int64, device=dev)
    got = torch.empty_like(ref)
    torch_s = timed(ctx, lambda: compute_slot_mapping(table, qsl, positions, bs, ref), 50)
    triton_s = timed(ctx, lambda: triton_slot_mapping(table, qsl, positions, bs, got), 50)
    equal = bool(torch.equal(ref, got))
    return {
        "ok": equal,
        "equal": equal,
        "torch_us": torch_s * 1e6,
        "triton_us": triton_s * 1e6,
        "tokens": num_tokens,
        "summary": [f"triton == torch: {equal}; {triton_s * 1e6:.1f} us vs {torch_s * 1e6:.1f} us"],
    }


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
    run = run_startup(ctx.config(TP_CASE, tensor_parallel_size=2))
    startup_s = time.perf_counter() - t0
    try:
        two = [o.token_ids for o in run.engine.generate(prompts, [params] * len(prompts))]
    finally:
        run.engine.shutdown()
    one_engine = run_startup(ctx.config(TP_CASE)).engine
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
        run = run_startup(
            ctx.config(ctx.audit_case),
            backend=ctx.backend,
            capture_sizes=None if ctx.capture_sizes is None else list(ctx.capture_sizes),
            audit=audit,
        )
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


@check("host_syncs", cuda_only=True)
def host_syncs(ctx: CheckContext) -> dict[str, Any]:
    """Synchronising CUDA calls per decode step (``torch.cuda.set_sync_debug_mode``): one is the
    step's fetch of its tokens (``runner_v2/host_copy.py``); more means a host read crept back."""
    import warnings

    from warmcap.engine import LLMEngine
    from warmcap.graphs.startup import capture_graphs
    from warmcap.sampling_params import SamplingParams

    rows = []
    for spec in (None, "ngram:2"):
        case = EngineCase("smollm2-135m", "bfloat16", spec)
        engine = LLMEngine(ctx.config(case), startup_hooks=[])
        try:
            capture_graphs(engine.runner, engine.kv_cache_manager, backend=ctx.backend)
            params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            for prompt in ctx.prompts:
                engine.add_request(prompt, params)
            engine.step()  # prefill
            steps, syncs = 0, 0
            while engine.has_unfinished():
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    with warnings.catch_warnings(record=True) as seen:
                        warnings.simplefilter("always")
                        engine.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                syncs += sum("synchroniz" in str(w.message) for w in seen)
                steps += 1
        finally:
            engine.shutdown()
        rows.append({"engine": case.label, "steps": steps, "syncs": syncs, "per_step": syncs / max(steps, 1)})
    return {
        "ok": all(r["per_step"] <= 1.0 for r in rows),
        "engines": rows,
        "summary": [f"{r['engine']}: {r['per_step']:.2f} synchronising calls a decode step" for r in rows],
    }


def out_path(results: dict[str, Any], name: str = "gpu_check.json") -> str | None:
    """Write ``results`` as JSON into ``$OUT`` when it is set; the path written, else None."""
    import json
    from pathlib import Path

    out_dir = os.environ.get("OUT")
    if not out_dir:
        return None
    path = Path(out_dir) / name
    path.write_text(json.dumps(results, indent=2, default=str))
    return str(path)
