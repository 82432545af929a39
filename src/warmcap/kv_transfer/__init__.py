"""P/D KV transfer: connectors that move a request's prompt KV from a prefill instance (producer)
to a decode instance (consumer). Layered above ``core`` and ``runner_v2``; they reach it only
through the protocols in ``core/kv_connector.py``."""

from warmcap.kv_transfer.base import KVConnectorMetadata, KVConnectorScheduler, KVConnectorWorker

__all__ = ["KVConnectorMetadata", "KVConnectorScheduler", "KVConnectorWorker"]
