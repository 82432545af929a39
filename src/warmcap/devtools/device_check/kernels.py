"""Checks of kernels and of the host's part in a step: the Triton slot mapping against torch, and
synchronising CUDA calls a decode step."""

from __future__ import annotations

from typing import Any

import torch

from warmcap.devtools.device_check.registry import CheckContext, EngineCase, check, timed


@check("slot_mapping", cuda_only=True)
def slot_mapping(ctx: CheckContext) -> dict[str, Any]:
    from warmcap.kernels.triton.slot_mapping import triton_slot_mapping
    from warmcap.runner_v2.slot_mapping import compute_slot_mapping

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


@check("async_scheduling")
def async_scheduling(ctx: CheckContext) -> dict[str, Any]:
    """One step in flight against the synchronous engine: greedy tokens identical, and decode
    tokens a second of each, with graphs captured. On CUDA async scheduling is the default (the
    host's scheduling and output work hide behind the forward), so the check also says whether
    the default engine took it."""
    import time
    from dataclasses import replace

    from warmcap.engine import LLMEngine
    from warmcap.graphs.startup import capture_graphs
    from warmcap.sampling_params import SamplingParams

    case = EngineCase("smollm2-135m", "bfloat16" if ctx.device.type == "cuda" else "float32")
    base = ctx.config(case)
    # Long enough on a GPU for a rate; the CPU dry run checks the tokens.
    new = ctx.max_tokens * (4 if ctx.device.type == "cuda" else 1)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    rows: dict[str, dict[str, Any]] = {}
    tokens: dict[str, list[list[int]]] = {}
    for name, value in (("default", None), ("sync", False), ("async", True)):
        config = replace(base, scheduler=replace(base.scheduler, async_scheduling=value))
        engine = LLMEngine(config, startup_hooks=[])
        try:
            capture_graphs(engine.runner, engine.kv_cache_manager, backend=ctx.backend)
            engine.generate(list(ctx.prompts[:1]), [params])  # warm the paths
            start = time.perf_counter()
            outs = engine.generate(list(ctx.prompts), [params] * len(ctx.prompts))
            seconds = time.perf_counter() - start
            tokens[name] = [o.token_ids for o in outs]
            rows[name] = {
                "async_scheduling": bool(engine.config.scheduler.async_scheduling),
                "tokens_per_s": sum(map(len, tokens[name])) / seconds,
            }
        finally:
            engine.shutdown()
    identical = tokens["sync"] == tokens["async"] == tokens["default"]
    default_async = rows["default"]["async_scheduling"]
    ratio = rows["async"]["tokens_per_s"] / rows["sync"]["tokens_per_s"]
    return {
        "ok": identical and default_async == (ctx.device.type == "cuda"),
        "tokens_identical": identical,
        "default_is_async": default_async,
        "async_over_sync": ratio,
        "engines": rows,
        "summary": [
            f"{case.label}: tokens identical {identical}; default async {default_async}; "
            f"async {rows['async']['tokens_per_s']:.0f} tok/s vs sync {rows['sync']['tokens_per_s']:.0f} "
            f"({ratio:.2f}x)"
        ],
    }
