"""The two halves of a KV connector, split as the reference engine splits them.

- **Scheduler side** (:class:`KVConnectorScheduler`, in the engine's scheduling thread): how many
  leading tokens of a new request can be loaded, which blocks they go to, what the worker side must
  do this step (:class:`KVConnectorMetadata`), and what a producer keeps when a request finishes.
- **Worker side** (:class:`KVConnectorWorker`, next to the runner's KV tensors): register the
  tensors with the transfer library, start this step's loads, finish this step's saves, and report
  which sends and loads completed.

The scheduler (``core/scheduler.py``) parks a loading request, running no forward for it, until
the worker side reports its load done; it frees a producer's finished request's blocks only after
the worker side reports them read (``core/kv_connector.py`` is what core sees of these classes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from warmcap.config import EngineConfig
    from warmcap.core.outputs import BlockIds, SchedulerOutput
    from warmcap.core.request import Request


@dataclass(slots=True)
class KVConnectorMetadata:
    """One step's instructions from the scheduler side to the worker side (connectors extend it)."""


class KVConnectorScheduler(ABC):
    """The scheduler's half of a connector (satisfies ``core.kv_connector.SchedulerConnector``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` whose KV this connector can load for ``request``."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        """Remember where ``request``'s ``num_external_tokens`` loaded tokens go."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and saves for the worker side; clears the per-step state."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, dict | None]:
        """(keep the blocks until a peer has read them, transfer parameters for the client)."""


class KVConnectorWorker(ABC):
    """The runner's half of a connector (satisfies ``core.kv_connector.WorkerConnector``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Make the runner's KV tensors (by layer name) reachable by peers."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        """Begin the loads ``metadata`` lists; returns without waiting for them."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Return once this step's KV meant for peers can be read."""

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests peers finished reading, requests whose loads finished) since the last call."""

    def get_load_errors(self) -> dict[str, str]:
        """Requests whose loads failed since the last call, with why (their blocks hold no KV)."""
        return {}
