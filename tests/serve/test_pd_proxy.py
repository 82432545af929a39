"""``warmup proxy`` against stand-in P and D apps: what each is sent, what the client gets back, and
clear errors when either is unreachable or P answers without transfer parameters."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from serve_fixtures import running

from server_procs import free_port
from warmcap.serve.proxy import build_proxy

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": {"full": [1]}}


def _stand_in(name: str, seen: list[dict], answer_params: dict | None = PARAMS, status: int = 200) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        if status != 200:
            return JSONResponse({"error": {"message": f"{name} refused", "code": "x"}}, status_code=status)
        if body.get("stream"):

            async def events():
                for piece in ("a", "b"):
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': piece}]})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return {"choices": [{"index": 0, "text": name}], "kv_transfer_params": answer_params}

    return app


def test_p_gets_one_token_and_do_remote_decode_then_d_gets_the_request_with_p_params() -> None:
    p_seen, d_seen = [], []
    with (
        running(_stand_in("P", p_seen)) as p,
        running(_stand_in("D", d_seen)) as d,
        running(build_proxy(p.base_url, d.base_url)) as proxy,
    ):
        body = {"model": "m", "prompt": "hi", "max_tokens": 9, "stream_options": {"include_usage": True}}
        answer = httpx.post(proxy.base_url + "/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "D"
        assert p_seen == [
            {
                "model": "m",
                "prompt": "hi",
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {"do_remote_decode": True},
            }
        ]
        assert d_seen == [{**body, "kv_transfer_params": PARAMS}]
        streamed = httpx.post(proxy.base_url + "/v1/completions", json={**body, "stream": True}, timeout=30)
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.endswith("data: [DONE]\n\n") and '"text": "a"' in streamed.text
        assert httpx.get(proxy.base_url + "/health").status_code == 200


@pytest.mark.parametrize("down", ["prefill", "decode"])
def test_an_unreachable_server_is_a_502_naming_it(down: str) -> None:
    with running(_stand_in("up", [])) as up:
        gone = f"http://127.0.0.1:{free_port()}"
        urls = (gone, up.base_url) if down == "prefill" else (up.base_url, gone)
        with running(build_proxy(*urls)) as proxy:
            answer = httpx.post(
                proxy.base_url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30
            )
            assert answer.status_code == 502
            assert f"the {down} server at {gone}" in answer.json()["error"]["message"]
            assert httpx.get(proxy.base_url + "/health").status_code == 502


def test_p_errors_pass_through_and_p_without_params_is_a_502() -> None:
    with (
        running(_stand_in("P", [], status=400)) as p,
        running(_stand_in("D", [])) as d,
        running(build_proxy(p.base_url, d.base_url)) as proxy,
    ):
        answer = httpx.post(
            proxy.base_url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30
        )
        assert answer.status_code == 400 and answer.json()["error"]["message"] == "P refused"
    d_seen: list[dict] = []
    with (
        running(_stand_in("P", [], answer_params=None)) as p,
        running(_stand_in("D", d_seen)) as d,
        running(build_proxy(p.base_url, d.base_url)) as proxy,
    ):
        answer = httpx.post(
            proxy.base_url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30
        )
        assert (
            answer.status_code == 502
            and "returned no kv_transfer_params" in answer.json()["error"]["message"]
        )
        assert d_seen == []
