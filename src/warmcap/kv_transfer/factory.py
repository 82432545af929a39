"""Connector name (``kv_connector`` in ``--kv-transfer-config``) -> both halves of a connector."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from warmcap.errors import ConfigError

if TYPE_CHECKING:
    from warmcap.config import EngineConfig
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker

ConnectorBuilder = Callable[
    ["EngineConfig", "list[KVCacheGroup]"], "tuple[KVConnectorScheduler, KVConnectorWorker]"
]


def _nixl(config: EngineConfig, groups: list[KVCacheGroup]) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
    # Imported on use: nixl is only needed by an engine that transfers KV.
    from warmcap.kv_transfer.nixl import build_nixl_connector

    return build_nixl_connector(config, groups)


KV_CONNECTOR_BUILDERS: dict[str, ConnectorBuilder] = {"NixlConnector": _nixl}


def build_kv_connector(
    config: EngineConfig, groups: list[KVCacheGroup]
) -> tuple[KVConnectorScheduler, KVConnectorWorker] | None:
    """The connector ``config.kv_transfer`` names, for an engine with KV ``groups`` (None: no transfer)."""
    transfer = config.kv_transfer
    if transfer is None:
        return None
    builder = KV_CONNECTOR_BUILDERS.get(transfer.kv_connector)
    if builder is None:
        raise ConfigError(
            f"kv_connector {transfer.kv_connector!r} is unknown: use one of {sorted(KV_CONNECTOR_BUILDERS)}"
        )
    return builder(config, groups)
