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
then compare the Triton slot-mapping kernel, compiled for real, with the torch reference, and the
paged-attention backends that read pages in place (Triton; FlashInfer's wrappers when importable)
with the torch reference, in a CUDA graph and timed (:func:`check_paged_attention`).
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
    from warmcap.graphs.proof.render import render
    from warmcap.graphs.proof.report import SpecInfo
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

    print("\n=== paged attention (Triton, FlashInfer when importable)", flush=True)
    try:
        results["paged_attention"] = check_paged_attention()
    except Exception as exc:
        traceback.print_exc()
        results["paged_attention"] = {"ok": False, "error": repr(exc)}

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
    pa = results["paged_attention"]
    print(f"{'PASS' if pa['ok'] else 'FAIL'}  paged attention (Triton, FlashInfer): see the rows above")
    all_ok = all(e["ok"] for e in results["engines"]) and sm["ok"] and tp["ok"] and pa["ok"]
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())


def _paged_case(
    rows: list[tuple[int, int]],
    *,
    kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    window: int | None,
    dtype: torch.dtype,
    device: str,
    columns: int,
    seed: int,
) -> tuple[Any, ...]:
    """One step over a paged cache, ``rows`` of (computed, scheduled) tokens: pages shuffled, the
    cache NaN everywhere but the positions a query may see (and the slots the step writes), the
    table ``columns`` wide as a graph's static buffers are (``graph_bounds`` metadata)."""
    from warmcap.contracts import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    hq = kv_heads * group
    num_blocks = len(rows) * columns + 2
    cache = torch.full((2, num_blocks + 1, block_size, kv_heads, head_dim), float("nan"))
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(rows), columns, dtype=torch.int32)
    flat = cache.view(2, -1, kv_heads, head_dim)
    slots, qsl, seq_lens = [], [0], []
    for r, (computed, scheduled) in enumerate(rows):
        seq = computed + scheduled
        pages = [free.pop() for _ in range(-(-seq // block_size))]
        first_visible = 0 if window is None else max(0, computed - window + 1)
        table[r, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        pos = torch.arange(seq)
        where = torch.tensor(pages, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
        visible = where[first_visible:computed]
        flat[:, visible] = torch.randn(2, len(visible), kv_heads, head_dim, generator=gen)
        slots.append(where[computed:])
        qsl.append(qsl[-1] + scheduled)
        seq_lens.append(seq)
    t = qsl[-1]
    qsl_t, seq_t = torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_tokens=t,
        num_reqs=len(rows),
        query_start_loc=qsl_t.to(device),
        seq_lens=seq_t.to(device),
        block_table=table.to(device),
        slot_mapping=torch.cat(slots).long().to(device),
        max_query_len=max(s for _, s in rows),
        max_seq_len=columns * block_size,
        block_size=block_size,
        query_start_loc_cpu=qsl_t,
        seq_lens_cpu=seq_t,
        graph_bounds=True,
    )
    qkv = torch.randn(t, hq + 2 * kv_heads, head_dim, generator=gen).to(device, dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + kv_heads], qkv[:, hq + kv_heads :]
    return q, k, v, cache.to(device, dtype), meta


#: (name, rows, window): decode, the 1 + k verify query, a prefill chunk, a sliding window
ATTENTION_CASES: list[tuple[str, list[tuple[int, int]], int | None]] = [
    ("decode", [(511, 1), (37, 1), (300, 1), (0, 1)], None),
    ("verify 1+4", [(100, 5), (260, 5), (7, 5)], None),
    ("prefill chunk", [(0, 40), (64, 33)], None),
    ("verify window 64", [(200, 5), (90, 5)], 64),
]


def _attention_backends(device: str) -> dict[str, Any]:
    from warmcap.runner_v2.attention.selector import flashinfer_available
    from warmcap.runner_v2.attention.triton_paged import TritonPagedAttention

    backends: dict[str, Any] = {"triton": TritonPagedAttention()}
    if device == "cuda" and flashinfer_available():
        from warmcap.runner_v2.attention.flashinfer import FlashInferAttention

        backends["flashinfer"] = FlashInferAttention(torch.device(device))
    return backends


def _attention_equal(device: str = "cuda") -> list[dict[str, Any]]:
    """Every backend against the torch reference (gather + SDPA in float32) on each case, float32
    and bfloat16 (FlashInfer: bfloat16 only); NaN anywhere in an output means a masked read leaked."""
    from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention

    reference = TorchPagedAttention(batch_invariant=True)
    rows_out = []
    for name, backend in _attention_backends(device).items():
        for dtype in (torch.float32, torch.bfloat16):
            if name == "flashinfer" and dtype == torch.float32:
                continue
            for case, rows, window in ATTENTION_CASES:
                q, k, v, cache, meta = _paged_case(
                    rows, kv_heads=3, group=3, head_dim=64, block_size=16, window=window,
                    dtype=dtype, device=device, columns=40, seed=len(rows_out),
                )  # fmt: skip
                want = reference.forward(
                    q.float(), k.float(), v.float(), cache.float(), meta, scale=0.125, sliding_window=window
                )
                got = backend.forward(q, k, v, cache, meta, scale=0.125, sliding_window=window).float()
                diff = float((got - want).abs().max())
                tol = 1e-4 if dtype == torch.float32 else 3e-2
                ok = bool(torch.isfinite(got).all()) and diff <= tol
                rows_out.append(
                    {"backend": name, "dtype": str(dtype), "case": case, "max_abs_diff": diff, "ok": ok}
                )
    return rows_out


def _attention_in_graph(name: str, backend: Any) -> dict[str, Any]:
    """One CUDA graph of a decode step over static metadata, replayed after its lengths, tables and
    slots were refilled in place for another batch of the same shape: equal to eager on that batch."""
    shape = dict(kv_heads=3, group=3, head_dim=64, block_size=16, window=None, dtype=torch.bfloat16)
    first = _paged_case([(40, 1), (300, 1)], device="cuda", columns=40, seed=1, **shape)
    second = _paged_case([(410, 1), (9, 1)], device="cuda", columns=40, seed=2, **shape)
    q, k, v, cache, meta = first
    metas = {"g": meta}
    with torch.inference_mode():
        backend.forward(q, k, v, cache, meta, scale=0.125)  # compile / plan eagerly first
        backend.prepare_for_capture(metas)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend.forward(q, k, v, cache, meta, scale=0.125)
        q2, k2, v2, cache2, meta2 = second
        for name_ in (
            "query_start_loc",
            "seq_lens",
            "block_table",
            "slot_mapping",
            "query_start_loc_cpu",
            "seq_lens_cpu",
        ):
            getattr(meta, name_).copy_(getattr(meta2, name_))
        q.copy_(q2)
        k.copy_(k2)
        v.copy_(v2)
        cache.copy_(cache2)
        backend.prepare_for_replay(metas)
        graph.replay()
        torch.cuda.synchronize()
        want = backend.forward(q2, k2, v2, cache2.clone(), meta2, scale=0.125)
    diff = float((out.float() - want.float()).abs().max())
    return {"backend": name, "case": "graph replay after refill", "max_abs_diff": diff, "ok": diff <= 1e-2}


def _attention_timing(name: str, backend: Any, *, context: int = 512, layers: int = 30) -> dict[str, Any]:
    """Batch 1, ``context`` tokens, SmolLM2's attention shape (9 query heads, 3 KV, D 64, bf16), K/V
    write included: microseconds per call eagerly, and per layer inside one CUDA graph of ``layers``
    calls (launch overhead gone, as the runner's graphs run it)."""
    shape = dict(kv_heads=3, group=3, head_dim=64, block_size=16, window=None, dtype=torch.bfloat16)
    q, k, v, cache, meta = _paged_case(
        [(context - 1, 1)], device="cuda", columns=context // 16 + 1, seed=3, **shape
    )
    metas = {"g": meta}
    with torch.inference_mode():
        eager = _timed(lambda: backend.forward(q, k, v, cache, meta, scale=0.125), 50)
        backend.prepare_for_capture(metas)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(layers):
                backend.forward(q, k, v, cache, meta, scale=0.125)
        backend.prepare_for_replay(metas)
        replay = _timed(graph.replay, 20)
    per_layer = replay / layers * 1e6
    return {"backend": name, "context": context, "eager_us": eager * 1e6, "in_graph_us_per_layer": per_layer}


def check_paged_attention() -> dict[str, Any]:
    """The paged-attention backends that read pages in place on CUDA (Triton, compiled for real;
    FlashInfer's decode / prefill wrappers when importable) against the torch reference with
    NaN-poisoned unread positions, in a CUDA graph replayed after a refill, timed at batch 1 and 512
    tokens of context (acceptance: <= 10 us a layer); then two engines on the Triton backend through
    :func:`check_engine` (capture, verify, generation identical before and after capture)."""
    equal = _attention_equal("cuda")
    graphs, timings = [], []
    for name, backend in _attention_backends("cuda").items():
        for check, into in ((_attention_in_graph, graphs), (_attention_timing, timings)):
            try:
                into.append(check(name, backend))
            except Exception as exc:
                traceback.print_exc()
                into.append({"backend": name, "ok": False, "error": repr(exc)})
    engines = []
    for model, dtype, spec in (
        ("smollm2-135m", "bfloat16", "ngram:4"),
        ("tiny-llama", "float32", "eagle3:2"),
    ):
        try:
            e = check_engine(model, dtype, spec, "triton")
            engines.append(
                {k: e[k] for k in ("model", "spec", "ok", "generation_identical", "real_rows_max_abs_diff")}
            )
        except Exception as exc:
            traceback.print_exc()
            engines.append({"model": model, "spec": spec, "ok": False, "error": repr(exc)})
    for row in equal + graphs + engines:
        print(f"{'PASS' if row.get('ok') else 'FAIL'}  paged attention: {json.dumps(row)}")
    for row in timings:
        print(f"{'    ' if 'error' not in row else 'FAIL'}  paged attention timing: {json.dumps(row)}")
    ok = all(r["ok"] for r in equal + graphs + engines) and all("error" not in r for r in timings)
    return {"ok": ok, "equal": equal, "in_graph": graphs, "timing": timings, "engines": engines}
