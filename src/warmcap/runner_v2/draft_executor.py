"""The draft executor: runs a drafter's passes, so neither the runner nor the drafter has to.

The runner builds one :class:`DraftExecutor` for a drafter with a model and binds it to the
drafter once (``Drafter.bind``). It owns what a drafter pass needs besides the drafter's weights:
the drafter buffers (``runner_v2/draft_buffers.py``), the dispatch to captured drafter graphs and
the logging of the pass's KV writes (invariant I2). It reads the runner's KV tensors, backends and
persistent batch (the block tables and token counts the passes run over) and writes the runner's
KV-write log, all handed to it at construction; it holds no runner.

One step: runner -> ``Drafter.propose`` -> :meth:`DraftExecutor.run` (per pass) ->
``DraftModel.forward_pass`` (or a graph replay). Nothing on that stack calls back up it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from warmcap.runner_v2.draft_buffers import DraftBuffers, draft_writes, pass_block_tables
from warmcap.runner_v2.draft_context import DraftKV

if TYPE_CHECKING:
    from warmcap.contracts import AttentionMetadata
    from warmcap.contracts.registry import BackendRegistry
    from warmcap.runner_v2.collaborators import DraftModel, DraftPass, GraphDispatcher
    from warmcap.runner_v2.input_batch import InputBatch
    from warmcap.runner_v2.kv_writes import KVWriteLog


class DraftExecutor:
    """Runs :class:`DraftModel` passes over ``buffers``, replaying a drafter graph when one fits.

    - ``model``: the drafter's model half
    - ``buffers``: the drafter's static inputs (every pass, eager or replayed, runs over them)
    - ``graphs``: the graph dispatcher (None: every pass eager), attached with the runner's
    - ``step``: the runner's step count, which the KV-write log stamps on each pass
    """

    def __init__(
        self,
        model: DraftModel,
        *,
        batch: InputBatch,
        kv_caches: Mapping[str, torch.Tensor],
        backends: BackendRegistry,
        kv_write_log: KVWriteLog,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.batch = batch
        self.kv_caches = kv_caches
        self.backends = backends
        self.kv_write_log = kv_write_log
        self._device = device
        self.buffers = DraftBuffers(
            model,
            max_num_tokens=max_num_tokens,
            max_num_reqs=max_num_reqs,
            max_blocks_per_req=max_blocks_per_req,
            device=device,
        )
        self.graphs: GraphDispatcher | None = None
        self.step = 0

    @property
    def device(self) -> torch.device:
        return self._device

    @contextmanager
    def substituted(
        self, *, buffers: DraftBuffers | None, kv_caches: Mapping[str, torch.Tensor]
    ) -> Iterator[None]:
        """Run with other static buffers and KV tensors (graph safety's fakes; None keeps the
        buffers); the real ones are back on exit."""
        saved = (self.buffers, self.kv_caches)
        if buffers is not None:
            self.buffers = buffers
        self.kv_caches = kv_caches
        try:
            yield
        finally:
            self.buffers, self.kv_caches = saved

    def kv(self) -> DraftKV:
        """What a drafter pass runs over now: KV tensors, backends, block tables, token counts."""
        return draft_kv(self.batch, self.kv_caches, self.backends)

    def state_metadata(
        self, metas: dict[str, AttentionMetadata], *, static: bool = False
    ) -> dict[str, AttentionMetadata]:
        """``metas`` with the model's state columns for the pass loaded now."""
        return self.model.state_metadata(self.kv(), metas, static=static)

    def forward(
        self,
        phase: str,
        metas: dict[str, AttentionMetadata],
        num_tokens: int,
        features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One eager ``phase`` pass over the first ``num_tokens`` tokens loaded in ``buffers``: the
        call graph capture records. ``features`` stand in for a phase without a feature buffer."""
        ids, positions, static_features = self.buffers.inputs(phase, num_tokens)
        feats = static_features if static_features is not None else features
        return self.model.forward_pass(self.kv(), phase, metas, ids, positions, feats)

    def run(
        self,
        dp: DraftPass,
        *,
        phase: str,
        log_phase: str,
        input_ids: torch.Tensor,
        features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One drafter pass (``phase`` ``draft_prefill`` or ``draft_decode``) over ``dp``: replayed
        from a captured drafter graph when one fits, else run eagerly over ``buffers``. Either way
        its KV writes are logged under ``log_phase`` while recording. Returns ``[T, H]``."""
        replay = self.graphs.replay_draft(phase, dp, input_ids, features) if self.graphs is not None else None
        if replay is None:
            statics = self.buffers
            statics.load(
                phase, dp, pass_block_tables(self.batch, dp, statics.group_names), input_ids, features
            )
            metas = self.state_metadata(statics.buffers.attn_metadata())
            output = self.forward(phase, metas, dp.num_tokens, features)
        else:
            metas, output = replay.metas, replay.output
        log = self.kv_write_log
        if log.recording:
            batch = self.batch
            writes = draft_writes(self.model.graph_groups(), metas, self.buffers.buffers, batch)
            rows = dp.rows.tolist()
            log.add_pass(
                log_phase,
                step=self.step,
                req_ids=dp.req_ids,
                query_start_loc=dp.query_start_loc.tolist(),
                block_ids={
                    g: {
                        r: batch.block_tables[g].row(int(row))
                        for r, row in zip(dp.req_ids, rows, strict=True)
                    }
                    for g in writes
                },
                writes=writes,
            )
        return output


def draft_kv(batch: InputBatch, kv_caches: Mapping[str, torch.Tensor], backends: BackendRegistry) -> DraftKV:
    """A :class:`DraftKV` over ``kv_caches`` and the persistent batch's block tables and counts
    (what :meth:`DraftExecutor.kv` hands a pass; graph subjects build the same from its fields)."""
    return DraftKV(
        kv_caches=kv_caches,
        backends=backends,
        block_tables={g: t.table for g, t in batch.block_tables.tables.items()},
        num_tokens=batch.num_tokens,
    )
