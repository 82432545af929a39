"""Serving load test: ``warmup serve``'s app on loopback, 1, 8 and 32 concurrent streaming clients,
against offline ``generate`` on the same engine and the same workload.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_serve.py [--model smollm2-135m] [--max-tokens 32]
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_serve.py --default-flags --concurrency 1,32

``--default-flags`` builds the engine as ``warmup serve --model M`` does (vLLM's server limits for
the device: on CPU ``max_num_seqs`` 128, ``max_num_batched_tokens`` 2048, the fixed KV space, eager;
the model's own ``max_model_len``) instead of sizing it for the workload; every level's tokens/s is
also given as a ratio to one client's, the check that concurrent clients are never served slower in
total.

``--startup`` first launches ``warmup serve --model M`` itself (a child process, default flags plus
``--startup-args``) and prints the seconds from launch to ``GET /health`` 200 and the server's
resident memory then (psutil), ``--startup-rounds`` times; ``--concurrency ''`` stops there.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_serve.py --startup --startup-rounds 3 --concurrency ''

Greedy, ``ignore_eos``: every request produces exactly ``max_tokens``. One engine is started once (the
audited start-up of ``warmup serve``); offline ``generate`` over all prompts is timed on it first,
then the same engine serves every concurrency level through the ``openai`` client. Bounded: each level
sends at most ``--num-requests`` requests and stops sending after ``--level-seconds``; the whole run
ends after ``--time-limit`` seconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "data" / "bench_prompts.jsonl"


@dataclass(slots=True)
class Sample:
    ttft: float
    e2e: float
    tokens: int

    @property
    def itl(self) -> float:
        """Mean seconds between tokens after the first."""
        return (self.e2e - self.ttft) / max(self.tokens - 1, 1)


def load_prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows[:n]]


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, base_url: str, t0: float, timeout: float) -> float | None:
    """Seconds from ``t0`` (``time.perf_counter()`` at launch) until ``GET base_url/health`` answers
    200; None when ``proc`` exits first or ``timeout`` seconds pass (``proc.poll()`` tells which)."""
    import httpx

    while proc.poll() is None and time.perf_counter() - t0 <= timeout:
        try:
            if httpx.get(base_url + "/health", timeout=1.0).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return None


def process_tree(pid: int) -> list:
    """``pid``'s process and all its descendants (``psutil.Process``), e.g. tensor-parallel workers."""
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def one_request(client, model: str, prompt: str, max_tokens: int) -> Sample:
    t0 = time.perf_counter()
    first = None
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    tokens = 0
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return Sample((first or end) - t0, end - t0, tokens)


def run_level(
    client, model: str, prompts: list[str], concurrency: int, max_tokens: int, seconds: float
) -> dict:
    samples: list[Sample] = []
    lock = threading.Lock()
    next_index = iter(range(len(prompts)))
    deadline = time.perf_counter() + seconds

    def worker() -> None:
        while time.perf_counter() < deadline:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            s = one_request(client, model, prompts[i], max_tokens)
            with lock:
                samples.append(s)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [s.ttft for s in samples]
    itl = [s.itl for s in samples]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "seconds": wall,
        "requests_per_s": len(samples) / wall,
        "tokens_per_s": sum(s.tokens for s in samples) / wall,
        "ttft_p50": pct(ttft, 50),
        "ttft_p90": pct(ttft, 90),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50),
        "itl_p90": pct(itl, 90),
        "itl_p99": pct(itl, 99),
        "itl_mean": statistics.fmean(itl),
    }


def client_level(
    base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, seconds: float
) -> dict:
    """One concurrency level, run in its own process: the clients are separate programs, as real
    ones are, so their SSE parsing does not take the server's interpreter lock or its cores' time
    slices inside the server process."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    return run_level(client, model, prompts, concurrency, max_tokens, seconds)


def serve_startup(model: str, extra: list[str], timeout: float = 600.0) -> tuple[float, int, float]:
    """Seconds from launching ``warmup serve --model M`` to ``/health`` 200, its resident bytes then
    (the process and any children, e.g. tensor-parallel workers), and the CPU seconds it spent
    (user + system: on a busy machine the steadier measure of what start-up costs)."""
    import os
    import subprocess

    port = free_port()
    code = "from warmcap.cli import main; main()"
    argv = [sys.executable, "-c", code, "serve", "--model", model, "--port", str(port), "-q", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    try:
        ready = wait_healthy(proc, f"http://127.0.0.1:{port}", t0, timeout)
        if ready is None:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"warmup serve exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}"
                )
            raise TimeoutError(f"warmup serve not ready after {timeout} s")
        procs = process_tree(proc.pid)
        rss = sum(p.memory_info().rss for p in procs)
        cpu = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
        return ready, rss, cpu
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=32, help="Most requests per level (<= 32 prompts).")
    ap.add_argument("--concurrency", default="1,8,32", help="Client levels ('' for none).")
    ap.add_argument(
        "--startup", action="store_true", help="First measure `warmup serve` start-up (module doc)."
    )
    ap.add_argument("--startup-rounds", type=int, default=1)
    ap.add_argument(
        "--startup-args", default="", help="Extra `warmup serve` flags for --startup, one string."
    )
    ap.add_argument(
        "--capture-sizes",
        default=None,
        help="Token counts to capture (default 1,2,4,8,16,32; with --default-flags, start-up's choice).",
    )
    ap.add_argument(
        "--default-flags",
        action="store_true",
        help="Engine as `warmup serve --model M` builds it with no other flag, not sized for the workload.",
    )
    ap.add_argument("--enforce-eager", action="store_true", help="Capture no graphs (warmup serve's flag).")
    ap.add_argument("--spec", default=None, help="Speculative config, as warmup serve's --spec.")
    ap.add_argument("--level-seconds", type=float, default=120.0)
    ap.add_argument("--time-limit", type=float, default=900.0)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="Model threads (torch intra-op) for the engine, offline and served alike; default what "
        "warmup serve picks (one per core on CPU).",
    )
    args = ap.parse_args()
    # Progress must show when stdout is a file (a long run on a busy machine).
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    if args.startup:
        for i in range(args.startup_rounds):
            ready, rss, cpu = serve_startup(args.model, args.startup_args.split())
            print(
                f"warmup serve --model {args.model} {args.startup_args}: ready in {ready:.1f} s "
                f"({cpu:.1f} s CPU), resident {rss / 1e9:.2f} GB (round {i + 1}; acceptance: <= 15 s, <= 3 GB)"
            )
    if not args.concurrency:
        return
    import torch

    from warmcap.serve.server import serving_model_threads

    threads = serving_model_threads("cpu", args.threads)
    if threads is not None:
        torch.set_num_threads(threads)
    print(f"model threads: {torch.get_num_threads()}")
    started_at = time.perf_counter()

    import uvicorn

    from warmcap.config import StartupOptions
    from warmcap.graphs.capture.sizes import parse_capture_sizes
    from warmcap.llm import build_config
    from warmcap.sampling_params import SamplingParams
    from warmcap.serve import ServeOptions, build_app
    from warmcap.serve.startup_facts import start_engine

    prompts = load_prompts(args.num_requests)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.default_flags:
        from warmcap.cli import serving_enforce_eager, serving_engine_values

        # NOTE: `warmup serve`'s defaults (cli.py); prefix caching stays on, as it is there.
        limits = serving_engine_values({"device": "cpu", "tensor_parallel_size": 1})
        sizing: dict[str, object] = {k: limits[k] for k in ("max_num_seqs", "max_num_batched_tokens")}
        args.enforce_eager = args.enforce_eager or serving_enforce_eager("cpu")
        capture = args.capture_sizes
    else:
        sizing = {
            "max_num_seqs": max(levels),
            "max_num_batched_tokens": 2048,
            "max_model_len": 512,
            "enable_prefix_caching": False,
        }
        capture = args.capture_sizes or "1,2,4,8,16,32"
    config = build_config(
        args.model, device="cpu", enforce_eager=args.enforce_eager, speculative_config=args.spec, **sizing
    )
    sizes = tuple(parse_capture_sizes(capture)) if capture else None
    started = start_engine(config, StartupOptions(capture_sizes=sizes))
    engine = started.engine
    print(
        f"start-up {time.perf_counter() - started_at:.1f} s; refusal: {started.refusal}; "
        f"max_num_seqs {engine.config.scheduler.max_num_seqs}, max_model_len {engine.config.max_model_len}, "
        f"graphs: {'none' if engine.graph_startup is None else 'captured'}"
    )

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def offline() -> float:
        """Tokens/s of one generate() over every prompt on the same engine."""
        t0 = time.perf_counter()
        outs = engine.generate(prompts, [params] * len(prompts))
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)

    # Best of two, so one busy moment on a shared machine does not flatter the server.
    offline_tps = max(offline(), offline())
    print(f"offline generate: {offline_tps:.1f} tokens/s ({len(prompts)} prompts x {args.max_tokens} tokens)")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = build_app(config, ServeOptions(), start=lambda: started)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    results = []
    try:
        while app.state.warmcap.loop.state.value != "ready":
            if time.perf_counter() - started_at > args.time_limit:
                raise TimeoutError("server not ready within the time limit")
            time.sleep(0.05)
        clients = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        base_url = f"http://127.0.0.1:{port}/v1"
        for c in levels:
            left = args.time_limit - (time.perf_counter() - started_at)
            if left <= 0:
                print(f"time limit reached before concurrency {c}")
                break
            r = clients.submit(
                client_level, base_url, args.model, prompts, c, args.max_tokens, min(args.level_seconds, left)
            ).result()
            r["vs_offline"] = r["tokens_per_s"] / offline_tps
            one = next((x for x in results if x["concurrency"] == 1), None)
            r["vs_one_client"] = r["tokens_per_s"] / one["tokens_per_s"] if one else None
            results.append(r)
            print(
                f"c={c:>2}: {r['requests']} req in {r['seconds']:.1f} s, {r['requests_per_s']:.2f} req/s, "
                f"{r['tokens_per_s']:.1f} tok/s ({r['vs_offline']:.2f}x offline"
                + (f", {r['vs_one_client']:.2f}x one client); " if r["vs_one_client"] else "); ")
                + f"TTFT p50/p90/p99 {r['ttft_p50'] * 1e3:.0f}/{r['ttft_p90'] * 1e3:.0f}/{r['ttft_p99'] * 1e3:.0f} ms; "
                f"ITL p50/p90/p99 {r['itl_p50'] * 1e3:.1f}/{r['itl_p90'] * 1e3:.1f}/{r['itl_p99'] * 1e3:.1f} ms"
            )
        clients.shutdown()
    finally:
        server.should_exit = True
        thread.join(60)
    print(
        json.dumps(
            {
                "model": args.model,
                "max_tokens": args.max_tokens,
                "default_flags": args.default_flags,
                "enforce_eager": args.enforce_eager,
                "spec": args.spec,
                "offline_tokens_per_s": offline_tps,
                "levels": results,
            }
        )
    )


if __name__ == "__main__":
    main()
