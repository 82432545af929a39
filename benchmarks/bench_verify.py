"""Graph verification (I4) at scale: one source tree against another, same graphs, same run.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_verify.py --before /tmp/before/src \
        [--model tiny-llama] [--max-num-seqs 16] [--spec eagle:2] [--rounds 3]

Each round starts one fresh process per tree (``--before``: a checkout's ``src``; ``--after``:
default this checkout's), alternating, so both see the same machine load. A process builds the
engine (``enforce_eager``, then the graphs captured with the ``static`` backend, unverified), runs
``verify_graphs`` over every graph once untimed (caches, allocator; reads of tensor values into
Python counted, each a sync on a GPU) and once timed, and reports the seconds, the graphs verified,
and the target model's eager forwards and the drafter's eager passes the timed pass ran (what costs
kernel launches on a GPU). Prints each round and the best of each
tree (``--by``: wall or CPU seconds), and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


class _HostReads:
    """Counts reads of tensor values into Python (``item``, ``tolist``, ``float(t)``, ``bool(t)``,
    ``torch.equal``...) while active: on a GPU each one of a device tensor is a stream sync. On
    this CPU run host tensors count too, so it is an upper bound of the syncs a GPU would see."""

    def __init__(self) -> None:
        import torch
        from torch.overrides import TorchFunctionMode

        reads = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__bool__}
        reads |= {torch.Tensor.__int__, torch.Tensor.__index__, torch.equal, torch.Tensor.numpy}
        outer = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func in reads:
                    outer.count += 1
                return func(*args, **(kwargs or {}))

        self.count = 0
        self._mode = Mode()

    def __enter__(self) -> _HostReads:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One tree's numbers, in this process (the ``--child`` side)."""
    import time

    import torch

    from warmcap.config import EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
    from warmcap.engine import LLMEngine
    from warmcap.graphs.startup import capture_graphs
    from warmcap.runner_v2.model_runner import ModelRunner

    try:
        from warmcap.graphs.proof.verify import verify_graphs
    except ImportError:  # a tree from before graphs/ was split
        from warmcap.graphs.verify import verify_graphs  # type: ignore[no-redef]

    torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=ModelConfig(model=args.model, device="cpu", enforce_eager=True),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
        ),
        speculative=SpeculativeConfig.parse(args.spec),
    )
    engine = LLMEngine(config, startup_hooks=[])
    startup = capture_graphs(engine.runner, engine.kv_cache_manager, backend="static", verify=False)
    graphs = startup.result.graphs
    forwards = {"target": 0, "drafter": 0}
    honest = ModelRunner.forward_batch

    def counted(self, *a, **k):  # type: ignore[no-untyped-def]
        forwards["target"] += 1
        return honest(self, *a, **k)

    ModelRunner.forward_batch = counted  # type: ignore[method-assign]
    draft_model = engine.runner.drafter.draft_model if engine.runner.drafter is not None else None
    if draft_model is not None:
        honest_pass = draft_model.forward_pass

        def counted_pass(*a, **k):  # type: ignore[no-untyped-def]
            forwards["drafter"] += 1
            return honest_pass(*a, **k)

        draft_model.forward_pass = counted_pass  # type: ignore[method-assign]
    with _HostReads() as reads:
        verify_graphs(startup.capturer, graphs, engine.kv_cache_manager)
    forwards.update(target=0, drafter=0)
    start, cpu = time.perf_counter(), time.process_time()
    checks = verify_graphs(startup.capturer, graphs, engine.kv_cache_manager)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "graphs": len(graphs),
        "verified": sum(c.verified for c in checks),
        "target_forwards": forwards["target"],
        "drafter_passes": forwards["drafter"],
        "host_reads": reads.count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the src/ directory of the old tree")
    parser.add_argument("--after", type=Path, default=HERE.parent / "src")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--spec", default="eagle:2", help="speculative config, or 'none'")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--by",
        choices=("seconds", "cpu_seconds"),
        default="seconds",
        help="what 'best' means: wall seconds, or the process's CPU seconds (steadier on a loaded machine)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.spec == "none":
        args.spec = None
    if args.child:
        print(json.dumps(measure(args)))
        return

    child = [a for a in sys.argv[1:]] + ["--child"]
    best: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        for name, tree in (("before", args.before), ("after", args.after)):
            env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
            out = subprocess.run(
                [sys.executable, __file__, *child], env=env, check=True, capture_output=True, text=True
            ).stdout
            got = json.loads(out.strip().splitlines()[-1])
            print(f"round {r} {name:6s} {json.dumps(got)}", flush=True)
            if name not in best or got[args.by] < best[name][args.by]:
                best[name] = got
    b, a = best["before"], best["after"]
    print(
        f"best by {args.by}: before {b[args.by]:.2f} s ({b['target_forwards']} target forwards, "
        f"{b['drafter_passes']} drafter passes), after {a[args.by]:.2f} s ({a['target_forwards']}, "
        f"{a['drafter_passes']}); host reads {b['host_reads']} -> {a['host_reads']}; "
        f"before / after {b[args.by] / a[args.by]:.2f}x; "
        f"verified {b['verified']}/{b['graphs']} -> {a['verified']}/{a['graphs']}"
    )


if __name__ == "__main__":
    main()
