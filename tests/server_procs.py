"""Start ``warmup serve`` / ``warmup proxy`` as separate processes on 127.0.0.1 (free ports, bounded
waits, each one's output in a log file), read their metrics, and always stop them. Shared by every
test that needs a real server process (P/D, shutdown signals, the acceptance harness)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

import warmcap

STARTUP_TIMEOUT_S = 300.0
SRC = str(Path(warmcap.__file__).resolve().parents[1])
CLI = [sys.executable, "-c", "from warmcap.cli import main; main()"]


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text -> value per (sample name, labels without model_name)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    process: subprocess.Popen
    base_url: str
    log: Path

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=180)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} not ready in time:\n{self.log_tail()}")

    def health(self, timeout: float = 60.0) -> int:
        """The status of ``/health`` once the process answers at all."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(self.base_url + "/health", timeout=30).status_code
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} does not answer:\n{self.log_tail()}")

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        return parse_metrics(httpx.get(self.base_url + "/metrics", timeout=10).text)

    def accepted_per_pos(self) -> list[float]:
        m = self.metrics()
        per_pos = {
            dict(labels)["position"]: v
            for (name, labels), v in m.items()
            if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        }
        return [per_pos[k] for k in sorted(per_pos, key=int)]

    def kv_usage(self, settle_s: float = 10.0) -> float:
        """KV usage once held blocks are released (a producer frees them when the reader confirms)."""
        deadline = time.monotonic() + settle_s
        while True:
            usage = self.metrics()[("vllm:kv_cache_usage_perc", frozenset())]
            if usage == 0 or time.monotonic() > deadline:
                return usage
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


class Cluster:
    """Processes started through :meth:`serve` / :meth:`proxy`; :meth:`close` stops them all."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []

    def _start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        port = free_port()
        log = self.tmp / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1", **(env or {})}
        with log.open("wb") as out:
            process = subprocess.Popen(
                [*CLI, *args, "--host", "127.0.0.1", "--port", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        proc = Proc(name, process, f"http://127.0.0.1:{port}", log)
        self.procs.append(proc)
        return proc

    def serve(self, name: str, model: str, *options: str, env: dict[str, str] | None = None) -> Proc:
        """``warmup serve`` with ``options``; ``env`` adds environment variables."""
        return self._start(name, ["serve", "--model", model, *options], env)

    def proxy(self, prefill: Proc, decode: Proc) -> Proc:
        return self._start("proxy", ["proxy", "--prefill", prefill.base_url, "--decode", decode.base_url])

    def wait_ready(self, *procs: Proc, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait_ready(deadline)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@contextlib.contextmanager
def cluster(tmp: Path) -> Iterator[Cluster]:
    c = Cluster(tmp)
    try:
        yield c
    finally:
        c.close()
