"""Device check of the fused layer ops (``models/fused_ops.py``).

``fused_ops`` (CUDA; its body runs on CPU under the Triton interpreter in
``tests/models/test_fused_ops.py``): the fused ops against torch's ops, and one decode step of
SmolLM2 bf16 with and without them: kernels a layer (target: <= 15) and the greedy tokens of both.
"""

from __future__ import annotations

from typing import Any

import torch

from warmcap.devtools.device_check.registry import CheckContext, check


def fused_op_comparison(device: str = "cuda", model: str = "smollm2-135m") -> dict[str, Any]:
    """The fused layer ops (``models/fused_ops.py``) on ``device`` against torch's ops, and one eager
    decode step of ``model`` (bf16, batch 1) with them and without: kernels a layer (torch.profiler,
    CUDA) or ops a layer (CPU, ``devtools/op_count.py``), and the greedy tokens of both.

    Runs on CPU too, the kernels under ``TRITON_INTERPRET=1`` (``tests/models/test_fused_ops.py``
    calls it so), where it compares the interpreter's kernels and counts ops instead of kernels.
    ``ok``: every op within tolerance of torch and the fused step's greedy tokens equal torch's.
    """
    import torch.nn.functional as F

    from warmcap.devtools.op_count import decode_step_ops
    from warmcap.engine import LLMEngine
    from warmcap.engine_args import build_config
    from warmcap.models.fused_ops import FusedGreedyHead, FusedOps, attach_fused_ops
    from warmcap.models.rope import apply_rope
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
            model,
            device=device,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=512,
            max_num_seqs=2,
            fused_ops="auto" if fused else "torch",
        )
        eng = LLMEngine(config, startup_hooks=[])
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
