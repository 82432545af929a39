"""The drafter's static inputs: every drafter pass, eager or replayed, runs over these buffers.

Layout buffers (:class:`~warmcap.runner_v2.step_buffers.StepBuffers`) over the drafter's KV
groups, the token ids and positions in them, and one feature buffer per phase whose passes read
hidden states. The draft executor owns them (``runner_v2/draft_executor.py``, one per runner with
a model-backed drafter); graph capture records over them and refills them before a replay, so
eager and replayed passes load the same way and the KV-write log records both from the same place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from warmcap.core.kv_spec import MambaSpec
from warmcap.runner_v2.collaborators import DRAFT_DECODE, DRAFT_PREFILL
from warmcap.runner_v2.mamba_draft_state import draft_row_plans
from warmcap.runner_v2.mamba_state import state_write_slots
from warmcap.runner_v2.step_buffers import StepBuffers

if TYPE_CHECKING:
    from warmcap.contracts import AttentionMetadata
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.runner_v2.collaborators import DraftModel, DraftPass
    from warmcap.runner_v2.input_batch import InputBatch


class DraftBuffers:
    """Static drafter inputs for up to ``max_num_tokens`` tokens and ``max_num_reqs`` requests."""

    def __init__(
        self,
        model: DraftModel,
        *,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        device: torch.device,
    ) -> None:
        # Normal tensors even under inference mode: attention backends track their versions.
        with torch.inference_mode(False):
            self.buffers = StepBuffers(
                max_num_tokens=max_num_tokens,
                max_num_reqs=max_num_reqs,
                max_blocks_per_req=max_blocks_per_req,
                group_block_sizes={g.name: g.spec.block_size for g in model.graph_groups()},
                device=device,
            )
            self.features: dict[str, torch.Tensor] = {}
            for phase in (DRAFT_PREFILL, DRAFT_DECODE):
                spec = model.feature_spec(phase)
                if spec is not None:
                    width, dtype = spec
                    self.features[phase] = torch.zeros(max_num_tokens, width, dtype=dtype, device=device)

    @property
    def group_names(self) -> list[str]:
        return list(self.buffers.block_tables)

    def inputs(self, phase: str, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Static token ids, positions and ``phase``'s features (or None) of ``num_tokens`` tokens."""
        feats = self.features.get(phase)
        return (
            self.buffers.input_ids[:num_tokens],
            self.buffers.positions[:num_tokens],
            feats[:num_tokens] if feats is not None else None,
        )

    def load(
        self,
        phase: str,
        dp: DraftPass | None,
        block_tables: Mapping[str, torch.Tensor],
        input_ids: torch.Tensor | None = None,
        features: torch.Tensor | None = None,
        *,
        num_tokens_padded: int | None = None,
        num_reqs_padded: int | None = None,
    ) -> None:
        """Load drafter pass ``dp`` (None: no request, all padding) padded to the given sizes
        (default: none): ``block_tables`` are its host rows per drafter group, ``input_ids`` [T]
        and ``features`` [T, F] device tensors. Padded tokens get id 0, position 0, slot PAD and
        zero features."""
        b = self.buffers
        if dp is None:
            qsl, positions, seq_lens = np.zeros(1, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int32)
            tables: Mapping[str, torch.Tensor] = {
                g: torch.zeros(0, b.max_blocks_per_req, dtype=torch.int32) for g in b.block_tables
            }
        else:
            qsl, positions, seq_lens, tables = dp.query_start_loc, dp.positions, dp.seq_lens, block_tables
        b.load_layout(
            query_start_loc=qsl,
            positions=positions,
            seq_lens=seq_lens,
            block_tables=tables,
            num_tokens_padded=num_tokens_padded,
            num_reqs_padded=num_reqs_padded,
        )
        t, tp = b.num_tokens, b.num_tokens_padded
        if input_ids is not None:
            b.input_ids[:t].copy_(input_ids)
        b.input_ids[t:tp].zero_()
        feats = self.features.get(phase)
        if feats is not None:
            if features is not None:
                feats[:t].copy_(features)
            feats[t:tp].zero_()


def pass_block_tables(batch: InputBatch, dp: DraftPass, groups: Sequence[str]) -> dict[str, torch.Tensor]:
    """The host block-table rows of ``dp``'s requests in each of ``groups`` (drafter groups)."""
    tables = batch.block_tables
    return {g: tables[g].gather(dp.rows) for g in groups}


def draft_writes(
    groups: Sequence[KVCacheGroup],
    metas: Mapping[str, AttentionMetadata],
    buffers: StepBuffers,
    batch: InputBatch,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Host ``(positions, slot_mapping)`` per drafter group of the pass loaded in ``buffers`` (and
    run over ``metas``), for the KV-write log: tokens into slots, or a draft LM's Mamba groups'
    whole states into columns (:mod:`warmcap.runner_v2.mamba_draft_state`)."""
    tp = buffers.num_tokens_padded
    writes = {}
    for group in groups:
        meta = metas[group.name]
        if isinstance(group.spec, MambaSpec):
            tables, known = batch.block_tables[group.name].table, batch.num_tokens
            writes[group.name] = state_write_slots(meta, draft_row_plans(group.spec, meta, tables, known))
        else:
            writes[group.name] = (
                buffers.positions[:tp].cpu().clone(),
                buffers.slot_mappings[group.name][:tp].cpu().clone(),
            )
    return writes
