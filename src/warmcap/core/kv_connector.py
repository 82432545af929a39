"""What the scheduler asks of a KV connector's scheduler side, and what the runner asks of its
worker side (``kv_transfer/base.py`` implements both); core never imports ``kv_transfer``.

A connector decides which leading tokens of a request are loaded from another instance instead of
computed here, learns which blocks they go to, describes each step's transfers to the worker side,
and, on a producer, may keep a finished request's blocks until its peer has read them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from warmcap.core.outputs import BlockIds, SchedulerOutput
    from warmcap.core.request import Request


class SchedulerConnector(Protocol):
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` (local prefix hits) whose KV can be loaded."""
        ...

    def update_state_after_alloc(
        self, request: Request, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        """``request`` now holds ``block_ids``; its ``num_external_tokens`` after the local hits are
        to be loaded into them. Called in the step the load starts."""
        ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        """What the worker side needs for this step's loads and saves; resets per-step state."""
        ...

    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, dict | None]:
        """``request`` finished: (keep its blocks until the worker reports it sent, the transfer
        parameters to hand back to the client)."""
        ...


class WorkerConnector(Protocol):
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """The runner's KV tensors by layer name (``runner_v2/kv_cache.py``), once, before the first step."""
        ...

    def start_load_kv(self, metadata: object) -> None:
        """Begin this step's loads (``SchedulerOutput.kv_connector_metadata``); may return at once."""
        ...

    def wait_for_save(self) -> None:
        """Block until this step's KV meant for peers is in place (after the forward)."""
        ...

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose blocks peers have finished reading, requests whose loads finished)."""
        ...

    def get_load_errors(self) -> dict[str, str]:
        """Requests whose loads failed since the last call, with the reason (they must end)."""
        ...
