"""Errors the OpenAI way: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised by a handler to answer with ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Body-validation failures become 400 (not FastAPI's 422) and every error gets the OpenAI body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        param = None
        for e in exc.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            param = param or where or None
            problems.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
        return error_response(400, "invalid request: " + "; ".join(problems), "invalid_request", param)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")
