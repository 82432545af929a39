"""Start a warmcap server on 127.0.0.1 (a free port) in this process, read its metrics, stop it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI
from openai import OpenAI

from server_procs import free_port, parse_metrics
from warmcap.serve.state import ServerState

STARTUP_TIMEOUT_S = 240.0

#: the small engine most server tests run: tiny-llama on CPU, eager, a 128-block pool
TINY_MODEL = "tiny-llama"
TINY_ENGINE_KW = {
    "num_blocks": 128,
    "max_model_len": 256,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "device": "cpu",
    "enforce_eager": True,
}


@dataclass
class Running:
    app: FastAPI
    base_url: str
    api_key: str | None = None

    @property
    def state(self) -> ServerState:
        return self.app.state.warmcap

    def client(self, api_key: str | None = None) -> OpenAI:
        key = api_key or self.api_key or "unused"
        return OpenAI(base_url=self.base_url + "/v1", api_key=key, max_retries=0, timeout=120)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if httpx.get(self.base_url + "/health").status_code == 200:
                return
            time.sleep(0.1)
        raise TimeoutError(f"server at {self.base_url} not ready after {timeout} s")

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        return parse_metrics(httpx.get(self.base_url + "/metrics").text)

    def all_blocks_free(self, timeout: float = 10.0) -> bool:
        """Whether every KV block (the null block aside) is free, waiting for aborts to land."""
        engine = self.state.loop.engine
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if engine.kv_cache_manager.pool.num_free_blocks == engine.num_blocks - 1:
                return True
            time.sleep(0.05)
        return False


def metric(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@contextlib.contextmanager
def running(app: FastAPI, api_key: str | None = None) -> Iterator[Running]:
    """Serve ``app`` from a thread; always stopped (and its engine thread joined) on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    # NOTE: signal handlers can only be installed from the main thread; the test owns shutdown.
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.02)
        yield Running(app, f"http://127.0.0.1:{port}", api_key)
    finally:
        server.should_exit = True
        thread.join(60)


def gated(start: Callable[[], object]) -> tuple[Callable[[], object], threading.Event]:
    """``start`` held back until the returned event is set (to observe the server mid start-up)."""
    gate = threading.Event()

    def held() -> object:
        if not gate.wait(STARTUP_TIMEOUT_S):
            raise TimeoutError("the test never released start-up")
        return start()

    return held, gate
