"""Scheduler step cost: schedule() and update_from_output() with many speculating requests.

A fake runner accepts a random number of drafts per request and proposes k new ones, so every
step exercises verify bookkeeping, block growth at boundaries and prefix-cache registration.

    .venv/bin/python benchmarks/bench_scheduler.py --num-reqs 256 --k 3 --steps 200
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from warmcap.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.kv_spec import FullAttentionSpec, KVCacheGroup
from warmcap.core.outputs import ModelRunnerOutput, SchedulerOutput
from warmcap.core.request import Request
from warmcap.core.scheduler import Scheduler
from warmcap.sampling_params import SamplingParams


def fake_runner(sched: Scheduler, out: SchedulerOutput, k: int, rng: random.Random) -> ModelRunnerOutput:
    req_ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        req = sched.requests[req_id]
        if req.num_computed_tokens < req.num_tokens:
            sampled.append([])
            continue
        drafts = out.scheduled_spec_decode_tokens.get(req_id, ())
        sampled.append([rng.randrange(10, 1000) for _ in range(rng.randint(0, len(drafts)) + 1)])
    drafts_next = {r: [rng.randrange(10, 1000) for _ in range(k)] for r in req_ids}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, draft_token_ids=drafts_next)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(args: argparse.Namespace, k: int) -> tuple[list[float], list[float], int]:
    """Per-step milliseconds of schedule() and update_from_output() over ``args.steps`` steps
    (wall clock, or this thread's CPU time with ``--cpu-time``)."""
    clock = time.thread_time if args.cpu_time else time.perf_counter
    max_model_len = 4096
    config = EngineConfig(
        cache=CacheConfig(block_size=args.block_size),
        scheduler=SchedulerConfig(
            max_num_seqs=args.num_reqs,
            max_num_batched_tokens=args.num_reqs * args.prompt_len,
            max_model_len=max_model_len,
        ),
        speculative=SpeculativeConfig(method="eagle3", num_speculative_tokens=k) if k else None,
    )
    groups = [KVCacheGroup("full", FullAttentionSpec(block_size=args.block_size))]
    per_req = (args.prompt_len + (k + 1) * args.steps + k) // args.block_size + 2
    kv = KVCacheManager(
        groups,
        args.num_reqs * per_req + 1,
        max_model_len=max_model_len,
        enable_caching=not args.no_prefix_caching,
    )
    sched = Scheduler(config, kv)
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=max_model_len - args.prompt_len - 1, ignore_eos=True)
    for i in range(args.num_reqs):
        prompt = [rng.randrange(10, 1000) for _ in range(args.prompt_len)]
        sched.add_request(Request(f"r{i}", prompt, params))
    # The first step prefills every prompt; the timed steps are all decode / verify steps.
    out = sched.schedule()
    sched.update_from_output(out, fake_runner(sched, out, k, rng))

    schedule_ms: list[float] = []
    update_ms: list[float] = []
    for _ in range(args.steps):
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        runner_out = fake_runner(sched, out, k, rng)
        t2 = clock()
        sched.update_from_output(out, runner_out)
        t3 = clock()
        assert out.num_reqs == args.num_reqs, "every request should run every step"
        schedule_ms.append((t1 - t0) * 1e3)
        update_ms.append((t3 - t2) * 1e3)
    return schedule_ms, update_ms, sched.num_preemptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-reqs", type=int, default=256)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="turn prefix caching off (no block hashing)"
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with this thread's CPU time instead of the wall clock: a loaded machine then "
        "inflates the numbers less (time spent waiting for a core is not counted)",
    )
    args = parser.parse_args()

    print(
        f"scheduler step cost: {args.num_reqs} running requests, block_size={args.block_size}, "
        f"{args.steps} steps, prefix caching {'off' if args.no_prefix_caching else 'on'}, "
        f"{'thread CPU time' if args.cpu_time else 'wall clock'}, load average {os.getloadavg()[0]:.1f}; "
        "peer = the same workload without speculation"
    )
    print(f"{'run':<10}{'phase':<20}{'median ms':>11}{'p90 ms':>9}{'us/req':>9}{'vs peer':>9}")
    peer = measure(args, 0)
    spec = measure(args, args.k)
    for label, (sched_ms, update_ms, preemptions) in ((f"k={args.k}", spec), ("k=0 peer", peer)):
        assert preemptions == 0, "the pool is sized so that no request is preempted"
        phases = (("schedule", sched_ms, peer[0]), ("update_from_output", update_ms, peer[1]))
        for name, values, peer_values in phases:
            median = statistics.median(values)
            ratio = median / statistics.median(peer_values)
            print(
                f"{label:<10}{name:<20}{median:>11.3f}{percentile(values, 0.9):>9.3f}"
                f"{median * 1e3 / args.num_reqs:>9.2f}{ratio:>8.2f}x"
            )


if __name__ == "__main__":
    main()
