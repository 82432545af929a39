"""Throughput on a busy host: warmcap (this tree and a baseline tree) and vLLM's CPU build, each in
a process of its own, alternated round by round, quiet and beside bounded CPU burners.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_contention.py \
        --peers warmcap=.,main=/path/to/baseline,vllm --threads 1,2 --rounds 3 \
        [--scenarios quiet,busy,matmul,neighbour] [--neighbour tests|engine] [--eager] [--json out.json]

The workload is ``bench_throughput.py``'s: the first 16 ``general`` prompts of
``benchmarks/data/bench_prompts.jsonl`` through the chat template, 64 new tokens each, greedy,
``ignore_eos``, fp32. For each thread count every peer starts once (``--threads``: the model threads
each peer is given), then each scenario runs its burner and ``--rounds`` rounds; in each round every
peer generates once, in an order rotated round by round, and the others are stopped (SIGSTOP) while
one is timed. Each round's rate is the peer's own timing of its ``generate`` call.

Scenarios (each burner bounded: it is stopped when its scenario ends, and dies on its own after
``--burner-limit-s`` whatever happens to this script):

- ``quiet``: nothing added (the machine's own load is printed with every round);
- ``busy``: two processes spinning in a Python loop (two runnable threads that never sleep);
- ``matmul``: one torch process multiplying 512x512 matrices on two OpenMP threads;
- ``neighbour``: a realistic neighbour, ``--neighbour tests`` (default: this tree's test slice
  ``--neighbour-tests`` run again and again by pytest: short processes, spawned TP ranks, compiles,
  memory traffic) or ``--neighbour engine`` (a second warmcap engine of this tree generating
  the same workload at its default threads, in a loop).

Peers (``--peers``, comma-separated): ``NAME=TREE`` runs ``warmcap_peer.py`` with ``TREE/src`` on
``PYTHONPATH`` (this script's tree, or a baseline checkout such as ``git worktree add /tmp/base
49e82ec``); ``NAME=TREE@KEY=VALUE@...`` adds environment variables to that peer (``OMP_WAIT_POLICY``,
...) and ``@arg:NAME=VALUE`` an ``LLM`` keyword (``@arg:cpu_threads_bind=none``); ``vllm`` runs ``vllm_peer.py`` with ``--vllm-python``, its threads
pinned to cores ``0..threads-1`` (``VLLM_CPU_OMP_THREADS_BIND``, as ``bench_throughput.py`` pins
them); ``vllm@tp=2`` runs it with ``tensor_parallel_size=2``, the ``--threads`` cores split between its
ranks (named ``vllm_tp2``).

The summary gives, per thread count and scenario: each peer's median and its rounds' spread (worst
round / median), every warmcap peer's median against vLLM's and against the first peer's, and the
worst round of each warmcap peer against vLLM's median (a collapse shows there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

#: the environment as the caller gave it, before this script imports warmcap (which sets OpenMP's
#: wait policy for its own process): each peer starts from this, so only its own code or its
#: ``@KEY=VALUE`` choose its policy
BASE_ENV = dict(os.environ)
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_PROMPTS = HERE / "data" / "bench_prompts.jsonl"
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SCENARIOS = ("quiet", "busy", "matmul", "neighbour")

BUSY = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"
MATMUL = (
    "import time, torch\ntorch.set_num_threads(2)\na = torch.randn(512, 512)\n"
    "end = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    a @ a\n"
)
#: pytest run again and again until the deadline (the neighbour of ``--neighbour tests``)
TESTS_LOOP = (
    "import subprocess, sys, time\nend = time.monotonic() + {limit}\n"
    "while time.monotonic() < end:\n"
    "    subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *{tests!r}],\n"
    "                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=max(1, end - time.monotonic()))\n"
)


@dataclass(slots=True)
class Peer:
    """One engine in its own process (its own process group, stopped while another peer runs)."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    setup: dict[str, object]
    proc: subprocess.Popen[str] | None = None
    info: str = ""
    seconds: dict[tuple[int, str], list[float]] = field(default_factory=dict)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self._send(json.dumps(self.setup))
        self.info = self._read("@@READY")
        self.pause()

    def pause(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def _send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _read(self, marker: str) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(marker):
                return line[len(marker) :].strip()
        sys.exit(f"peer {self.name} exited ({self.proc.wait()}) before {marker}: see its log above")

    def run(self) -> tuple[float, list[list[int]]]:
        self.resume()
        try:
            self._send("run")
            result = json.loads(self._read("@@RESULT"))
        finally:
            self.pause()
        return result["seconds"], result["token_ids"]

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()
        try:
            self._send("stop")
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _die_with_parent() -> None:
    """Run in a child before exec: it gets SIGKILL when this script dies (Linux), so a killed run
    leaves no stopped peer or spinning burner behind."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Burner:
    """The load of one scenario: processes in their own process groups, killed at :meth:`stop`,
    each also bounded by its own deadline."""

    def __init__(self, scripts: list[str], env: dict[str, str]) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", s],
                env=env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            for s in scripts
        ]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()


def parse_peers(spec: str, args: argparse.Namespace, base_setup: dict[str, object]) -> list[Peer]:
    peers = []
    for item in spec.split(","):
        item = item.strip()
        if item == "vllm" or item.startswith("vllm@"):
            if not Path(args.vllm_python).is_file():
                sys.exit(
                    f"vLLM's interpreter {str(args.vllm_python)!r} does not exist: run "
                    "benchmarks/setup_vllm_cpu.sh or pass --vllm-python"
                )
            tp, model, name = 1, None, None
            for extra in item.split("@")[1:]:
                key, eq, value = extra.partition("=")
                if key == "tp" and value.isdigit() and int(value) >= 1:
                    tp = int(value)
                elif key == "model" and value:
                    model = peer_model(value, args.model)
                elif key == "name" and value:
                    name = value
                else:
                    sys.exit(
                        f"peer {item!r}: vLLM takes @tp=N (its tensor-parallel size), @model=DIR, @name=NAME"
                    )
            env = dict(BASE_ENV)
            env.pop("PYTHONPATH", None)
            env["VLLM_CPU_OMP_THREADS_BIND"] = vllm_bind(args.threads_now, tp)
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            setup = {**base_setup, "enable_prefix_caching": True, "tensor_parallel_size": tp}
            if model is not None:
                setup["model"] = model
            name = name or ("vllm" if tp == 1 else f"vllm_tp{tp}")
            peers.append(Peer(name, [str(args.vllm_python), str(HERE / "vllm_peer.py")], env, setup))
            continue
        name, sep, rest = item.partition("=")
        if not sep:
            sys.exit(f"peer {item!r}: use NAME=TREE[@KEY=VALUE...] or vllm")
        tree, *extras = rest.split("@")
        src = (Path(tree).resolve() / "src").resolve()
        if not (src / "warmcap").is_dir():
            sys.exit(f"peer {name}: {src} has no warmcap package")
        env = dict(BASE_ENV)
        env["PYTHONPATH"] = str(src)
        engine_args: dict[str, object] = {}
        model = None
        for extra in extras:
            key, eq, value = extra.partition("=")
            if not eq:
                sys.exit(f"peer {name}: {extra!r} is not KEY=VALUE")
            if key.startswith("arg:"):
                engine_args[key[4:]] = json.loads(value) if value[:1].isdigit() else value
            elif key == "model":
                model = peer_model(value, args.model)
            else:
                env[key] = value
        setup = {**base_setup, "threads": args.threads_now, "engine_args": engine_args}
        if model is not None:
            setup["model"] = model
        peers.append(Peer(name, [sys.executable, str(HERE / "warmcap_peer.py")], env, setup))
    return peers


def peer_model(value: str, base: str) -> str:
    """A peer's own ``@model=``: a directory, a preset, or ``padded`` / ``padded:N`` (``base``, the
    run's ``--model``, with its KV groups padded to N, default 4: ``pad_heads.py``, for a vLLM TP=2
    that refuses SmolLM2's 9 heads; the same function of the input)."""
    if value.split(":")[0] != "padded":
        from warmcap.models.presets import resolve_model

        return str(resolve_model(value))
    from pad_heads import padded_model

    return str(padded_model(base, int(value.split(":")[1]) if ":" in value else 4))


def vllm_bind(threads: int, tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``threads`` model threads in all: one rank on cores
    ``0..threads-1``; with ``tp`` ranks, the cores split evenly, a list per rank separated by ``|``
    (vLLM's own choice with several ranks keeps a core back for its front end, which on two cores
    leaves one core for two ranks)."""
    if tp == 1:
        return "0" if threads <= 1 else f"0-{threads - 1}"
    each = max(1, threads // tp)
    return "|".join(f"{r * each}" if each == 1 else f"{r * each}-{(r + 1) * each - 1}" for r in range(tp))


def burner_for(scenario: str, args: argparse.Namespace) -> Burner | None:
    limit = args.burner_limit_s
    env = dict(BASE_ENV)
    env["PYTHONPATH"] = str(ROOT / "src")
    if scenario == "quiet":
        return None
    if scenario == "busy":
        return Burner([BUSY.format(limit=limit)] * 2, env)
    if scenario == "matmul":
        return Burner([MATMUL.format(limit=limit)], env)
    if args.neighbour == "tests":
        return Burner([TESTS_LOOP.format(limit=limit, tests=args.neighbour_tests.split())], env)
    setup = json.dumps({**args.base_setup, "threads": None})
    loop = (
        "import subprocess, sys, time\nend = time.monotonic() + {limit}\n"
        "p = subprocess.Popen([sys.executable, {peer!r}], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)\n"
        "p.stdin.write({setup!r} + '\\n'); p.stdin.flush()\n"
        "while time.monotonic() < end and p.poll() is None:\n"
        "    p.stdin.write('run\\n'); p.stdin.flush(); time.sleep(0.5)\n"
        "p.kill()\n"
    ).format(limit=limit, peer=str(HERE / "warmcap_peer.py"), setup=setup)
    return Burner([loop], env)


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset name or HF directory")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--peers", default="warmcap=.,vllm")
    parser.add_argument("--threads", default="1,2", help="comma-separated model thread counts")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="no graphs in warmcap, no torch.compile in vLLM")
    parser.add_argument("--neighbour", choices=("tests", "engine"), default="tests")
    parser.add_argument(
        "--neighbour-tests",
        default="tests/distributed/test_spawn.py tests/kernels/cpu/test_build.py tests/test_engine.py",
        help="the test slice --neighbour tests runs in a loop (space-separated pytest arguments)",
    )
    parser.add_argument("--settle-s", type=float, default=5.0, help="seconds a burner runs before timing")
    parser.add_argument("--burner-limit-s", type=float, default=3600.0, help="a burner's own deadline")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=Path(os.environ.get("WARMCAP_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON),
    )
    parser.add_argument("--json", type=Path, help="also write every round here")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    for s in scenarios:
        if s not in SCENARIOS:
            parser.error(f"unknown scenario {s!r}: use some of {', '.join(SCENARIOS)}")

    sys.path.insert(0, str(HERE))
    from bench_throughput import load_prompts, prompt_ids

    from warmcap.models.loader import load_tokenizer
    from warmcap.models.presets import resolve_model

    path = resolve_model(args.model)
    ids = prompt_ids(load_tokenizer(path), load_prompts(args.prompts, args.num_prompts), chat=True)
    args.base_setup = {
        "model": str(path),
        "prompt_ids": ids,
        "max_tokens": args.max_tokens,
        "max_model_len": max(len(p) for p in ids) + args.max_tokens + 16,
        "enforce_eager": args.eager,
    }
    print(
        f"date {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; cores {sorted(os.sched_getaffinity(0))}"
    )
    print(
        f"model {args.model}: {len(ids)} prompts x {args.max_tokens} new tokens, greedy, ignore_eos, fp32, "
        f"{'eager' if args.eager else 'default (graphs / compile)'}; load at start {load()}"
    )
    rows: list[dict[str, object]] = []
    all_peers: list[Peer] = []
    try:
        for threads in [int(t) for t in args.threads.split(",")]:
            args.threads_now = threads
            peers = parse_peers(args.peers, args, args.base_setup)
            all_peers = peers
            for p in peers:
                p.start()
                print(f"[{threads} thread(s)] {p.name} ready {p.info}", flush=True)
            for scenario in scenarios:
                burner = burner_for(scenario, args)
                try:
                    if burner is not None:
                        time.sleep(args.settle_s)
                    for r in range(args.rounds):
                        order = peers[r % len(peers) :] + peers[: r % len(peers)]
                        parts = []
                        reference: list[list[int]] | None = None
                        for p in order:
                            secs, out = p.run()
                            tokens = sum(map(len, out))
                            p.seconds.setdefault((threads, scenario), []).append(tokens / secs)
                            same = "" if reference is None or out == reference else " (OUTPUT DIFFERS)"
                            reference = reference or out
                            parts.append(f"{p.name} {tokens / secs:.1f}{same}")
                            # each run as it ends: a run cut short on a loaded machine keeps them
                            print(
                                f"  ({threads} thread(s) {scenario} round {r + 1}: {parts[-1]} tok/s)",
                                flush=True,
                            )
                            rows.append(
                                {"threads": threads, "scenario": scenario, "round": r + 1, "peer": p.name,
                                 "tok_s": tokens / secs, "load": os.getloadavg()[0]}
                            )  # fmt: skip
                        print(
                            f"[{threads} thread(s)] {scenario:9s} round {r + 1} (load {load()}): "
                            + ", ".join(parts)
                            + " tok/s",
                            flush=True,
                        )
                finally:
                    if burner is not None:
                        burner.stop()
            summarize(threads, scenarios, peers)
            for p in peers:
                p.close()
    finally:
        for p in all_peers:
            p.close()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def summarize(threads: int, scenarios: list[str], peers: list[Peer]) -> None:
    print(f"summary, {threads} thread(s): median tok/s [worst round / median]; ratios of medians")
    ours = [p for p in peers if not p.name.startswith("vllm")]
    vllms = [p for p in peers if p.name.startswith("vllm")]
    first = ours[0] if ours else None
    for scenario in scenarios:
        med = {p.name: statistics.median(p.seconds[(threads, scenario)]) for p in peers}
        worst = {p.name: min(p.seconds[(threads, scenario)]) for p in peers}
        parts = [f"{p.name} {med[p.name]:.1f} [{worst[p.name] / med[p.name]:.2f}]" for p in peers]
        ratios = []
        for p in ours:
            for v in vllms:
                ratios.append(
                    f"{p.name}/{v.name} {med[p.name] / med[v.name]:.2f}x "
                    f"(worst round {worst[p.name] / med[v.name]:.2f}x)"
                )
            if first is not None and p is not first:
                ratios.append(f"{p.name}/{first.name} {med[p.name] / med[first.name]:.2f}x")
        print(
            f"  {scenario:9s} " + ", ".join(parts) + ("; " + ", ".join(ratios) if ratios else ""), flush=True
        )


if __name__ == "__main__":
    main()
