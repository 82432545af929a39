"""Engine step time with long outputs, where output processing (detokenising, stop strings) used to
grow with the output length: tiny-llama, batch 8 x 960 greedy tokens, A/B between two source trees.

Each tree runs in its own process (``PYTHONPATH=<tree>/src``), alternating, ``--rounds`` times; a
run times every engine step (wall clock and the process's CPU time, which a loaded machine
inflates less) and reports the mean over all steps and over the last quarter (positions 720..960).

    .venv/bin/python benchmarks/bench_output_processing.py --baseline /work/main --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    """One run in this process: print a JSON line of per-step times (ms)."""
    import torch

    from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from warmcap.engine import LLMEngine
    from warmcap.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    max_model_len = 1024
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=args.batch * max_model_len // 16 + 1),
        scheduler=SchedulerConfig(
            max_num_seqs=args.batch, max_num_batched_tokens=256, max_model_len=max_model_len
        ),
    )
    engine = LLMEngine(config, startup_hooks=[])
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, stop=tuple(args.stop))
    for i in range(args.batch):
        engine.add_request([5 + i, 17, 99, 230, 41, 77, 3 + i, 250], params)
    wall: list[float] = []
    cpu: list[float] = []
    while engine.has_unfinished():
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    print(json.dumps({"wall": wall, "cpu": cpu}))


def run(tree: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--batch", str(args.batch)]
    cmd += ["--tokens", str(args.tokens), "--threads", str(args.threads)]
    for s in args.stop:
        cmd += ["--stop", s]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def summary(runs: list[dict[str, list[float]]], clock: str) -> tuple[float, float]:
    """(mean ms a step over all steps, over the last quarter), the median over runs."""
    whole = [statistics.fmean(r[clock][1:]) for r in runs]  # step 1 is the prefill
    late = [statistics.fmean(r[clock][-len(r[clock]) // 4 :]) for r in runs]
    return statistics.median(whole), statistics.median(late)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, default=Path("/work/main"), help="tree to compare against")
    parser.add_argument("--candidate", type=Path, default=HERE, help="tree under test (default: this one)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=960)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stop", action="append", default=[], help="a stop string every request carries")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(
        f"output processing: tiny-llama, batch {args.batch} x {args.tokens} greedy tokens, "
        f"{args.threads} torch thread(s), stop strings {args.stop or 'none'}, {args.rounds} rounds alternating; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    results: dict[str, list[dict[str, list[float]]]] = {"baseline": [], "candidate": []}
    for _ in range(args.rounds):
        for name in ("baseline", "candidate"):
            results[name].append(run(getattr(args, name), args))
    print(f"{'tree':<11}{'clock':<6}{'ms/step all':>13}{'ms/step last 1/4':>18}")
    for clock in ("wall", "cpu"):
        base = summary(results["baseline"], clock)
        cand = summary(results["candidate"], clock)
        print(f"{'baseline':<11}{clock:<6}{base[0]:>13.3f}{base[1]:>18.3f}")
        print(f"{'candidate':<11}{clock:<6}{cand[0]:>13.3f}{cand[1]:>18.3f}")
        print(f"{'speed-up':<11}{clock:<6}{base[0] / cand[0]:>12.2f}x{base[1] / cand[1]:>17.2f}x")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
