"""The NIXL connector's scheduler side: which requests load KV from P (on D), which keep their
blocks for D to read (on P), and the per-step instructions for the worker side."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from warmcap.kv_transfer.base import KVConnectorScheduler
from warmcap.kv_transfer.nixl_metadata import NixlMetadata, ReadJob
from warmcap.kv_transfer.params import (
    RemotePrefill,
    remote_prefill_params,
    wants_remote_decode,
    wants_remote_prefill,
)

if TYPE_CHECKING:
    from warmcap.config import EngineConfig
    from warmcap.core.outputs import BlockIds, SchedulerOutput
    from warmcap.core.request import Request


class NixlConnectorScheduler(KVConnectorScheduler):
    """``host:port`` is P's side channel (what D is told to ask); ``keep_seconds`` is how long P
    holds a finished request's blocks when no reader confirms."""

    def __init__(
        self, config: EngineConfig, *, engine_id: str, host: str, port: int, keep_seconds: float
    ) -> None:
        super().__init__(config)
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.keep_seconds = keep_seconds
        self._reads: list[ReadJob] = []
        self._sends: dict[str, float] = {}
        self._releases: dict[str, RemotePrefill] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return 0
        # The last prompt token is always computed here (its logits give the first token).
        count = request.num_prompt_tokens - 1 - num_computed_tokens
        if count <= 0:
            # Nothing to read (a one-token prompt, or every block a local hit): P must not wait
            # for a read that never comes.
            assert params is not None
            self._releases[request.request_id] = RemotePrefill.parse(params)
        return max(count, 0)

    def update_state_after_alloc(
        self, request: Request, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        assert params is not None and wants_remote_prefill(params)
        self._reads.append(
            ReadJob(
                request_id=request.request_id,
                remote=RemotePrefill.parse(params),
                block_ids={g: list(ids) for g, ids in block_ids.items()},
                num_local_tokens=request.num_external_computed_tokens - num_external_tokens,
                num_external_tokens=num_external_tokens,
                num_prompt_tokens=request.num_prompt_tokens,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlMetadata:
        meta = NixlMetadata(
            reads=self._reads,
            sends=self._sends,
            stopped=set(scheduler_output.finished_req_ids),
            releases=list(self._releases.values()),
        )
        self._reads, self._sends, self._releases = [], {}, {}
        return meta

    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, dict | None]:
        if not wants_remote_decode(request.kv_transfer_params):
            return False, None
        # NOTE: P keeps the blocks until D's read notification (or the deadline); freeing them at
        # once would let another request overwrite KV that D is still reading.
        self._sends[request.request_id] = time.monotonic() + self.keep_seconds
        return True, remote_prefill_params(
            self.engine_id, request.request_id, self.host, self.port, block_ids, request.num_prompt_tokens
        )
