"""The ``kv_transfer_params`` of a request, in the reference engine's OpenAI-API form.

A client (usually ``warmup proxy``) asks the prefill instance P for ``{"do_remote_decode": true}``;
P answers with where the prompt's KV sits (:class:`RemotePrefill`), which the client passes on to
the decode instance D unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from warmcap.errors import ConfigError

if TYPE_CHECKING:
    from warmcap.config import EngineConfig

#: what P answers; D needs these to read the prompt's KV
REMOTE_PREFILL_KEYS: tuple[str, ...] = (
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
)


class KVTransferError(RuntimeError):
    """A request's KV could not be moved (peer gone, wrong engine, mismatched blocks): the request
    ends with this message; the servers keep serving."""


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """P's side: the client will read this request's prompt KV from another instance."""
    return bool(params and params.get("do_remote_decode"))


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    """D's side: this request's prompt KV is to be read from the instance ``params`` names."""
    return bool(params and params.get("do_remote_prefill"))


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a request's prompt KV sits on P: its engine, side channel and block ids per KV group."""

    engine_id: str
    #: the request's id on P (what P kept its blocks under)
    request_id: str
    host: str
    port: int
    #: KV group name -> P's block ids, in position order
    block_ids: dict[str, list[int]]
    #: P's prompt length (None: P did not say)
    num_tokens: int | None = None

    @classmethod
    def parse(cls, params: dict[str, Any]) -> RemotePrefill:
        """From ``kv_transfer_params``; raises :class:`ConfigError` naming what is missing or wrong."""
        missing = [k for k in REMOTE_PREFILL_KEYS if params.get(k) is None]
        if missing:
            raise ConfigError(
                f"kv_transfer_params with do_remote_prefill lacks {missing}: pass on the "
                "kv_transfer_params the prefill server returned, unchanged"
            )
        port = params["remote_port"]
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ConfigError(f"kv_transfer_params remote_port {port!r} is not a TCP port (1..65535)")
        blocks = params["remote_block_ids"]
        # The reference engine sends one flat list (one KV group); warmcap sends one list per group.
        if isinstance(blocks, list):
            blocks = {"": blocks}
        if not isinstance(blocks, dict) or not all(
            isinstance(ids, list) and all(isinstance(b, int) and b >= 0 for b in ids)
            for ids in blocks.values()
        ):
            raise ConfigError(
                f"kv_transfer_params remote_block_ids {params['remote_block_ids']!r} is not a list of "
                "block ids (or a {group: [ids]} object): pass on what the prefill server returned"
            )
        num_tokens = params.get("remote_num_tokens")
        if num_tokens is not None and (not isinstance(num_tokens, int) or num_tokens < 1):
            raise ConfigError(f"kv_transfer_params remote_num_tokens {num_tokens!r} is not a token count")
        return cls(
            engine_id=str(params["remote_engine_id"]),
            request_id=str(params["remote_request_id"]),
            host=str(params["remote_host"]),
            port=port,
            block_ids={str(g): list(ids) for g, ids in blocks.items()},
            num_tokens=num_tokens,
        )


def remote_prefill_params(
    engine_id: str, request_id: str, host: str, port: int, block_ids: dict[str, list[int]], num_tokens: int
) -> dict[str, Any]:
    """What P hands back for a finished ``do_remote_decode`` request (D passes it to :meth:`RemotePrefill.parse`)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": {g: list(ids) for g, ids in block_ids.items()},
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": num_tokens,
    }


def check_transfer_params(params: object, config: EngineConfig) -> None:
    """Refuse, before a request is queued, ``kv_transfer_params`` this engine cannot honour."""
    if not isinstance(params, dict):
        raise ConfigError(f"kv_transfer_params must be a JSON object; got {params!r}")
    transfer = config.kv_transfer
    role = None if transfer is None else transfer.kv_role
    if wants_remote_decode(params) and role not in ("kv_producer", "kv_both"):
        raise ConfigError(
            "kv_transfer_params do_remote_decode needs a prefill instance: start this server with "
            '--kv-transfer-config \'{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}\''
        )
    if wants_remote_prefill(params):
        if role not in ("kv_consumer", "kv_both"):
            raise ConfigError(
                "kv_transfer_params do_remote_prefill needs a decode instance: start this server with "
                '--kv-transfer-config \'{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}\''
            )
        RemotePrefill.parse(params)
