"""Tensor parallelism on CPU: TP=2 against TP=1 in the same run, and what the communication costs.

Each configuration starts its own engine (eager, so every step runs the model), generates greedily
for the shared prompts (``benchmarks/data/bench_prompts.jsonl``), and reports decode throughput.
Under TP=2 rank 0 (this process) also times, per engine step:

- the all-reduces (one after each row-parallel linear: attention ``o_proj`` and MLP ``down_proj``
  per layer, plus the vocab-parallel embedding) and the LM head's all-gather, each including the
  wait for the other rank to arrive;
- the object broadcasts of the command channel (the step's ``SchedulerOutput`` and the sampled
  tokens), with the pickled size of the scheduler outputs.

On a 2-core machine TP=2 cannot be faster (both ranks share the cores the single rank used); the
point is the price of the communication.

    .venv/bin/python benchmarks/bench_tp.py [--model smollm2-135m] [--prompts 4] [--max-tokens 32] [--rounds 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from warmcap.distributed.channel import CommandChannel, Step
from warmcap.llm import LLM
from warmcap.sampling_params import SamplingParams

PROMPTS = Path(__file__).resolve().parent / "data" / "bench_prompts.jsonl"


class CommTimer:
    """Wraps the collectives rank 0 calls and sums their wall time and count."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.step_bytes = 0
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)
        timer = self

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timer.seconds[label] += time.perf_counter() - t0
                timer.calls[label] += 1

        self._saved.append((owner, name, original))
        setattr(owner, name, timed)

    def install(self) -> None:
        self._wrap(dist, "all_reduce", "all_reduce")
        self._wrap(dist, "all_gather", "all_gather")
        share = CommandChannel.share
        timer = self

        def counted(channel, obj=None):
            if isinstance(obj, Step):
                timer.step_bytes += len(pickle.dumps(obj))
            return share(channel, obj)

        self._saved.append((CommandChannel, "share", share))
        CommandChannel.share = counted
        self._wrap(CommandChannel, "share", "broadcast")

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def run(model: str, tp: int, prompts: list[str], max_tokens: int) -> dict[str, float]:
    llm = LLM(
        model, tensor_parallel_size=tp, enforce_eager=True, max_model_len=512, max_num_seqs=len(prompts)
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # first-call costs
        timer = CommTimer()
        if tp > 1:
            timer.install()
        steps_before = llm.engine.runner.num_steps
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        timer.uninstall()
        steps = llm.engine.runner.num_steps - steps_before
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {
            "tokens_per_s": tokens / seconds,
            "ms_per_step": 1000 * seconds / steps,
            "steps": steps,
            "all_reduce_ms_per_step": 1000 * timer.seconds["all_reduce"] / steps,
            "all_reduces_per_step": timer.calls["all_reduce"] / steps,
            "all_gather_ms_per_step": 1000 * timer.seconds["all_gather"] / steps,
            "broadcast_ms_per_step": 1000 * timer.seconds["broadcast"] / steps,
            "step_bytes": timer.step_bytes / steps,
        }
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (every rank; 0: torch's default). On a shared machine more "
        "than one thrashes in OpenMP spin-waits",
    )
    args = parser.parse_args()
    if args.threads:
        # NOTE: the environment reaches the spawned worker ranks, which read it when torch loads.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in rows[: args.prompts]]
    # Alternated rounds, best of each: on a shared, loaded machine one round can land on a busy spell.
    rounds = [(run(args.model, 1, prompts, args.max_tokens), run(args.model, 2, prompts, args.max_tokens))]
    for _ in range(args.rounds - 1):
        rounds.append(
            (run(args.model, 1, prompts, args.max_tokens), run(args.model, 2, prompts, args.max_tokens))
        )
    for i, (a, b) in enumerate(rounds):
        print(f"round {i}: TP=1 {a['tokens_per_s']:.1f} tok/s, TP=2 {b['tokens_per_s']:.1f} tok/s")
    one = max((a for a, _ in rounds), key=lambda r: r["tokens_per_s"])
    two = max((b for _, b in rounds), key=lambda r: r["tokens_per_s"])
    print(
        f"model {args.model}, {len(prompts)} prompts x {args.max_tokens} tokens, greedy, eager, CPU gloo, "
        f"torch threads per process {torch.get_num_threads()}, best of {args.rounds} alternated rounds"
    )
    print(
        "| TP | tokens/s | ms/step | all-reduce ms/step (calls) | all-gather ms/step | broadcast ms/step | SchedulerOutput bytes/step |"
    )
    print("|---|---|---|---|---|---|---|")
    for tp, r in ((1, one), (2, two)):
        comm = f"{r['all_reduce_ms_per_step']:.2f} ({r['all_reduces_per_step']:.0f})" if tp > 1 else "-"
        rest = (
            f"{r['all_gather_ms_per_step']:.2f} | {r['broadcast_ms_per_step']:.2f} | {r['step_bytes']:.0f}"
            if tp > 1
            else "- | - | -"
        )
        print(f"| {tp} | {r['tokens_per_s']:.1f} | {r['ms_per_step']:.1f} | {comm} | {rest} |")
    print(f"TP=2 / TP=1 throughput: {two['tokens_per_s'] / one['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
