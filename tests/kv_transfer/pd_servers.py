"""P/D pieces over :mod:`server_procs`: the reference engine's ``--kv-transfer-config`` JSON."""

from __future__ import annotations

import json

NIXL = "NixlConnector"


def transfer_config(role: str, **extra: object) -> str:
    config: dict[str, object] = {"kv_connector": NIXL, "kv_role": role}
    if extra:
        config["kv_connector_extra_config"] = extra
    return json.dumps(config)
