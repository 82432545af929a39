"""``kv_transfer_params`` on the OpenAI endpoints of a P and a D server in one process: P answers
with its block ids, D reads them and answers like P's own greedy decode; bad parameters are a 400
before anything is queued, a failed read a 502 that names the cause and fails no other request."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_fixtures import running

from warmcap.llm import build_config
from warmcap.serve import ServeOptions, build_app

MODEL = "tiny-llama"
ENGINE_KW = {
    "num_blocks": 64,
    "max_model_len": 128,
    "max_num_seqs": 4,
    "device": "cpu",
    "enforce_eager": True,
}
DECODE = {"do_remote_decode": True}


def _server(role: str):
    config = build_config(
        MODEL, kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": role}, **ENGINE_KW
    )
    return running(build_app(config, ServeOptions()))


@pytest.fixture(scope="module")
def pd():
    # NOTE: one after the other: two engine threads importing transformers at once can race.
    with _server("kv_producer") as p:
        p.wait_ready()
        with _server("kv_consumer") as d:
            d.wait_ready()
            yield p, d


def _post(srv, path: str, **body) -> httpx.Response:
    return httpx.post(srv.base_url + path, json={"model": MODEL, **body}, timeout=120)


def test_completion_and_chat_carry_kv_transfer_params_from_p_to_d(pd) -> None:
    p, d = pd
    prompt = list(range(30, 70))
    want = _post(p, "/v1/completions", prompt=prompt, max_tokens=8, temperature=0).json()
    assert want["kv_transfer_params"] is None
    prefill = _post(
        p, "/v1/completions", prompt=prompt, max_tokens=1, temperature=0, kv_transfer_params=DECODE
    )
    params = prefill.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(prompt)
    got = _post(d, "/v1/completions", prompt=prompt, max_tokens=8, temperature=0, kv_transfer_params=params)
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == want["choices"][0]["text"]
    messages = [{"role": "user", "content": "hello there"}]
    chat = _post(p, "/v1/chat/completions", messages=messages, max_tokens=1, kv_transfer_params=DECODE).json()
    answer = _post(
        d,
        "/v1/chat/completions",
        messages=messages,
        max_tokens=4,
        kv_transfer_params=chat["kv_transfer_params"],
    )
    assert answer.status_code == 200
    assert answer.json()["usage"]["prompt_tokens"] == chat["kv_transfer_params"]["remote_num_tokens"]
    assert p.all_blocks_free() and d.all_blocks_free()


def test_parameters_a_server_cannot_honour_are_a_400(pd) -> None:
    p, d = pd
    two = _post(p, "/v1/completions", prompt=["a", "b"], kv_transfer_params=DECODE)
    assert two.status_code == 400 and "one prompt" in two.json()["error"]["message"]
    wrong_role = _post(d, "/v1/completions", prompt="a", kv_transfer_params=DECODE)
    assert (
        wrong_role.status_code == 400 and "needs a prefill instance" in wrong_role.json()["error"]["message"]
    )
    incomplete = _post(d, "/v1/completions", prompt="a", kv_transfer_params={"do_remote_prefill": True})
    assert incomplete.status_code == 400 and "lacks" in incomplete.json()["error"]["message"]


def test_a_failed_read_is_a_502_and_d_serves_on(pd) -> None:
    p, d = pd
    prompt = list(range(100, 140))
    params = _post(p, "/v1/completions", prompt=prompt, max_tokens=1, kv_transfer_params=DECODE).json()[
        "kv_transfer_params"
    ]
    bad = _post(
        d,
        "/v1/completions",
        prompt=prompt,
        max_tokens=4,
        kv_transfer_params={**params, "remote_engine_id": "x"},
    )
    assert bad.status_code == 502 and "does not match" in bad.json()["error"]["message"]
    assert _post(d, "/v1/completions", prompt=prompt, max_tokens=4).status_code == 200
    assert p.all_blocks_free() and d.all_blocks_free()


def test_a_nixl_error_mid_read_fails_its_request_only(pd, monkeypatch) -> None:
    """NIXL's transfer-state call raising while D reads (a prefill instance gone mid-transfer) ends
    that request with a 502 naming NIXL's error; a plain request decoding on D meanwhile completes
    with the text it has alone."""
    from nixl_cu12._bindings import nixlRemoteDisconnectError

    p, d = pd
    plain = {"prompt": list(range(10, 20)), "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    alone = _post(d, "/v1/completions", **plain).json()["choices"][0]["text"]
    prompt = list(range(200, 240))
    params = _post(p, "/v1/completions", prompt=prompt, max_tokens=1, kv_transfer_params=DECODE).json()[
        "kv_transfer_params"
    ]
    engine = d.state.loop.engine
    agent = engine.kv_connector_worker._agent
    fired: list[int] = []

    def check_xfer_state(handle: object) -> str:
        # Runs in D's engine thread: the read stays in flight until the plain request is decoding
        # beside it, then NIXL's call raises, as it does when the peer vanishes mid-transfer.
        if not engine.scheduler.running:
            return "PROC"
        fired.append(len(engine.scheduler.running))
        raise nixlRemoteDisconnectError("remote agent disconnected (injected)")

    monkeypatch.setattr(agent, "check_xfer_state", check_xfer_state)
    with ThreadPoolExecutor(1) as pool:
        failing = pool.submit(
            _post, d, "/v1/completions", prompt=prompt, max_tokens=4, kv_transfer_params=params
        )
        time.sleep(0.2)  # D has posted its READs and polls them
        stream = [
            json.loads(line[len("data: ") :])
            for line in httpx.post(
                d.base_url + "/v1/completions", json={"model": MODEL, "stream": True, **plain}, timeout=120
            ).text.splitlines()
            if line.startswith("data: {")
        ]
        failed = failing.result(timeout=60)
    assert fired, "the injected NIXL error never fired"
    assert failed.status_code == 502, failed.text
    message = failed.json()["error"]["message"]
    assert "nixlRemoteDisconnectError" in message and "prompt KV" in message, message
    assert "".join(c["choices"][0]["text"] for c in stream if c["choices"]) == alone
    assert stream[-1]["choices"][0]["finish_reason"] == "length"
    assert d.all_blocks_free() and p.all_blocks_free()
