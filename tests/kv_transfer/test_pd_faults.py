"""Transfer faults between separate P, D and proxy processes: each ends the affected request with
a clear error, frees its blocks, and leaves the servers serving."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pd_servers import transfer_config

from server_procs import cluster, free_port
from warmcap.kv_transfer.nixl_worker import FAULT_PAUSE_ENV

pytestmark = pytest.mark.slow

TINY = "tiny-llama"
ENGINE = ["--num-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager"]
PROMPT = list(range(40, 80))
#: how long D pauses mid-read in the killed-mid-read test
PAUSE_S = 6


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


def test_p_killed_while_d_reads(tmp_path) -> None:
    with cluster(tmp_path) as c:
        p = c.serve("P", TINY, "--kv-transfer-config", transfer_config("kv_producer"), *ENGINE)
        # D reads one block per READ (the 40-token prompt: 3 of them) and, after posting the first,
        # pauses its engine thread: P is killed then, with D's read in flight.
        d = c.serve(
            "D",
            TINY,
            "--kv-transfer-config",
            transfer_config("kv_consumer", read_timeout=10, read_chunk_blocks=1),
            *ENGINE,
            env={FAULT_PAUSE_ENV: str(PAUSE_S)},
        )
        c.wait_ready(p, d)
        local = _complete(d.base_url)
        assert local.status_code == 200
        # Another prompt than D's own request: D holds no prefix of it, so it reads every block.
        other = list(range(100, 140))
        params = _complete(
            p.base_url, prompt=other, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        ).json()["kv_transfer_params"]
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            pending = pool.submit(_complete, d.base_url, prompt=other, kv_transfer_params=params)
            time.sleep(PAUSE_S / 4)  # D has posted its first READ and sleeps
            p.process.send_signal(signal.SIGKILL)
            p.process.wait(30)
            dead = pending.result(timeout=60)
        # D did pause mid-read (it pauses only after a first READ was posted), so P died mid-read.
        assert time.monotonic() - started >= PAUSE_S
        # The request ends with the transfer's failure, in bounded time; D frees and serves on.
        assert dead.status_code == 502, dead.text
        message = dead.json()["error"]["message"]
        assert "prompt KV from 127.0.0.1" in message, message
        assert time.monotonic() - started < PAUSE_S + 30
        assert d.kv_usage() == 0
        assert _complete(d.base_url).json()["choices"] == local.json()["choices"]
