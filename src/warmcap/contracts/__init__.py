"""The contract between model code and the runner.

Models and the runner both import this package; it imports only torch, the standard library,
:mod:`warmcap.errors` and nothing above it. It holds the step metadata models read
(:mod:`~warmcap.contracts.metadata`), the context a forward runs in
(:mod:`~warmcap.contracts.forward_context`), the backend interfaces
(:mod:`~warmcap.contracts.backends`) and the per-KV-kind backend registry
(:mod:`~warmcap.contracts.registry`), the Mamba state layout (:mod:`~warmcap.contracts.mamba_layout`)
and the per-step state handler protocol (:mod:`~warmcap.contracts.state_handler`).
"""

from __future__ import annotations

from warmcap.contracts.backends import (
    MAX_UNIFORM_QUERY_LEN,
    AttentionBackend,
    IndexerBackend,
    MambaBackend,
    MambaWeights,
    MLABackend,
    MLAWeights,
)
from warmcap.contracts.forward_context import ForwardContext
from warmcap.contracts.metadata import PAD_SLOT_ID, AttentionMetadata, MambaMetadata
from warmcap.contracts.registry import KIND_INTERFACES, BackendRegistry
from warmcap.contracts.state_handler import StateHandler

__all__ = [
    "KIND_INTERFACES",
    "MAX_UNIFORM_QUERY_LEN",
    "PAD_SLOT_ID",
    "AttentionBackend",
    "AttentionMetadata",
    "BackendRegistry",
    "ForwardContext",
    "IndexerBackend",
    "MLABackend",
    "MLAWeights",
    "MambaBackend",
    "MambaMetadata",
    "MambaWeights",
    "StateHandler",
]
