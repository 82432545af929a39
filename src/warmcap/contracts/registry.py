"""Backends by KV kind: which implementation serves the layers of each ``KVSpec.kind``.

The runner fills one registry (:func:`warmcap.runner_v2.attention.selector.backend_registry`);
model layers reach it through :meth:`ForwardContext.backend`, naming the interface they call, so a
layer never builds its own backend and a test or another device can swap one by registering it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from warmcap.contracts.backends import AttentionBackend, IndexerBackend, MambaBackend, MLABackend
from warmcap.errors import ConfigError

B = TypeVar("B")

#: The interface a backend must implement to serve each KV spec kind (``KVSpec.kind``).
KIND_INTERFACES: dict[str, type] = {
    "full": AttentionBackend,
    "sliding_window": AttentionBackend,
    "mla": MLABackend,
    "indexer": IndexerBackend,
    "mamba": MambaBackend,
}


class BackendRegistry:
    """KV kind -> the backend instance serving it (one instance may serve several kinds)."""

    def __init__(self, backends: Mapping[str, object] | None = None) -> None:
        self._backends: dict[str, object] = {}
        for kind, backend in (backends or {}).items():
            self.register(kind, backend)

    def register(self, kind: str, backend: object) -> None:
        """Serve the layers of ``kind`` with ``backend`` (replacing any earlier one)."""
        interface = KIND_INTERFACES.get(kind)
        if interface is None:
            raise ConfigError(
                f"KV kind {kind!r} takes no backend; kinds with a backend interface: {sorted(KIND_INTERFACES)}"
            )
        if not isinstance(backend, interface):
            raise ConfigError(
                f"a backend for KV kind {kind!r} must implement {interface.__name__}; "
                f"got {type(backend).__name__}"
            )
        self._backends[kind] = backend

    def get(self, kind: str, interface: type[B]) -> B:
        """The backend registered for ``kind``, checked to implement ``interface``."""
        backend = self._backends.get(kind)
        if backend is None:
            raise ConfigError(
                f"no backend registered for KV kind {kind!r} (registered: {sorted(self._backends)}); "
                "register one with BackendRegistry.register"
            )
        if not isinstance(backend, interface):
            raise TypeError(
                f"the backend for KV kind {kind!r} is a {type(backend).__name__}, "
                f"not the {interface.__name__} the layer calls"
            )
        return backend

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds with a backend, sorted."""
        return tuple(sorted(self._backends))
