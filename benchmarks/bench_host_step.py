"""Host work a step: what the CPU spends per engine step outside the model's forward and head.

    HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 .venv/bin/python benchmarks/bench_host_step.py \\
        [--models tiny-llama,smollm2-135m] [--batches 1,8] [--rounds 3] [--compare /work/main]
    ... bench_host_step.py --mode generate   # tiny-llama b1 x 512 tokens: warmcap vs transformers
    ... bench_host_step.py --mode positions  # batch 8: a token of positions 200..900 vs 0..200

``--mode split`` (default): one ``LLM`` per model (default settings: graphs captured at start-up,
the greedy screened head), ``batch`` greedy requests of ``--tokens`` new tokens (``ignore_eos``)
driven through ``LLMEngine.step``, with ``--output-kind`` outputs (cumulative, ``engine.step``'s
default: an output every step; final_only: ``LLM.generate``'s, one at the end). Timers around functions (two ``perf_counter`` calls each, no
profiler) split every step into phases; each phase is the time inside its functions less the time
inside timed functions they call:

- ``forward`` + ``head`` (excluded): the eager forward or the graph replay, the LM head, the
  greedy head, the sampler's arithmetic, draft verification on the device;
- ``scheduler``, ``prepare inputs`` (persistent-batch deltas and the step's index), ``step
  buffers`` (loading the static buffers), ``slot mapping``, ``sampling metadata``, ``sampling``
  (the sampling glue around the head: picking the path, the token fetch), ``graph dispatch``
  (finding the graph that fits a step), ``runner`` (the rest of ``execute_model``: bookkeeping,
  appending the tokens), ``output`` (the rest of ``LLMEngine.step``: stop checks,
  detokenisation, request outputs).

host a step = the step's wall time less ``forward`` and ``head``; printed for decode steps (every
scheduled request one token): the median (a step the OS preempts on a shared machine inflates a mean
by milliseconds) and the mean, with each phase's median. The timers themselves cost
about 0.3 us a call (~15 calls a step), included in the host time.

``--compare TREE`` runs the same measurement against another checkout's ``src/`` (e.g. main) in
child processes alternating with this tree's, round by round, and prints the ratio. Each tree
runs in its own process (``PYTHONPATH=TREE/src``); this script's own timers are patched onto
whichever functions the tree has (a phase a tree lacks reads 0).

``--mode generate``: tiny-llama, batch 1, ``--gen-tokens`` (512) greedy tokens, ``--threads`` (1):
warmcap's ``LLM.generate`` vs transformers' ``generate`` on the same weights in the same process,
alternating, best of ``--rounds``; time a token and the ratio (the issue's target: <= 0.5).

``--mode positions``: tiny-llama, batch 8, 900 new tokens from an 8-token prompt: the mean wall
time of a decode step whose tokens sit at positions 200..900 over one at positions 0..200 (target
<= 1.25; the medians' ratio beside it, which a preempted step does not move), with the host/device
split of each range.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TREE = HERE.parent
RESULT = "@@RESULT "

#: phases excluded from host time
DEVICE_PHASES = ("forward", "head")
HOST_PHASES = (
    "scheduler",
    "prepare inputs",
    "step buffers",
    "slot mapping",
    "sampling metadata",
    "sampling",
    "graph dispatch",
    "runner",
    "output",
)

#: (module, attribute path, phase): class methods and module functions timed when the tree has them.
#: Names of both the baseline's and this tree's layout are listed; a missing one is skipped.
PATCHES: tuple[tuple[str, str, str], ...] = (
    ("warmcap.engine", "LLMEngine.step", "output"),
    ("warmcap.core.scheduler", "Scheduler.schedule", "scheduler"),
    ("warmcap.core.scheduler", "Scheduler.update_from_output", "scheduler"),
    ("warmcap.runner_v2.model_runner", "ModelRunner.execute_model", "runner"),
    ("warmcap.runner_v2.model_runner", "ModelRunner.execute_model_result", "runner"),
    ("warmcap.runner_v2.model_runner", "ModelRunner.execute_model_async", "runner"),
    ("warmcap.runner_v2.model_runner", "ModelRunner._run", "runner"),
    ("warmcap.runner_v2.model_runner", "ModelRunner._finish_step", "runner"),
    ("warmcap.runner_v2.input_batch", "InputBatch.update", "prepare inputs"),
    ("warmcap.runner_v2.input_batch", "InputBatch.prepare_inputs", "prepare inputs"),
    ("warmcap.runner_v2.step_buffers", "StepBuffers.copy_from", "step buffers"),
    ("warmcap.runner_v2.step_buffers", "StepBuffers.load_layout", "step buffers"),
    ("warmcap.runner_v2.step_buffers", "StepBuffers.load_step", "step buffers"),
    ("warmcap.runner_v2.step_buffers", "slot_mapping", "slot mapping"),
    ("warmcap.runner_v2.step_buffers", "compute_slot_mappings", "slot mapping"),
    ("warmcap.runner_v2.model_runner", "ModelRunner.sampling_metadata", "sampling metadata"),
    ("warmcap.runner_v2.model_runner", "ModelRunner._sample", "sampling"),
    ("warmcap.runner_v2.model_runner", "ModelRunner._fetch", "sampling"),
    ("warmcap.runner_v2.step_result", "PendingTokens.read", "sampling"),
    ("warmcap.graphs.capture.graph_runner", "GraphRunner.replay_step", "graph dispatch"),
    ("warmcap.runner_v2.model_runner", "ModelRunner.forward_batch", "forward"),
    ("warmcap.runner_v2.model_runner", "row_argmax", "head"),
    ("warmcap.runner_v2.model_runner", "greedy_verify_on_device", "head"),
    ("warmcap.runner_v2.model_runner", "probabilistic_verify_on_device", "head"),
    ("warmcap.runner_v2.sampler", "Sampler.__call__", "head"),
)


class Timers:
    """Exclusive time per phase: a timed call's time less that of timed calls inside it."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []

    def wrap(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        stack, acc, clock = self._stack, self.acc, time.perf_counter

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            inner = [0.0]
            stack.append(inner)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - start
                stack.pop()
                acc[phase] += spent - inner[0]
                if stack:
                    stack[-1][0] += spent

        return timed

    def take(self) -> dict[str, float]:
        out = dict(self.acc)
        self.acc.clear()
        return out


def install(timers: Timers, engine: Any) -> list[str]:
    """Patch the timers onto the tree's functions and onto ``engine``'s model, head and graphs;
    returns what was patched."""
    done = []
    for module_name, path, phase in PATCHES:
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        *parents, name = path.split(".")
        for p in parents:
            owner = getattr(owner, p, None)
        if owner is None or not hasattr(owner, name):
            continue
        setattr(owner, name, timers.wrap(getattr(owner, name), phase))
        done.append(f"{module_name}:{path}")
    runner = engine.runner
    model = runner.model
    model.compute_logits = timers.wrap(model.compute_logits, "head")
    head = runner.greedy_head
    if head is not None:
        cls = type(head)
        cls.argmax = timers.wrap(cls.argmax, "head")
        done.append(f"{cls.__name__}.argmax")
    graphs = getattr(runner.graphs, "_graphs", {}) if runner.graphs is not None else {}
    for by_descriptor in graphs.values():
        for g in by_descriptor.values():
            g.replay_fn = timers.wrap(g.replay_fn, "forward")
    return done


def async_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``async_scheduling`` for ``LLM`` when the run asks for one (a tree without it gets none)."""
    return {} if args.async_scheduling == "auto" else {"async_scheduling": args.async_scheduling == "on"}


def kind_kwargs(args: argparse.Namespace, params_cls: Any) -> dict[str, Any]:
    """``output_kind`` for the requests when the tree's ``SamplingParams`` has it (a tree without it
    builds an output every step: cumulative)."""
    if "output_kind" not in getattr(params_cls, "__dataclass_fields__", {}):
        return {}
    return {"output_kind": args.output_kind}


def prompt_ids(n: int, seed: int) -> list[int]:
    return [(7 * i + 13 * seed + 3) % 400 + 20 for i in range(n)]


# ---- child modes (run with the tree under test first on sys.path) -----------------------------------


def child_split(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from warmcap.llm import LLM
    from warmcap.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    out: dict[str, Any] = {}
    for model in args.models.split(","):
        tokens = args.tokens if model.startswith("tiny") else args.tokens_large
        llm = LLM(
            model,
            device="cpu",
            max_num_seqs=max(batches),
            max_model_len=args.prompt_len + tokens + 32,
            **async_kwargs(args),
        )
        engine = llm.engine
        params = SamplingParams(
            temperature=0.0, max_tokens=tokens, ignore_eos=True, **kind_kwargs(args, SamplingParams)
        )
        llm.generate([prompt_ids(args.prompt_len, 0)], SamplingParams(max_tokens=4, ignore_eos=True))
        timers = Timers()
        install(timers, engine)
        for batch in batches:
            steps: list[dict[str, float]] = []
            for rep in range(2):  # the first pass warms this batch size's paths; the second counts
                engine.kv_cache_manager.reset_prefix_cache()
                for i in range(batch):
                    engine.add_request({"prompt_token_ids": prompt_ids(args.prompt_len, 1 + i)}, params)
                timers.take()
                # As generate and the server's loop drive it: thread pinning held across the steps.
                with getattr(engine, "steps_pinned", contextlib.nullcontext)():
                    while engine.has_unfinished():
                        engine.step()
                        phases = timers.take()
                        runner = engine.runner
                        step = runner.last_step
                        decode = step is not None and int(step.num_tokens) == step.num_reqs == batch
                        if rep == 1 and decode:
                            steps.append(phases)
            out[f"{model} b{batch}"] = summarize(steps)
        llm.shutdown()
        del llm, engine
    return out


def summarize(steps: list[dict[str, float]]) -> dict[str, Any]:
    host = [sum(v for k, v in s.items() if k not in DEVICE_PHASES) for s in steps]
    device = [sum(s.get(k, 0.0) for k in DEVICE_PHASES) for s in steps]
    # Medians: on a shared machine a step the OS preempts inflates a mean by milliseconds.
    phases = {
        p: statistics.median(s.get(p, 0.0) for s in steps) * 1e3 for p in (*HOST_PHASES, *DEVICE_PHASES)
    }
    return {
        "steps": len(steps),
        "host_mean_ms": statistics.fmean(host) * 1e3,
        "host_median_ms": statistics.median(host) * 1e3,
        "device_mean_ms": statistics.fmean(device) * 1e3,
        "phases_ms": phases,
    }


def child_generate(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from warmcap.llm import LLM
    from warmcap.models.presets import resolve_model_path
    from warmcap.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    n = args.gen_tokens
    ids = prompt_ids(args.prompt_len, 0)
    llm = LLM(
        "tiny-llama", device="cpu", max_num_seqs=1, max_model_len=len(ids) + n + 16, **async_kwargs(args)
    )
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(
        str(resolve_model_path("tiny-llama")), dtype=torch.float32
    ).eval()
    input_ids = torch.tensor([ids])

    def run_warmcap() -> list[int]:
        llm.engine.kv_cache_manager.reset_prefix_cache()
        return list(llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids)

    def run_hf() -> list[int]:
        with torch.inference_mode():
            out = hf.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
        return out[0, len(ids) :].tolist()

    best = {"warmcap": float("inf"), "transformers": float("inf")}
    same = True
    run_warmcap(), run_hf()
    for _ in range(args.rounds):
        got = {}
        for name, fn in (("warmcap", run_warmcap), ("transformers", run_hf)):
            start = time.perf_counter()
            got[name] = fn()
            best[name] = min(best[name], (time.perf_counter() - start) / n * 1e3)
        same &= got["warmcap"] == got["transformers"]
    llm.shutdown()
    return {
        "warmcap_ms_per_token": best["warmcap"],
        "transformers_ms_per_token": best["transformers"],
        "ratio": best["warmcap"] / best["transformers"],
        "tokens_identical": same,
    }


def child_positions(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from warmcap.llm import LLM
    from warmcap.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    batch, n, plen, split = 8, 900, 8, 200
    llm = LLM(
        "tiny-llama", device="cpu", max_num_seqs=batch, max_model_len=plen + n + 16, **async_kwargs(args)
    )
    engine = llm.engine
    llm.generate([prompt_ids(plen, 0)], SamplingParams(max_tokens=4, ignore_eos=True))
    timers = Timers()
    install(timers, engine)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        engine.kv_cache_manager.reset_prefix_cache()
        for i in range(batch):
            engine.add_request({"prompt_token_ids": prompt_ids(plen, 1 + i)}, params)
        walls: dict[str, list[float]] = {"early": [], "late": []}
        hosts: dict[str, list[float]] = {"early": [], "late": []}
        timers.take()
        with getattr(engine, "steps_pinned", contextlib.nullcontext)():
            while engine.has_unfinished():
                start = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - start
                phases = timers.take()
                step = engine.runner.last_step
                if step is None or int(step.num_tokens) != step.num_reqs or step.num_reqs != batch:
                    continue
                pos = int(engine.runner.last_positions[0])
                key = "early" if pos < split else "late"
                walls[key].append(wall)
                hosts[key].append(sum(v for k, v in phases.items() if k not in DEVICE_PHASES))
        early, late = statistics.fmean(walls["early"]), statistics.fmean(walls["late"])
        ratio = late / early
        if not best or ratio < best["ratio"]:
            best = {
                "ratio": ratio,
                # a step the OS preempts inflates a mean by milliseconds: the medians' ratio too
                "ratio_median": statistics.median(walls["late"]) / statistics.median(walls["early"]),
                "early_ms_per_token": early / batch * 1e3,
                "late_ms_per_token": late / batch * 1e3,
                "early_host_ms_per_step": statistics.fmean(hosts["early"]) * 1e3,
                "late_host_ms_per_step": statistics.fmean(hosts["late"]) * 1e3,
            }
    llm.shutdown()
    return best


CHILDREN = {"split": child_split, "generate": child_generate, "positions": child_positions}


# ---- parent ----------------------------------------------------------------------------------------


def run_child(tree: Path, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree / "src")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRITON_INTERPRET", "1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *argv]
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    sys.exit(f"child run in {tree} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_split(name: str, results: dict[str, list[dict[str, Any]]]) -> None:
    """Best round (lowest mean host time) of each tree per configuration."""
    trees = list(results)
    configs = list(results[trees[0]][0])
    head = f"{'config':<18} {'tree':<10} {'host med':>9} {'mean':>7} " + " ".join(
        f"{p[:10]:>10}" for p in (*HOST_PHASES, *DEVICE_PHASES)
    )
    print(f"\n{name}: ms a decode step, median over steps (best round of each tree); phases: medians\n{head}")
    for c in configs:
        best = {t: min((r[c] for r in results[t]), key=lambda s: s["host_median_ms"]) for t in trees}
        for t in trees:
            s = best[t]
            ph = " ".join(f"{s['phases_ms'][p]:>10.3f}" for p in (*HOST_PHASES, *DEVICE_PHASES))
            print(f"{c:<18} {t:<10} {s['host_median_ms']:>9.3f} {s['host_mean_ms']:>7.3f} {ph}")
        for t in trees:
            rounds = " ".join(f"{r[c]['host_median_ms']:.3f}" for r in results[t])
            print(f"{c:<18} {t:<10} host med each round: {rounds}")
        last = trees[-1]
        for t in trees[:-1]:
            a, b = best[t]["host_median_ms"], best[last]["host_median_ms"]
            print(f"{c:<18} host {t}/{last} = {a / b:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=sorted(CHILDREN), default="split")
    parser.add_argument("--models", default="tiny-llama,smollm2-135m")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens a request (tiny models)")
    parser.add_argument("--tokens-large", type=int, default=32, help="new tokens a request (other models)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--gen-tokens", type=int, default=512, help="--mode generate: new tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare", type=Path, default=None, help="another checkout to A/B against")
    parser.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off", "both"),
        default="auto",
        help="this tree's engines with async scheduling on, off, or both A/B in one run (auto: the default)",
    )
    parser.add_argument(
        "--output-kind",
        choices=("cumulative", "final_only"),
        default="cumulative",
        help="--mode split: the requests' output kind (cumulative: an output every step, engine.step's "
        "default; final_only: LLM.generate's); a tree without output kinds is always cumulative",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(RESULT + json.dumps(CHILDREN[args.mode](args)), flush=True)
        return
    if args.compare is not None and not (args.compare / "src" / "warmcap").is_dir():
        parser.error(f"--compare {str(args.compare)!r} has no src/warmcap: give a warmcap checkout")
    argv = [a for a in sys.argv[1:] if a]
    # name -> (checkout, this run's argv for it)
    trees: dict[str, tuple[Path, list[str]]] = {"this": (TREE, argv)}
    if args.async_scheduling == "both":
        plain = _without(argv, "--async-scheduling")
        trees = {
            "sync": (TREE, [*plain, "--async-scheduling", "off"]),
            "async": (TREE, [*plain, "--async-scheduling", "on"]),
        }
    if args.compare is not None:
        trees["baseline"] = (args.compare.resolve(), _without(argv, "--async-scheduling"))
    # A child runs its own rounds for these modes; the parent alternates trees per round for split.
    outer = args.rounds if args.mode == "split" else 1
    results: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
    print(
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, mode {args.mode}, threads {args.threads}"
        + (f", output kind {args.output_kind}" if args.mode == "split" else "")
    )
    for r in range(outer):
        for t, (path, tree_argv) in trees.items():
            child_argv = (
                [*_without(tree_argv, "--rounds"), "--rounds", "1"] if args.mode == "split" else tree_argv
            )
            before = load()
            res = run_child(path, args, _without(child_argv, "--compare"))
            results[t].append(res)
            print(
                f"round {r + 1} {t:<8} load {before}: {json.dumps(res) if args.mode != 'split' else 'done'}"
            )
    if args.mode == "split":
        print_split("host-only time", results)


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag v`` or ``--flag=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    main()
