"""Transfer faults between separate P, D and proxy processes: each ends the affected request with
a clear error, frees its blocks, and leaves the servers serving."""

from __future__ import annotations

import signal

import httpx
import pytest
from pd_servers import cluster, free_port, transfer_config

pytestmark = pytest.mark.slow

TINY = "tiny-llama"
ENGINE = ["--num-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager"]
PROMPT = list(range(40, 80))


def _complete(base_url: str, **extra: object) -> httpx.Response:
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=180)


def test_d_before_p_then_p_killed_before_d_reads(tmp_path) -> None:
    p_port = free_port()
    with cluster(tmp_path) as c:
        d = c.serve(
            "D", TINY, "--kv-transfer-config", transfer_config("kv_consumer", read_timeout=10), *ENGINE
        )
        c.wait_ready(d)
        local = _complete(d.base_url)
        assert local.status_code == 200
        # D is up, P is not: the proxy names the prefill server it cannot reach.
        proxy = c._start(
            "proxy", ["proxy", "--prefill", f"http://127.0.0.1:{p_port}", "--decode", d.base_url]
        )
        assert proxy.health() == 502
        answer = _complete(proxy.base_url)
        assert answer.status_code == 502 and "prefill server" in answer.json()["error"]["message"]
        # Parameters naming a P that is not running: D's request ends with why; D serves on.
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "p",
            "remote_request_id": "r",
            "remote_block_ids": {"full": [1, 2, 3]},
            "remote_host": "127.0.0.1",
            "remote_port": free_port(),
        }
        gone = _complete(d.base_url, kv_transfer_params=params)
        assert gone.status_code == 502 and "cannot reach" in gone.json()["error"]["message"]
        assert d.kv_usage() == 0

        # P comes up later: P/D through a new proxy works and equals D's own greedy answer.
        p = c.serve("P", TINY, "--kv-transfer-config", transfer_config("kv_producer"), *ENGINE)
        c.wait_ready(p)
        proxy = c.proxy(p, d)
        c.wait_ready(proxy)
        assert _complete(proxy.base_url).json()["choices"] == local.json()["choices"]

        # P answers a prefill, then dies before D reads: D's read fails, D frees and serves on.
        prefill = _complete(p.base_url, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = prefill.json()["kv_transfer_params"]
        p.process.send_signal(signal.SIGKILL)
        p.process.wait(30)
        dead = _complete(d.base_url, kv_transfer_params=params)
        assert dead.status_code == 502, dead.text
        assert "prefill instance" in dead.json()["error"]["message"]
        assert _complete(d.base_url).json()["choices"] == local.json()["choices"]
        assert d.kv_usage() == 0
        # The proxy reports the dead P as unreachable instead of hanging.
        answer = _complete(proxy.base_url)
        assert answer.status_code == 502 and "prefill server" in answer.json()["error"]["message"]
