"""P/D on loopback against a colocated server: TTFT and throughput through ``warmup proxy`` (P +
D, NIXL over UCX) vs one ``warmup serve`` on the same prompts, plus the KV bytes D read per request
and the read rate.

    HF_HUB_OFFLINE=1 PYTHONPATH=src .venv/bin/python benchmarks/bench_pd.py [--model smollm2-135m]
        [--num-prompts 16] [--max-tokens 32] [--concurrency 4]

All four apps (P, D, the colocated server, the proxy) run in this process under uvicorn threads on
127.0.0.1, started eagerly (``enforce_eager``) with the same engine settings; greedy, ``ignore_eos``.
Each mode first answers one warm-up request; then the prompts are sent one at a time (TTFT, e2e),
then all of them by ``--concurrency`` clients at once (output tokens per second).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

# the same streaming client and workload as the serving benchmark (this script's folder is on sys.path)
from bench_serve import free_port, load_prompts, one_request


def serve_thread(app) -> tuple[str, object, threading.Thread]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    server.install_signal_handlers = lambda: None
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread


def wait_healthy(url: str, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def measure(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict[str, float]:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    one_request(client, model, prompts[0], max_tokens)
    samples = [one_request(client, model, p, max_tokens) for p in prompts]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        loaded = list(pool.map(lambda p: one_request(client, model, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    return {
        "ttft_median_s": statistics.median(s.ttft for s in samples),
        "e2e_median_s": statistics.median(s.e2e for s in samples),
        "tok_per_s_concurrent": sum(s.tokens for s in loaded) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()

    from warmcap.config import KVTransferConfig
    from warmcap.llm import build_config
    from warmcap.serve import ServeOptions, build_app
    from warmcap.serve.proxy import build_proxy

    base = build_config(
        args.model, num_blocks=256, max_model_len=512, max_num_seqs=8, device="cpu", enforce_eager=True
    )
    configs = {
        "P": replace(base, kv_transfer=KVTransferConfig("NixlConnector", "kv_producer")),
        "D": replace(base, kv_transfer=KVTransferConfig("NixlConnector", "kv_consumer")),
        "colocated": base,
    }
    apps = {name: build_app(config, ServeOptions()) for name, config in configs.items()}
    urls = {}
    servers = []
    try:
        # One after the other: engine threads importing transformers at once can race.
        for name, app in apps.items():
            urls[name], server, thread = serve_thread(app)
            servers.append((server, thread))
            wait_healthy(urls[name])
        urls["proxy"], server, thread = serve_thread(build_proxy(urls["P"], urls["D"]))
        servers.append((server, thread))
        prompts = load_prompts(args.num_prompts)
        results = {
            "P/D via proxy": measure(urls["proxy"], args.model, prompts, args.max_tokens, args.concurrency),
            "colocated": measure(urls["colocated"], args.model, prompts, args.max_tokens, args.concurrency),
        }
        stats = apps["D"].state.warmcap.loop.engine.kv_connector_worker.stats
    finally:
        for server, thread in servers:
            server.should_exit = True
            thread.join(60)
    print(
        f"model {args.model}, {len(prompts)} prompts, {args.max_tokens} tokens each, concurrency {args.concurrency}"
    )
    print("| mode | TTFT median (s) | e2e median (s) | tok/s at concurrency |")
    print("|---|---|---|---|")
    for mode, r in results.items():
        print(
            f"| {mode} | {r['ttft_median_s']:.3f} | {r['e2e_median_s']:.3f} | {r['tok_per_s_concurrent']:.1f} |"
        )
    per_request = stats.num_bytes / max(stats.num_reads, 1)
    seconds_per_read = stats.seconds / max(stats.num_reads, 1)
    rate = stats.num_bytes / stats.seconds / 1e9 if stats.seconds else 0.0
    print(
        f"KV reads on D: {stats.num_reads}, {per_request / 1e3:.1f} KB per request, "
        f"{seconds_per_read * 1e3:.1f} ms per read, {rate:.4f} GB/s (bytes over the time from posting a READ "
        "to seeing it done, which includes waiting for P's next poll)"
    )


if __name__ == "__main__":
    main()
