"""Device checks of the kernels that read the paged KV cache in place (registered into
:data:`warmcap.device_check.CHECKS` when imported; ``scripts/gpu_check.py`` and
``tests/test_device_check.py`` import it).

``paged_attention`` (CUDA): the Triton kernel compiled for real, and FlashInfer's wrappers when
importable, against the torch reference with NaN-poisoned unread positions, in a CUDA graph
replayed after a refill, timed at batch 1 and 512 tokens of context (target: <= 10 us a layer);
then two engines on the Triton backend through the engine check (capture, verify, generation
identical before and after capture).

``fused_ops`` (CUDA; its body runs on CPU under the Triton interpreter in
``tests/models/test_fused_ops.py``): the fused layer ops of ``models/fused_ops.py`` against torch's
ops, and one decode step of SmolLM2 bf16 with and without them: kernels a layer (target: <= 15)
and the greedy tokens of both.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from warmcap.core.reservation import block_aligned_len
from warmcap.device_check import CheckContext, EngineCase, check, check_engine, timed


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
        pages = [free.pop() for _ in range(block_aligned_len(seq, block_size) // block_size)]
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


def _attention_timing(
    ctx: CheckContext, name: str, backend: Any, *, context: int = 512, layers: int = 30
) -> dict[str, Any]:
    """Batch 1, ``context`` tokens, SmolLM2's attention shape (9 query heads, 3 KV, D 64, bf16), K/V
    write included: microseconds per call eagerly, and per layer inside one CUDA graph of ``layers``
    calls (launch overhead gone, as the runner's graphs run it)."""
    shape = dict(kv_heads=3, group=3, head_dim=64, block_size=16, window=None, dtype=torch.bfloat16)
    q, k, v, cache, meta = _paged_case(
        [(context - 1, 1)], device="cuda", columns=context // 16 + 1, seed=3, **shape
    )
    metas = {"g": meta}
    with torch.inference_mode():
        eager = timed(ctx, lambda: backend.forward(q, k, v, cache, meta, scale=0.125), 50)
        backend.prepare_for_capture(metas)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(layers):
                backend.forward(q, k, v, cache, meta, scale=0.125)
        backend.prepare_for_replay(metas)
        replay = timed(ctx, graph.replay, 20)
    per_layer = replay / layers * 1e6
    return {"backend": name, "context": context, "eager_us": eager * 1e6, "in_graph_us_per_layer": per_layer}


@check("paged_attention", cuda_only=True)
def paged_attention(ctx: CheckContext) -> dict[str, Any]:
    """See the module docstring."""
    equal = _attention_equal(ctx.device.type)
    graphs, timings = [], []
    for name, backend in _attention_backends(ctx.device.type).items():
        for run, into in (
            (lambda n, b: _attention_in_graph(n, b), graphs),
            (lambda n, b: _attention_timing(ctx, n, b), timings),
        ):
            try:
                into.append(run(name, backend))
            except Exception as exc:
                into.append({"backend": name, "ok": False, "error": repr(exc)})
    engines = []
    for case in (
        EngineCase("smollm2-135m", "bfloat16", "ngram:4"),
        EngineCase("tiny-llama", "float32", "eagle3:2"),
    ):
        try:
            e = check_engine(ctx, case, "triton")
            engines.append(
                {
                    k: e.get(k)
                    for k in ("model", "spec", "ok", "generation_identical", "real_rows_max_abs_diff")
                }
            )
        except Exception as exc:
            engines.append({"model": case.model, "spec": case.spec, "ok": False, "error": repr(exc)})
    summary = [f"{'PASS' if r.get('ok') else 'FAIL'} {json.dumps(r)}" for r in equal + graphs + engines]
    summary += [f"{'timing' if 'error' not in r else 'FAIL'} {json.dumps(r)}" for r in timings]
    ok = all(r["ok"] for r in equal + graphs + engines) and all("error" not in r for r in timings)
    return {
        "ok": ok,
        "equal": equal,
        "in_graph": graphs,
        "timing": timings,
        "engines": engines,
        "summary": summary,
    }


def fused_op_comparison(device: str = "cuda", model: str = "smollm2-135m") -> dict[str, Any]:
    """The fused layer ops (``models/fused_ops.py``) on ``device`` against torch's ops, and one eager
    decode step of ``model`` (bf16, batch 1) with them and without: kernels a layer (torch.profiler,
    CUDA) or ops a layer (CPU, ``op_count.py``), and the greedy tokens of both.

    Runs on CPU too, the kernels under ``TRITON_INTERPRET=1`` (``tests/models/test_fused_ops.py``
    calls it so), where it compares the interpreter's kernels and counts ops instead of kernels.
    ``ok``: every op within tolerance of torch and the fused step's greedy tokens equal torch's.
    """
    import torch.nn.functional as F

    from warmcap.engine import LLMEngine
    from warmcap.engine_args import build_config
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


@check("fused_ops", cuda_only=True)
def fused_ops(ctx: CheckContext) -> dict[str, Any]:
    """See the module docstring."""
    out = fused_op_comparison(ctx.device.type)
    steps = out["decode_step"]
    out["summary"] = [
        f"{label}: {s['kernels_per_layer']} kernels a layer, {s['ops_per_layer']} ops a layer"
        for label, s in steps.items()
    ] + [f"tokens identical: {out['tokens_identical']}"]
    return out
