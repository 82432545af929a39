"""Device checks of the paged-attention backends that read the KV cache in place.

``paged_attention`` (CUDA): the Triton kernel compiled for real, and FlashInfer's wrappers when
importable, against the torch reference with NaN-poisoned unread positions, in a CUDA graph
replayed after a refill, timed at batch 1 and 512 tokens of context (target: <= 10 us a layer);
then two engines on the Triton backend through the engine check (capture, verify, generation
identical before and after capture).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from warmcap.core.reservation import block_aligned_len
from warmcap.devtools.device_check.engines import check_engine
from warmcap.devtools.device_check.registry import CheckContext, EngineCase, check, timed


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
    from warmcap.kernels.triton.paged_attention import TritonPagedAttention
    from warmcap.runner_v2.attention.selector import flashinfer_available

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
