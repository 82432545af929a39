"""The GEMM floor of the throughput workload: only the linear layers of every step, nothing else.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_gemm_floor.py --threads 1 --rounds 3

``bench_throughput.py``'s workload (the first ``--num-prompts`` general prompts through the chat
template, ``--max-tokens`` new tokens each, greedy) runs as one prefill step over every prompt token
not served by the prefix cache, then ``max_tokens - 1`` decode steps of one row per prompt. This
script replays exactly the linear layers those steps run in warmcap: per layer the packed q/k/v
GEMM, ``o_proj``, the packed gate/up GEMM and ``down_proj``, then the LM head on one row per prompt;
with the model's own prepacked weights and kernel (``models/packed_linear.py``: the compiled GEMM
where it builds; ``WARMCAP_CPU_GEMM=torch`` gives oneDNN's, the kernel vLLM's CPU build also calls). Attention, norms, RoPE, activations, sampling and all host work are left out,
so the time is a floor for any engine doing this arithmetic with these kernels in float32.

It prints the floor in seconds and as tokens/s (generated tokens over the floor): no engine on these
kernels can exceed that rate, and a throughput goal above it needs less arithmetic, not less
overhead.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
from bench_throughput import DEFAULT_PROMPTS, load_prompts, prompt_ids, warmcap_llm


def linears_of(model: torch.nn.Module) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """Per layer, the products warmcap's forward computes, in order (one per group where packed),
    each with the width of the input it reads."""
    from warmcap.models.packed_linear import packed_group

    plan: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = packed_group(attn.q_proj, attn.k_proj, attn.v_proj)
        qkv_calls = [qkv.product] if qkv is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
        plan += [(call, attn.q_proj.in_features) for call in qkv_calls]
        plan.append((attn.o_proj, attn.o_proj.in_features))
        gate_up = packed_group(mlp.gate_proj, mlp.up_proj)
        gate_up_calls = [gate_up.product] if gate_up is not None else [mlp.gate_proj, mlp.up_proj]
        plan += [(call, mlp.gate_proj.in_features) for call in gate_up_calls]
        plan.append((mlp.down_proj, mlp.down_proj.in_features))
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefill only the tokens warmcap's prefix cache does not serve (its default, as in bench_throughput)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from warmcap.models.loader import load_tokenizer
    from warmcap.models.presets import resolve_model
    from warmcap.sampling_params import SamplingParams

    path = resolve_model(args.model)
    ids = prompt_ids(load_tokenizer(path), load_prompts(DEFAULT_PROMPTS, args.num_prompts), chat=True)
    llm = warmcap_llm(path, ids, args.max_tokens, eager=True, prefix_caching=args.prefix_caching)
    # The prefill's size as warmcap schedules it: every prompt token the prefix cache does not serve.
    llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    hits = llm.engine.kv_cache_manager.stats.prefix_cache_hits
    prefill_rows = sum(map(len, ids)) - hits
    model = llm.engine.model
    hidden = model.lm_head.in_features
    steps = [prefill_rows] + [len(ids)] * (args.max_tokens - 1)

    # One input per width and row count, made once: the timed loop is the GEMMs alone.
    inputs: dict[tuple[int, int], torch.Tensor] = {}

    def x(rows: int, width: int) -> torch.Tensor:
        key = (rows, width)
        if key not in inputs:
            inputs[key] = torch.randn(rows, width)
        return inputs[key]

    plan = linears_of(model)

    print(
        f"model {args.model}: {len(ids)} prompts, {sum(map(len, ids))} prompt tokens, "
        f"{hits} served by the prefix cache -> prefill of {prefill_rows} rows, then "
        f"{args.max_tokens - 1} decode steps of {len(ids)} rows; LM head on {len(ids)} rows per step; "
        f"{args.threads} thread(s)"
    )
    generated = len(ids) * args.max_tokens
    best = float("inf")
    with torch.inference_mode():
        for r in range(args.rounds):
            start = time.perf_counter()
            for rows in steps:
                for call, width in plan:
                    call(x(rows, width))
                model.lm_head(x(len(ids), hidden))
            seconds = time.perf_counter() - start
            best = min(best, seconds)
            load = " ".join(f"{v:.1f}" for v in os.getloadavg())
            print(
                f"round {r + 1} (load {load}): GEMMs {seconds:.2f} s = {generated / seconds:.1f} tokens/s at most"
            )
    print(f"best of {args.rounds}: GEMM floor {best:.2f} s, ceiling {generated / best:.1f} tokens/s")


if __name__ == "__main__":
    main()
