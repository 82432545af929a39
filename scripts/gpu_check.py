"""GPU validation of warmcap's graph path: run on a CUDA machine, record the results with a date.

For tiny-llama (plain, ngram, draft_model, eagle3, dflash), smollm2-135m (plain, draft_model; and
draft_model with batch-invariant GEMMs), tiny-deepseek-v3 (plain, mtp), tiny-deepseek-v32 and
tiny-hybrid (ngram, draft_model@self), on the torch attention backend and on FlashInfer when
importable:
- build the engine, capture every target graph and every drafter graph (draft_prefill,
  draft_decode) with the ``cuda`` backend, verify each (I4);
- time graph replay vs the eager forward on the same static inputs (ratio) for target decode,
  mixed, draft_decode and draft_prefill graphs; per graph capture time and memory (free-memory
  delta);
- greedy generation before and after capture must be token-identical, target graphs must be
  replayed, and drafter graphs too when the drafter has any;
then compare the Triton slot-mapping kernel, compiled for real, with the torch reference.
With two or more GPUs, tensor parallelism: ``warmup run`` at TP=2 over NCCL (both ranks audited and
every graph verified on both) and greedy TP=2 output against TP=1; skipped, with the reason
printed, on fewer than two GPUs.

Prints a summary; writes ``gpu_check.json`` into ``$OUT`` when that is set. Exit code 0 when every
check passed, 1 when any failed, 2 when there is no CUDA device.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ENGINES: list[tuple[str, str, str | None]] = [
    # (model preset, dtype, speculative spec)
    ("tiny-llama", "float32", None),
    ("tiny-llama", "float32", "ngram:2"),
    ("tiny-llama", "float32", "draft_model:2"),
    ("tiny-llama", "float32", "eagle3:2"),
    ("tiny-llama", "float32", "dflash:2"),
    ("smollm2-135m", "bfloat16", None),
    ("smollm2-135m", "bfloat16", "draft_model:2"),
    # MLA + MoE, sparse MLA, Mamba hybrid: graph-safe on CPU's fake-tensor check (static expert
    # loop, per-batch MLA path, batched uniform Mamba path); the cuda plan leaves the hybrid's
    # ragged passes (mixed, Mamba draft prefill) eager. Any failure is reported per engine.
    ("tiny-deepseek-v3", "float32", None),
    ("tiny-deepseek-v3", "float32", "mtp:2"),
    ("tiny-deepseek-v32", "float32", None),
    ("tiny-hybrid", "float32", "ngram:2"),
    ("tiny-hybrid", "float32", "draft_model:2@self"),
]
#: engines run with fixed-shape GEMM tiles (ModelConfig.batch_invariant): real rows of every graph
#: should then match the unpadded eager batch far tighter than the default GPU tolerance
BATCH_INVARIANT_ENGINES: list[tuple[str, str, str | None]] = [("smollm2-135m", "float32", "draft_model:2")]
#: Mamba state caching mode for the hybrid preset (none, all or align).
MAMBA_MODE = os.environ.get("WARMCAP_MAMBA_MODE", "none")
PROMPTS = ["The capital of France is", "Count: one, two, three,", "def add(a, b):", "Once upon a time"]
TIMING_ITERS = 20


def _timed(fn: Any, iters: int) -> float:
    """Mean seconds per call after one warm call, synchronised."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _replay_vs_eager(capturer: Any, graphs: list[Any]) -> list[dict[str, Any]]:
    """Replay and eager forward timings on the same (padding-only) static inputs: the largest and
    smallest graph of each phase (decode, mixed, draft_decode, draft_prefill)."""
    out = []
    by_phase: dict[str, list[Any]] = {}
    for g in graphs:
        by_phase.setdefault(g.spec.phase, []).append(g)  # largest first within a phase
    picks = {id(g): g for gs in by_phase.values() for g in (gs[:1] + gs[-1:])}.values()
    with torch.inference_mode():
        for g in picks:
            capturer.load(g.spec)
            replay = _timed(g.replay_fn, TIMING_ITERS)
            eager = _timed(lambda g=g: capturer.eager(g.spec, g.metas), TIMING_ITERS)
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


def check_engine(
    model: str, dtype: str, spec: str | None, attn: str, *, batch_invariant: bool = False
) -> dict[str, Any]:
    from rich.console import Console

    from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
    from warmcap.engine import LLMEngine
    from warmcap.graphs.render import render
    from warmcap.graphs.report import SpecInfo
    from warmcap.graphs.startup import capture_graphs
    from warmcap.sampling_params import SamplingParams

    config = EngineConfig(
        model=ModelConfig(
            model=model, dtype=dtype, device="cuda", batch_invariant=batch_invariant, attention_backend=attn
        ),
        cache=CacheConfig(block_size=16, num_blocks=1024, mamba_cache_mode=MAMBA_MODE),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512),
        speculative=SpeculativeConfig.parse(spec),
    )
    t0 = time.perf_counter()
    engine = LLMEngine(config, startup_hooks=[])
    load_s = time.perf_counter() - t0
    runner = engine.runner
    params = [SamplingParams(temperature=0.0, max_tokens=24) for _ in PROMPTS]
    before = [o.token_ids for o in engine.generate(PROMPTS, params)]

    startup = capture_graphs(runner, engine.kv_cache_manager, backend="cuda")
    timings = _replay_vs_eager(startup.capturer, startup.result.graphs)

    after = [o.token_ids for o in engine.generate(PROMPTS, params)]
    replays = sum(startup.graph_runner.replays.values())
    draft_replays = sum(startup.graph_runner.draft_replays.values())
    has_draft_graphs = any(g.spec.subject == "drafter" for g in startup.result.graphs)
    k = config.num_speculative_tokens
    report = startup.report(
        model=model,
        device=torch.cuda.get_device_name(),
        spec=SpecInfo(config.speculative.method if config.speculative else None, k),
        timings={"load": load_s},
    )
    render(report, Console())
    notes = []
    if replays == 0:
        notes.append("generation did not replay any target graph")
    if has_draft_graphs and draft_replays == 0:
        notes.append("generation did not replay any drafter graph")
    ok = (
        report.totals.all_verified
        and before == after
        and replays > 0
        and (draft_replays > 0 or not has_draft_graphs)
    )
    return {
        "model": model,
        "dtype": dtype,
        "spec": spec,
        "attention": attn,
        "batch_invariant": batch_invariant,
        "ok": ok,
        "real_rows_max_abs_diff": max(
            (g.real_rows_max_abs_diff for g in report.graphs if g.real_rows_max_abs_diff is not None),
            default=None,
        ),
        "generation_identical": before == after,
        "graph_replays_during_generation": replays,
        "draft_graph_replays_during_generation": draft_replays,
        "replay_vs_eager": timings,
        "report": report.to_dict(),
        "notes": notes,
    }


def check_slot_mapping() -> dict[str, Any]:
    from warmcap.runner_v2.slot_mapping import compute_slot_mapping
    from warmcap.runner_v2.triton_slot_mapping import triton_slot_mapping

    gen = torch.Generator(device="cuda").manual_seed(0)
    reqs, width, bs, num_tokens = 64, 128, 16, 4096
    table = torch.randint(1, 10_000, (reqs, width), dtype=torch.int32, device="cuda", generator=gen)
    lens = torch.full((reqs,), num_tokens // reqs, dtype=torch.int32, device="cuda")
    qsl = torch.zeros(reqs + 1, dtype=torch.int32, device="cuda")
    qsl[1:] = torch.cumsum(lens, 0)
    starts = torch.randint(0, width * bs - num_tokens // reqs, (reqs,), device="cuda", generator=gen)
    positions = (
        starts.repeat_interleave(lens.long()) + torch.arange(num_tokens, device="cuda") % lens[0]
    ).long()
    ref = torch.empty(num_tokens + 128, dtype=torch.int64, device="cuda")
    got = torch.empty_like(ref)
    torch_s = _timed(lambda: compute_slot_mapping(table, qsl, positions, bs, ref), 50)
    triton_s = _timed(lambda: triton_slot_mapping(table, qsl, positions, bs, got), 50)
    equal = bool(torch.equal(ref, got))
    return {
        "ok": equal,
        "equal": equal,
        "torch_us": torch_s * 1e6,
        "triton_us": triton_s * 1e6,
        "tokens": num_tokens,
    }


#: the TP=2 check: (model preset, dtype, speculative spec)
TP_ENGINE: tuple[str, str, str | None] = ("smollm2-135m", "float32", "draft_model:2")


def check_tensor_parallel() -> dict[str, Any]:
    """TP=2 over NCCL, one GPU per rank: start-up report rows for both ranks, greedy TP=2 == TP=1."""
    count = torch.cuda.device_count()
    if count < 2:
        reason = f"{count} CUDA device visible; tensor parallelism at TP=2 needs 2"
        print(f"tensor parallel: skipped ({reason})")
        return {"ok": True, "skipped": reason}
    from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
    from warmcap.sampling_params import SamplingParams
    from warmcap.startup import run_startup

    model, dtype, spec = TP_ENGINE
    params = SamplingParams(temperature=0.0, max_tokens=24)

    def config(tp: int) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, device="cuda"),
            cache=CacheConfig(block_size=16, num_blocks=1024),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512),
            speculative=SpeculativeConfig.parse(spec),
            tensor_parallel_size=tp,
        )

    t0 = time.perf_counter()
    run = run_startup(config(2), audit=True)
    startup_s = time.perf_counter() - t0
    try:
        two = [o.outputs[0].token_ids for o in run.engine.generate(PROMPTS, [params] * len(PROMPTS))]
    finally:
        run.engine.shutdown()
    one_engine = run_startup(config(1), audit=True).engine
    one = [o.outputs[0].token_ids for o in one_engine.generate(PROMPTS, [params] * len(PROMPTS))]
    ranks = [
        {
            "rank": r.rank,
            "violations": r.warmup_audit.violations,
            "verified": f"{r.graphs_verified}/{r.graphs}",
        }
        for r in run.report.ranks
    ]
    ranks_ok = len(ranks) == 2 and all(r.ok for r in run.report.ranks)
    same = sum(a == b for a, b in zip(one, two, strict=True))
    print(f"tensor parallel: ranks {ranks}, greedy TP=2 == TP=1 for {same}/{len(PROMPTS)} prompts")
    return {
        "ok": ranks_ok and same == len(PROMPTS),
        "model": model,
        "spec": spec,
        "startup_s": startup_s,
        "ranks": ranks,
        "greedy_identical": same,
        "prompts": len(PROMPTS),
    }


def main() -> int:
    if not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available here (torch.cuda.is_available() is False); "
            "run this script on a CUDA machine. Nothing was checked."
        )
        return 2
    from warmcap.runner_v2.attention.selector import flashinfer_available

    attns = ["torch", *(["flashinfer"] if flashinfer_available() else [])]
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flashinfer": "flashinfer" in attns,
        "engines": [],
    }
    runs = [(*e, False) for e in ENGINES] + [(*e, True) for e in BATCH_INVARIANT_ENGINES]
    for model, dtype, spec, invariant in runs:
        for attn in attns:
            name = f"{model} {dtype} spec={spec} attention={attn} batch_invariant={invariant}"
            print(f"\n=== {name}", flush=True)
            try:
                results["engines"].append(check_engine(model, dtype, spec, attn, batch_invariant=invariant))
            except Exception as exc:
                traceback.print_exc()
                results["engines"].append(
                    {"model": model, "spec": spec, "attention": attn, "ok": False, "error": repr(exc)}
                )
            torch.cuda.empty_cache()
    try:
        results["slot_mapping"] = check_slot_mapping()
    except Exception as exc:
        traceback.print_exc()
        results["slot_mapping"] = {"ok": False, "error": repr(exc)}

    print("\n=== tensor parallel", flush=True)
    try:
        results["tensor_parallel"] = check_tensor_parallel()
    except Exception as exc:
        traceback.print_exc()
        results["tensor_parallel"] = {"ok": False, "error": repr(exc)}

    print("\n=== summary")
    for e in results["engines"]:
        line = f"{'PASS' if e['ok'] else 'FAIL'}  {e['model']} spec={e['spec']} attention={e['attention']}"
        if "error" in e:
            line += f"  error: {e['error']}"
        else:
            graphs = e["report"]["totals"]
            line += (
                f"  graphs={graphs['count']} verified={graphs['all_verified']} capture={graphs['seconds']:.2f}s "
                f"memory={graphs['bytes'] / 2**20:.1f}MiB generation_identical={e['generation_identical']} "
                f"replays={e['graph_replays_during_generation']} "
                f"draft_replays={e['draft_graph_replays_during_generation']} "
                f"real_rows_max_diff={e['real_rows_max_abs_diff']} batch_invariant={e['batch_invariant']}"
            )
            for t in e["replay_vs_eager"]:
                line += (
                    f"\n      {t['graph']}: replay {t['replay_ms']:.3f} ms vs eager {t['eager_ms']:.3f} ms"
                )
                line += f" (x{t['speedup']:.1f})" if t["speedup"] else ""
        print(line)
    sm = results["slot_mapping"]
    print(f"{'PASS' if sm['ok'] else 'FAIL'}  triton slot mapping vs torch: {json.dumps(sm)}")
    tp = results["tensor_parallel"]
    print(f"{'PASS' if tp['ok'] else 'FAIL'}  tensor parallel TP=2: {json.dumps(tp)}")

    out_dir = os.environ.get("OUT")
    if out_dir:
        path = Path(out_dir) / "gpu_check.json"
        path.write_text(json.dumps(results, indent=2))
        print(f"wrote {path}")
    all_ok = all(e["ok"] for e in results["engines"]) and sm["ok"] and tp["ok"]
    return 0 if all_ok else 1


def check_fused_ops(device: str = "cuda", model: str = "smollm2-135m") -> dict[str, Any]:
    """The fused layer ops (``models/fused_ops.py``) on ``device`` against torch's ops, and one eager
    decode step of ``model`` (bf16, batch 1) with them and without: kernels a layer (torch.profiler,
    CUDA) or ops a layer (CPU, ``op_count.py``), and the greedy tokens of both.

    Self-contained (issue 27, helper ``fused``); ``main`` may record it as ``results["fused_ops"]``.
    Runs on CPU too, the kernels under ``TRITON_INTERPRET=1`` (``tests/models/test_fused_ops.py``
    calls it so), where it compares the interpreter's kernels and counts ops instead of kernels.
    ``ok``: every op within tolerance of torch and the fused step's greedy tokens equal torch's.
    """
    import torch.nn.functional as F

    from warmcap.engine import LLMEngine
    from warmcap.llm import build_config
    from warmcap.models.fused_ops import FusedGreedyHead, FusedOps, attach_fused_ops
    from warmcap.models.rope import apply_rope
    from warmcap.op_count import decode_step_ops
    from warmcap.runner_v2.attention.torch_paged import write_kv
    from warmcap.sampling_params import SamplingParams

    dev = torch.device(device)
    ops = FusedOps(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    out: dict[str, Any] = {"device": device, "model": model, "ops": {}}

    def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    def diff(a: torch.Tensor | None, b: torch.Tensor) -> float:
        # None: the op refused the tensors (torch's ops would run): a failure here.
        return float("inf") if a is None else float((a.float() - b.float()).abs().max())

    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        # bf16 GPU rounding is to nearest, as torch's; the interpreter on CPU truncates.
        tol = 2**-6 if dtype == torch.bfloat16 else 1e-5
        rows, hidden, inter = 7, 576, 1536
        x, delta = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype)
        w = randn(hidden, dtype=dtype).abs() + 0.5
        ref = w * F.rms_norm(x.float(), (hidden,), eps=1e-5).to(dtype)
        ref_sum = x + delta
        ref_res = w * F.rms_norm(ref_sum.float(), (hidden,), eps=1e-5).to(dtype)
        got_sum, got_res = ops.add_rms_norm(x, delta, w, 1e-5) or (None, None)
        gate, up = randn(rows, inter, dtype=dtype), randn(rows, inter, dtype=dtype)
        t, hq, hkv, d, bs = 5, 9, 3, 64, 16
        q, k, v = randn(t, hq, d, dtype=dtype), randn(t, hkv, d, dtype=dtype), randn(t, hkv, d, dtype=dtype)
        ang = torch.rand(t, d // 2, generator=gen, device=dev) * 6.3
        cos, sin = (
            torch.cat((ang.cos(), ang.cos()), -1).to(dtype),
            torch.cat((ang.sin(), ang.sin()), -1).to(dtype),
        )
        slots = torch.tensor([17, 3, -1, 40, 63], device=dev)
        cache = torch.zeros(2, 5, bs, hkv, d, dtype=dtype, device=dev)
        want_cache = cache.clone()
        want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(want_cache, want_k, v, slots)
        q2, k2 = q.clone(), k.clone()
        wrote = ops.rope_write_kv(q2, k2, v, cos, sin, cache, slots)
        logits = randn(4, 49152, dtype=dtype)
        logits[2, 100] = logits[2, 30000] = 1e4
        diffs = {
            "rms_norm": diff(ops.rms_norm(x, w, 1e-5), ref),
            "add_rms_norm_sum": diff(got_sum, ref_sum),
            "add_rms_norm": diff(got_res, ref_res),
            "silu_mul": diff(ops.silu_mul(gate, up), F.silu(gate) * up),
            "rope_q": diff(q2, want_q),
            "rope_k": diff(k2, want_k),
            "kv_cache": diff(cache, want_cache) if wrote else float("inf"),
        }
        ids = ops.greedy_argmax(logits)
        argmax_equal = ids is not None and bool(torch.equal(ids, logits.float().argmax(-1)))
        out["ops"][name] = {
            "max_abs_diff": diffs,
            "greedy_argmax_equal": argmax_equal,
            "ok": argmax_equal and all(v <= tol * 8 for v in diffs.values()),
        }

    def engine(fused: bool) -> LLMEngine:
        config = build_config(
            model, device=device, dtype="bfloat16", enforce_eager=True, max_model_len=512, max_num_seqs=2
        )
        before = os.environ.get("WARMCAP_FUSED_OPS")
        os.environ["WARMCAP_FUSED_OPS"] = "auto" if fused else "torch"
        try:
            eng = LLMEngine(config, startup_hooks=[])
        finally:
            if before is None:
                os.environ.pop("WARMCAP_FUSED_OPS")
            else:
                os.environ["WARMCAP_FUSED_OPS"] = before
        has_ops = getattr(eng.runner.model.model.norm, "fused_ops", None) is not None
        if fused and not has_ops:
            # CPU: the loader attaches no fused ops there; the interpreter runs them for this check.
            attach_fused_ops(eng.runner.model, ops)
            if type(eng.runner.model.lm_head) is torch.nn.Linear:
                eng.runner.greedy_head = FusedGreedyHead(eng.runner.model.lm_head, ops)
        return eng

    prompt = {"prompt_token_ids": [(7 * i + 3) % 1000 + 10 for i in range(32)]}
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)]
    steps: dict[str, Any] = {}
    tokens: dict[str, list[int]] = {}
    for label, fused in (("torch", False), ("fused", True)):
        eng = engine(fused)
        counts = decode_step_ops(eng, prompt["prompt_token_ids"])
        tokens[label] = list(eng.generate([prompt], params)[0].outputs[0].token_ids)
        steps[label] = {
            "ops_per_layer": counts.per_layer,
            "ops_per_layer_outside_attention": counts.per_layer_outside_attention,
            "kernels_per_step": counts.kernels,
            "kernels_per_layer": counts.kernels_per_layer,
            "greedy_head": type(eng.runner.greedy_head).__name__,
        }
        del eng
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out["decode_step"] = steps
    out["tokens_identical"] = tokens["torch"] == tokens["fused"]
    if dev.type == "cuda":
        out["kernels_per_layer_target_15_met"] = steps["fused"]["kernels_per_layer"] <= 15
    out["ok"] = all(r["ok"] for r in out["ops"].values()) and out["tokens_identical"]
    return out


if __name__ == "__main__":
    sys.exit(main())
