"""Speculative decoding: ngram (prompt lookup) vs no speculation, same prompts, same weights, same run.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_spec.py [--spec ngram:4] [--max-tokens 64]

Greedy with ``ignore_eos`` on the ``repetitive`` prompts of the shared workload (chat template on):
both engines generate exactly ``max_tokens`` per prompt, and their tokens must be identical (I5).
Each engine runs one short warm-up request; timed runs are one call over all prompts, engines
interleaved over ``--rounds`` rounds, best round reported. Prints tokens/s of each, their ratio and
the speculative engine's acceptance length.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "bench_prompts.jsonl"


def load_prompts(path: Path, kind: str) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows if r.get("kind") == kind]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset name or HF directory")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--kind", default="repetitive", help="prompt kind to use from the JSONL file")
    parser.add_argument("--spec", default="ngram:4", help="speculative config, e.g. ngram:4 or eagle3:3")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from warmcap.llm import LLM
    from warmcap.metrics import SpecDecodeMetrics, format_spec_stats
    from warmcap.sampling_params import SamplingParams

    prompts = load_prompts(args.prompts, args.kind)
    if not prompts:
        raise SystemExit(f"no {args.kind!r} prompts in {args.prompts}")
    common = {
        "device": "cpu",
        "max_num_seqs": len(prompts),
        "max_num_batched_tokens": 512,
        "max_model_len": 512,
    }
    engines = {
        "none": LLM(args.model, **common),
        args.spec: LLM(args.model, speculative_config=args.spec, **common),
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_chat_template=True)

    best: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    spec_llm = engines[args.spec]
    for _ in range(args.rounds):
        for name, llm in engines.items():
            llm.engine.spec_metrics = SpecDecodeMetrics()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_chat_template=True)
            elapsed = time.perf_counter() - start
            tokens[name] = [o.token_ids for o in outs]
            rate = sum(len(t) for t in tokens[name]) / elapsed
            best[name] = max(best.get(name, 0.0), rate)
    metrics = spec_llm.engine.spec_metrics

    print(f"model {args.model}: {len(prompts)} {args.kind} prompts x {args.max_tokens} new tokens, greedy")
    for name, rate in best.items():
        print(f"  {name:>12}: {rate:8.1f} tokens/s")
    print(f"  ratio {args.spec} / none: {best[args.spec] / best['none']:.2f}x")
    print(f"  identical tokens: {tokens[args.spec] == tokens['none']}")
    print(f"  {format_spec_stats(metrics)}")


if __name__ == "__main__":
    main()
