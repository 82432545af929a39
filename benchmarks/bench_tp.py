"""Tensor parallelism on CPU: TP=1 against TP=2 over shared memory and over gloo, in one run.

Each configuration starts its own engine (eager, so every step runs the model), generates greedily
for the shared prompts (``benchmarks/data/bench_prompts.jsonl``), and reports decode throughput.
The configurations alternate round by round (TP=1, TP=2 shm, TP=2 gloo, ...), once with torch's
default threads per process and once with one thread per rank, and the load average is recorded
around each run: on a shared machine one round can land on a busy spell, so compare within a round
and take the best of each. Under TP=2 rank 0 (this process) also times, per engine step:

- the all-reduces (one after each row-parallel linear: attention ``o_proj`` and MLP ``down_proj``
  per layer, plus the vocab-parallel embedding) and the LM head's all-gather, each including the
  wait for the other rank to arrive;
- the command channel's shares (the step's ``SchedulerOutput`` and the sampled tokens), with the
  pickled size of the scheduler outputs.

The transport is chosen by ``$WARMCAP_TP_COMM`` (``distributed/shm_comm.py``), set here per run.

    .venv/bin/python benchmarks/bench_tp.py [--model smollm2-135m] [--prompts 8] [--max-tokens 32] [--rounds 2] [--threads 0,1]

``--vllm``: instead, warmcap against vLLM's CPU build at TP=1 and TP=2 in one run, each engine a
long-lived process of its own, alternated round by round (``bench_contention.py``'s peers, quiet
scenario; the shared workload: 16 prompts x 64 tokens, default graphs / torch.compile): warmcap
TP=1, warmcap TP=2, vLLM TP=1, vLLM TP=2 (and, where the KV groups split unevenly, warmcap TP=2 with
``--tp-balance heads``: the K/V offload's A/B). vLLM refuses a TP size that does not divide the
attention heads (SmolLM2's 9): then its TP=2 runs the same model with its KV groups padded
(``pad_heads.py``: the same function, ~8 % more work a token), and warmcap TP=2 runs that model
too (``tp2_padded``), so both engines are compared on one model. Every peer's tokens are compared
with the first's. ``--threads`` there: the model threads in all (default 2: the 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import warmcap.models.layers as layers
from warmcap.distributed.channel import CommandChannel, Step
from warmcap.distributed.shm_comm import ENV as COMM_ENV
from warmcap.llm import LLM
from warmcap.sampling_params import SamplingParams

HERE = Path(__file__).resolve().parent
PROMPTS = HERE / "data" / "bench_prompts.jsonl"


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
        # The sharded layers' own references: whichever transport carries them.
        self._wrap(layers, "all_reduce_sum", "all_reduce")
        self._wrap(layers, "all_gather_last_dim", "all_gather")
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


def run(model: str, tp: int, comm: str, prompts: list[str], max_tokens: int) -> dict[str, float]:
    os.environ[COMM_ENV] = comm
    load_before = os.getloadavg()[0]
    llm = LLM(
        model, tensor_parallel_size=tp, enforce_eager=True, max_model_len=512, max_num_seqs=len(prompts)
    )
    try:
        if tp > 1:
            assert llm.engine.executor.channel.transport == comm, "the transport asked for is not in use"
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
            "load": (load_before + os.getloadavg()[0]) / 2,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        }
    finally:
        llm.shutdown()


CONFIGS = (("TP=1", 1, "auto"), ("TP=2 shm", 2, "shm"), ("TP=2 gloo", 2, "gloo"))


def set_threads(threads: int, default: int) -> None:
    """``threads`` torch threads in this process and (through the environment, read when torch
    loads) in the spawned workers; 0: torch's default."""
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    else:
        os.environ.pop("OMP_NUM_THREADS", None)
        torch.set_num_threads(default)


def against_vllm(args: argparse.Namespace) -> int:
    """``bench_contention.py`` with the four TP peers (see the module docstring); its exit code."""
    from warmcap.models.presets import resolve_model

    config = json.loads((Path(resolve_model(args.model)) / "config.json").read_text())
    tp2 = ".@arg:tensor_parallel_size=2@arg:cpu_threads=1"
    peers = ["tp1=.", f"tp2={tp2}", "vllm"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    if kv_heads % 2:
        # uneven KV groups: the K/V offload (models/llama.py KVOffload) against each rank its heads
        peers.insert(2, f"tp2_heads={tp2}@arg:tp_balance=heads")
    if config["num_attention_heads"] % 2 == 0:
        peers.append("vllm@tp=2")
    else:
        peers += [
            "tp2_padded=.@model=padded@arg:tensor_parallel_size=2@arg:cpu_threads=1",
            "vllm@tp=2@model=padded",
        ]
    threads = "2" if args.threads == "0,1" else args.threads
    cmd = [
        sys.executable, str(HERE / "bench_contention.py"), "--model", args.model, "--peers", ",".join(peers),
        "--threads", threads, "--scenarios", "quiet", "--rounds", str(args.vllm_rounds),
    ]  # fmt: skip
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--threads",
        default="0,1",
        help="comma-separated torch threads per process to measure (every rank; 0: torch's default)",
    )
    parser.add_argument("--vllm", action="store_true", help="against vLLM's CPU build at TP=1 and TP=2")
    parser.add_argument("--vllm-rounds", type=int, default=5)
    args = parser.parse_args()
    if args.vllm:
        sys.exit(against_vllm(args))
    default_threads = torch.get_num_threads()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in rows[: args.prompts]]
    print(
        f"model {args.model}, {len(prompts)} prompts x {args.max_tokens} tokens, greedy, eager, CPU, "
        f"{os.cpu_count()} CPUs, best of {args.rounds} alternated rounds; load = 1-min load average"
    )
    for threads in (int(t) for t in args.threads.split(",")):
        set_threads(threads, default_threads)
        rounds: dict[str, list[dict[str, float]]] = defaultdict(list)
        for i in range(args.rounds):
            line = []
            for label, tp, comm in CONFIGS:
                r = run(args.model, tp, comm, prompts, args.max_tokens)
                rounds[label].append(r)
                line.append(f"{label} {r['tokens_per_s']:.1f} tok/s (load {r['load']:.1f})")
            print(f"threads {threads or 'default'} round {i}: " + ", ".join(line), flush=True)
        best = {label: max(rs, key=lambda r: r["tokens_per_s"]) for label, rs in rounds.items()}
        same = all(r["token_ids"] == best["TP=1"]["token_ids"] for rs in rounds.values() for r in rs)
        print(
            f"\ntorch threads per process: {threads or f'default ({default_threads})'}; "
            f"tokens identical to TP=1 in every run: {same}"
        )
        print(
            "| config | tokens/s | ms/step | all-reduce ms/step (calls) | all-gather ms/step | "
            "broadcast ms/step | SchedulerOutput bytes/step | load |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for label, r in best.items():
            if label == "TP=1":
                comm = "- | - | - | -"
            else:
                comm = (
                    f"{r['all_reduce_ms_per_step']:.2f} ({r['all_reduces_per_step']:.0f}) | "
                    f"{r['all_gather_ms_per_step']:.2f} | {r['broadcast_ms_per_step']:.2f} | {r['step_bytes']:.0f}"
                )
            print(
                f"| {label} | {r['tokens_per_s']:.1f} | {r['ms_per_step']:.1f} | {comm} | {r['load']:.1f} |"
            )
        one = best["TP=1"]["tokens_per_s"]
        print(
            f"TP=2 shm / TP=1: {best['TP=2 shm']['tokens_per_s'] / one:.2f}x; TP=2 gloo / TP=1: "
            f"{best['TP=2 gloo']['tokens_per_s'] / one:.2f}x; shm / gloo: "
            f"{best['TP=2 shm']['tokens_per_s'] / best['TP=2 gloo']['tokens_per_s']:.2f}x\n",
            flush=True,
        )


if __name__ == "__main__":
    main()
