"""Warmup planning time for the largest default layout, next to the scheduler doing the same work.

The planner drives a scratch KV cache manager through every warmup step; its peer is the production
scheduler scheduling the same number of steps for the same number of requests, so the ratio says
how much planning costs over plain scheduling.

    .venv/bin/python benchmarks/bench_planner.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

from warmcap.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.kv_spec import FullAttentionSpec, KVCacheGroup, MambaSpec, SlidingWindowSpec
from warmcap.core.outputs import ModelRunnerOutput
from warmcap.core.request import Request
from warmcap.core.scheduler import Scheduler
from warmcap.sampling_params import SamplingParams
from warmcap.warmup.planner import plan_warmup


def layout(k: int, max_model_len: int) -> list[KVCacheGroup]:
    """Four groups: full and sliding-window attention, Mamba state (align mode), the drafter's KV."""
    return [
        KVCacheGroup(
            "full", FullAttentionSpec(16, num_kv_heads=8, head_size=128), tuple(f"l{i}" for i in range(16))
        ),
        KVCacheGroup("sliding_window", SlidingWindowSpec(16, 8, 128, sliding_window=1024), ("s0", "s1")),
        KVCacheGroup(
            "mamba",
            MambaSpec(
                16, state_shapes=((3, 4096), (64, 64, 16)), cache_mode="align", num_speculative_blocks=k
            ),
            ("m0", "m1"),
        ),
        KVCacheGroup("draft.full", FullAttentionSpec(16, 8, 128), ("draft.l0",), is_drafter=True),
    ]


def time_it(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def scheduler_peer(config: EngineConfig, groups, num_blocks: int, num_reqs: int, num_steps: int) -> None:
    manager = KVCacheManager(groups, num_blocks, max_model_len=config.max_model_len, enable_caching=False)
    sched = Scheduler(config, manager)
    k = config.num_speculative_tokens
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i in range(num_reqs):
        sched.add_request(Request(f"r{i}", [i % 50 + 1] * (k + 2), params))
    for _ in range(num_steps):
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = [[1] * (1 + len(out.scheduled_spec_decode_tokens.get(r, []))) for r in ids]
        sched.update_from_output(out, ModelRunnerOutput(ids, sampled, {r: [2] * k for r in ids}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=8192)
    args = ap.parse_args()
    config = EngineConfig(
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512, max_model_len=4096
        ),
        speculative=SpeculativeConfig("dflash", args.k),
    )
    groups = layout(args.k, config.max_model_len)
    plan = plan_warmup(config, groups, args.num_blocks)
    num_reqs = len(plan.req_ids)
    plan_times = time_it(lambda: plan_warmup(config, groups, args.num_blocks), args.repeats)
    peer_times = time_it(
        lambda: scheduler_peer(config, groups, args.num_blocks, num_reqs, len(plan.steps)), args.repeats
    )
    p, s = statistics.median(plan_times) * 1e3, statistics.median(peer_times) * 1e3
    print(
        f"layout: {len(groups)} KV groups (full, sliding_window, mamba align, draft), dflash:{args.k}, "
        f"{args.num_blocks} blocks, max_num_batched_tokens=512, max_num_seqs={args.max_num_seqs}"
    )
    print(f"plan: {len(plan.steps)} steps, {num_reqs} requests, {len(plan.skipped)} skipped")
    print(f"{'what':<34}{'median ms':>10}{'p90 ms':>10}")
    for name, xs in (("plan_warmup", plan_times), ("scheduler, same steps (peer)", peer_times)):
        print(f"{name:<34}{statistics.median(xs) * 1e3:>10.2f}{sorted(xs)[int(0.9 * len(xs))] * 1e3:>10.2f}")
    print(f"ratio plan/peer: {p / s:.2f}x   goal: plan under 20 ms -> {'met' if p < 20 else 'NOT met'}")


if __name__ == "__main__":
    main()
