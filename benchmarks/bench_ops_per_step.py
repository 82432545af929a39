"""Ops per decode step and per decoder layer: the CPU proxy for CUDA kernels a step (issue 27).

    HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 .venv/bin/python benchmarks/bench_ops_per_step.py \\
        --model smollm2-135m --dtype bfloat16

Counts (``src/warmcap/devtools/op_count.py``) one eager decode step at batch 1, two ways on the same model:

- ``torch``: the path CUDA runs without the fused ops, with the compiled CPU kernels switched off
  (``WARMCAP_CPU_LAYER_OPS``/``GEMM``/``ATTENTION=torch``: plain ``nn.Linear``, torch RoPE and
  norms, gather + SDPA attention);
- ``fused``: the same with the fused Triton ops of ``models/fused_ops.py`` attached (and the
  greedy head they give), run by Triton's interpreter on CPU (which is why ``TRITON_INTERPRET=1``
  must be set).

and, with ``--cpu-default``, the CPU's own default path (compiled kernels on; ops they run through
ctypes are not seen by the profiler, so it reads low). Prints ops per step, per layer, per layer
outside the attention backend, and the commonest ops inside the layers.
"""

from __future__ import annotations

import argparse
import os

import torch

from warmcap.devtools.op_count import OpCounts, decode_step_ops
from warmcap.engine import LLMEngine
from warmcap.llm import build_config

_TORCH_PATH = {
    "WARMCAP_CPU_LAYER_OPS": "torch",
    "WARMCAP_CPU_GEMM": "torch",
    "WARMCAP_CPU_ATTENTION": "torch",
}


def engine(model: str, dtype: str) -> LLMEngine:
    config = build_config(
        model, device="cpu", dtype=dtype, enforce_eager=True, max_model_len=512, max_num_seqs=4
    )
    return LLMEngine(config, startup_hooks=[])


def with_fused(eng: LLMEngine) -> LLMEngine:
    """``eng`` with the fused ops attached as the loader attaches them on CUDA, the greedy head
    rebuilt as the runner builds it (``FusedGreedyHead`` for a plain bf16 head)."""
    from warmcap.models.fused_ops import FusedOps, attach_fused_ops

    model = eng.runner.model
    attach_fused_ops(model, FusedOps(torch.device("cpu")))
    eng.runner.greedy_head = model.greedy_head()
    return eng


def row(name: str, c: OpCounts) -> str:
    return (
        f"{name:<12} {c.total:>8} {c.per_layer:>10.1f} {c.per_layer_outside_attention:>15.1f} "
        f"{(c.in_attention / max(c.num_layers, 1)):>15.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--cpu-default", action="store_true", help="also count the CPU default path")
    parser.add_argument("--top", type=int, default=12, help="in-layer ops listed per path")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("set TRITON_INTERPRET=1 before running: the fused path runs Triton's interpreter on CPU")
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(args.prompt_len)]
    results: dict[str, OpCounts] = {}
    if args.cpu_default:
        results["cpu-default"] = decode_step_ops(engine(args.model, args.dtype), prompt)
    os.environ.update(_TORCH_PATH)
    results["torch"] = decode_step_ops(engine(args.model, args.dtype), prompt)
    results["fused"] = decode_step_ops(with_fused(engine(args.model, args.dtype)), prompt)
    layers = results["torch"].num_layers
    print(f"{args.model} {args.dtype}: one decode step at batch 1, {layers} decoder layers")
    print(f"{'path':<12} {'ops/step':>8} {'ops/layer':>10} {'non-attn/layer':>15} {'attn/layer':>15}")
    for name, c in results.items():
        print(row(name, c))
    for name, c in results.items():
        top = ", ".join(
            f"{op} {n / max(c.num_layers, 1):g}" for op, n in c.by_op_in_layers.most_common(args.top)
        )
        print(f"\n{name}, per layer: {top}")


if __name__ == "__main__":
    main()
