"""CPU `static` graphs vs eager on one engine at default settings (full context), speculative decoding.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_cpu_graphs.py [--spec ngram:4] \
        [--prompts 8] [--max-tokens 24] [--threads 1] [--rounds 2] [--max-model-len N]

One ``LLM`` built as a user would (`static` graphs captured and verified at start-up, the model's
own context length unless ``--max-model-len``); its start-up time is printed. Then the same greedy
batch (``ignore_eos``, chat template, the ``repetitive`` prompts of the shared workload) runs with
the graphs attached and with them detached (``runner.attach_graphs(None)``: every pass eager),
alternating round by round; each mode's best wall time and best CPU time of this process (less
sensitive to other processes on a shared machine at one thread), their ratios and whether the tokens
are identical are printed, with the graph replays the graph rounds made (a ratio over rounds that
replayed nothing would measure nothing).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "bench_prompts.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset name or HF directory")
    parser.add_argument("--spec", default="ngram:4", help="speculative config ('none': no speculation)")
    parser.add_argument("--prompts", type=int, default=8, help="how many repetitive prompts")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's own")
    args = parser.parse_args()

    import torch

    from warmcap.llm import LLM
    from warmcap.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in DEFAULT_PROMPTS.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in rows if r.get("kind") == "repetitive"][: args.prompts]
    if len(prompts) < args.prompts:
        raise SystemExit(f"only {len(prompts)} repetitive prompts in {DEFAULT_PROMPTS}")
    kwargs: dict[str, object] = {"device": "cpu"}
    if args.spec != "none":
        kwargs["speculative_config"] = args.spec
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len

    start, start_cpu = time.perf_counter(), time.process_time()
    llm = LLM(args.model, **kwargs)
    startup, startup_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    runner = llm.engine.runner
    graphs = runner.graphs
    if graphs is None:
        raise SystemExit("the engine captured no graphs (enforce_eager?): nothing to compare")
    print(
        f"start-up: {startup:.1f} s wall, {startup_cpu:.1f} s CPU (max_model_len {runner.max_model_len}, max_num_seqs {runner.max_num_reqs})"
    )

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    modes = {"graphs": graphs, "eager": None}
    best: dict[str, float] = {}
    best_cpu: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    replays_before = sum(graphs.replays.values())
    for dispatcher in modes.values():  # warm-up, one short request each
        runner.attach_graphs(dispatcher)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_chat_template=True)
    for _ in range(args.rounds):
        for mode, dispatcher in modes.items():
            runner.attach_graphs(dispatcher)
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_chat_template=True)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            best[mode] = min(best.get(mode, wall), wall)
            best_cpu[mode] = min(best_cpu.get(mode, cpu), cpu)
            tokens[mode] = [list(o.outputs[0].token_ids) for o in outs]
            print(f"  {mode:6s} {wall:8.2f} s wall {cpu:8.2f} s CPU")
    runner.attach_graphs(graphs)
    replays = sum(graphs.replays.values()) - replays_before
    same = tokens["graphs"] == tokens["eager"]
    n = sum(len(t) for t in tokens["graphs"])
    print(
        f"{args.prompts} prompts x {args.max_tokens} tokens, spec {args.spec}, {args.threads} thread(s): "
        f"graphs {best['graphs']:.2f} s, eager {best['eager']:.2f} s wall (best of {args.rounds}): "
        f"eager / graphs {best['eager'] / best['graphs']:.2f}x; CPU graphs {best_cpu['graphs']:.2f} s, "
        f"eager {best_cpu['eager']:.2f} s: {best_cpu['eager'] / best_cpu['graphs']:.2f}x; "
        f"{n} tokens each, identical: {same}; "
        f"target graph replays {replays}, eager steps {graphs.eager_steps}"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
