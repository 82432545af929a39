"""``warmup proxy``: one OpenAI endpoint in front of a prefill server (P) and a decode server (D).

Each completion or chat request goes first to P with ``max_tokens=1``, ``stream=false`` and
``kv_transfer_params={"do_remote_decode": true}``; P computes the prompt's KV, keeps its blocks and
answers with where they are. The original request then goes to D with P's ``kv_transfer_params``;
D reads the KV and decodes, and its answer (a JSON body or a stream) is passed through unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from warmcap import __version__
from warmcap.serve.errors import error_response

#: seconds one request to P or D may take (D's answer may be a long generation)
REQUEST_TIMEOUT_S = 600.0


def build_proxy(prefill_url: str, decode_url: str) -> FastAPI:
    """The proxy app; ``prefill_url``/``decode_url`` are the servers' base URLs (``http://host:port``)."""
    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
    client: httpx.AsyncClient

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nonlocal client
        client = httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S)
        try:
            yield
        finally:
            await client.aclose()

    app = FastAPI(title="warmcap proxy", version=__version__, lifespan=lifespan)

    async def forward(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "the request body is not JSON", "invalid_request")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object", "invalid_request")
        headers = _passed_headers(request)
        prefill = await _send(client, "prefill", prefill_url + path, _prefill_body(body), headers)
        if isinstance(prefill, Response):
            return prefill
        if prefill.status_code != 200:
            return _relay(prefill)
        params = prefill.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            return error_response(
                502,
                f"the prefill server at {prefill_url} returned no kv_transfer_params: start it with "
                '--kv-transfer-config \'{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}\'',
                "bad_gateway",
            )
        decode = await _send(
            client, "decode", decode_url + path, {**body, "kv_transfer_params": params}, headers, stream=True
        )
        if isinstance(decode, Response):
            return decode
        if decode.status_code != 200 or not body.get("stream"):
            await decode.aread()
            await decode.aclose()
            return _relay(decode)
        return StreamingResponse(
            decode.aiter_raw(),
            status_code=200,
            media_type=decode.headers.get("content-type", "text/event-stream"),
            background=BackgroundTask(decode.aclose),
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models", response_model=None)
    async def models(request: Request) -> Response:
        answer = await _send(client, "decode", decode_url + "/v1/models", None, _passed_headers(request))
        return answer if isinstance(answer, Response) else _relay(answer)

    @app.get("/health")
    async def health() -> Response:
        for role, url in (("prefill", prefill_url), ("decode", decode_url)):
            answer = await _send(client, role, url + "/health", None, {})
            if isinstance(answer, Response):
                return answer
            if answer.status_code != 200:
                return error_response(503, f"the {role} server at {url} is not ready", "engine_unavailable")
        return Response(status_code=200)

    return app


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What P is asked: the same request, one token, no stream, and keep the KV for a reader."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return out


def _passed_headers(request: Request) -> dict[str, str]:
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}


async def _send(
    client: httpx.AsyncClient,
    role: str,
    url: str,
    body: dict[str, Any] | None,
    headers: dict[str, str],
    *,
    stream: bool = False,
) -> httpx.Response | Response:
    """The server's answer, or a 502 response naming the server that could not be reached."""
    method = "GET" if body is None else "POST"
    try:
        request = client.build_request(method, url, json=body, headers=headers)
        return await client.send(request, stream=stream)
    except httpx.HTTPError as exc:
        return error_response(
            502,
            f"the {role} server at {url} is unreachable ({type(exc).__name__}: {exc}); start it or fix "
            f"--{role}",
            "bad_gateway",
        )


def _relay(answer: httpx.Response) -> Response:
    if answer.headers.get("content-type", "").startswith("application/json"):
        return JSONResponse(answer.json(), status_code=answer.status_code)
    return Response(
        answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type")
    )


def run_proxy(prefill_url: str, decode_url: str, *, host: str, port: int) -> None:
    """Serve the proxy under uvicorn until SIGINT/SIGTERM (then exit 0, as ``warmup serve`` does)."""
    import uvicorn

    from warmcap.serve.uvicorn_server import QuietExitServer

    config = uvicorn.Config(build_proxy(prefill_url, decode_url), host=host, port=port, log_level="info")
    QuietExitServer(config).run()
