"""The side channel between P and D: one JSON request and one JSON answer per TCP connection.

P listens (a stdlib threading TCP server); D asks it for its NIXL agent metadata and KV layout
(``{"op": "metadata"}``) before its first read, and tells it to free a request's blocks that it will
never read (``{"op": "release", "request_id": ...}``). Nothing from the network is unpickled: both
directions are one line of JSON (binary agent metadata travels base64-encoded).
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any

from warmcap.kv_transfer.params import KVTransferError

log = logging.getLogger("warmcap.kv_transfer")

#: the most bytes one message may have (a large model's layout is a few hundred KB)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class SideChannelServer:
    """Answers side-channel requests with ``handler`` from a daemon thread until :meth:`close`."""

    def __init__(self, host: str, port: int, handler: Handler) -> None:
        outer = self

        class _One(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(MAX_MESSAGE_BYTES)
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict):
                        raise ValueError("not a JSON object")
                    answer = outer._handler(request)
                except Exception as exc:  # a bad peer must not kill the listener
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
                self.wfile.write(json.dumps(answer).encode() + b"\n")

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._handler = handler
        try:
            self._server = _Server((host, port), _One)
        except OSError as exc:
            raise KVTransferError(
                f"the KV side channel cannot listen on {host}:{port} ({exc}): pick a free kv_port "
                "in --kv-transfer-config (0 picks one)"
            ) from None
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="warmcap-kv-side", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def ask(host: str, port: int, request: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """Send ``request`` to the side channel at ``host:port``; its answer, or :class:`KVTransferError`."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(json.dumps(request).encode() + b"\n")
            data = sock.makefile("rb").readline(MAX_MESSAGE_BYTES)
    except OSError as exc:
        raise KVTransferError(
            f"cannot reach the prefill instance's KV side channel at {host}:{port} ({exc}); is the "
            "prefill server running, and are remote_host/remote_port the ones it returned?"
        ) from None
    try:
        answer = json.loads(data)
    except json.JSONDecodeError:
        raise KVTransferError(
            f"the KV side channel at {host}:{port} answered {data[:80]!r}, not JSON: is that port a "
            "warmcap prefill server's kv_port?"
        ) from None
    if not isinstance(answer, dict):
        raise KVTransferError(f"the KV side channel at {host}:{port} answered {answer!r}, not an object")
    if "error" in answer:
        raise KVTransferError(
            f"the KV side channel at {host}:{port} refused {request.get('op')!r}: {answer['error']}"
        )
    return answer
