"""``NixlConnector``: P/D KV transfer over NIXL (UCX), D reading P's blocks.

``build_nixl_connector`` makes both halves of one engine's connector: the worker side with its
NIXL agent and, on a producer, the side channel D asks for P's metadata. Options come from
``kv_connector_extra_config``: ``abort_request_timeout`` (seconds P keeps a finished request's blocks
when no reader confirms; default 120, as the reference engine's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``),
``side_channel_timeout`` (default 5), ``read_timeout`` (seconds D waits for a request's read; default
30) and ``read_chunk_blocks`` (D reads a request's KV in READs of at most this many blocks, every
layer of each; default 64).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from warmcap.errors import ConfigError
from warmcap.kv_transfer.layout import check_movable
from warmcap.kv_transfer.nixl_scheduler import NixlConnectorScheduler
from warmcap.kv_transfer.nixl_worker import NixlConnectorWorker
from warmcap.kv_transfer.side_channel import SideChannelServer

if TYPE_CHECKING:
    from warmcap.config import EngineConfig
    from warmcap.core.kv_spec import KVCacheGroup

_OPTIONS: dict[str, float] = {
    "abort_request_timeout": 120.0,
    "side_channel_timeout": 5.0,
    "read_timeout": 30.0,
    "read_chunk_blocks": 64,
}
#: options that count something rather than seconds
_COUNTS = frozenset({"read_chunk_blocks"})


def _options(extra: dict[str, object]) -> dict[str, float]:
    unknown = sorted(set(extra) - set(_OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown kv_connector_extra_config keys {unknown}: NixlConnector knows {sorted(_OPTIONS)}"
        )
    options = dict(_OPTIONS)
    for key, value in extra.items():
        if key in _COUNTS:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(
                    f"kv_connector_extra_config {key} must be a positive integer; got {value!r}"
                )
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(
                f"kv_connector_extra_config {key} must be a positive number of seconds; got {value!r}"
            )
        options[key] = value
    return options


def build_nixl_connector(
    config: EngineConfig, groups: list[KVCacheGroup]
) -> tuple[NixlConnectorScheduler, NixlConnectorWorker]:
    transfer = config.kv_transfer
    assert transfer is not None
    check_movable(groups)
    options = _options(dict(transfer.kv_connector_extra_config))
    engine_id = transfer.engine_id or f"warmcap-{uuid.uuid4().hex[:12]}"
    worker = NixlConnectorWorker(
        config,
        groups,
        engine_id=engine_id,
        side_channel_timeout=options["side_channel_timeout"],
        read_timeout=options["read_timeout"],
        read_chunk_blocks=int(options["read_chunk_blocks"]),
    )
    host, port = transfer.kv_ip, transfer.kv_port
    if transfer.kv_role in ("kv_producer", "kv_both"):
        # Only a producer is read from; it listens (port 0: a free one, told to D in the params).
        server = SideChannelServer(transfer.kv_ip, transfer.kv_port, worker.answer)
        host, port = server.host, server.port
        worker.side_channel = server
    scheduler = NixlConnectorScheduler(
        config, engine_id=engine_id, host=host, port=port, keep_seconds=options["abort_request_timeout"]
    )
    return scheduler, worker
