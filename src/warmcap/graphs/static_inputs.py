"""Loading batches into static buffers in the shape of a graph.

Target graphs use the runner's own :class:`~warmcap.runner_v2.step_buffers.StepBuffers` (sized to
the maximum plus one spare padding row, refilled by ``copy_from``). Drafter graphs get a second
``StepBuffers`` over the drafter's KV groups plus one feature buffer per phase that reads hidden
states (:class:`DraftStatics`). This module adds what graphs need on top: benign all-padding
inputs, uniform spreading of padded tokens, and metadata whose host-side sizes are fixed per graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from warmcap.drafters.base import DRAFT_DECODE, DRAFT_PREFILL
from warmcap.runner_v2.input_batch import StepInputs
from warmcap.runner_v2.step_buffers import StepBuffers

if TYPE_CHECKING:
    from warmcap.contracts import AttentionMetadata
    from warmcap.drafters.base import Drafter
    from warmcap.drafters.paged import DraftPass
    from warmcap.graphs.planning import GraphSpec
    from warmcap.runner_v2.model_runner import ModelRunner


def empty_step(buffers: StepBuffers) -> StepInputs:
    """A step with no request: loaded padded, every token is PAD and every row has ``seq_len`` 0,
    so a forward over it writes only the sink block and reads nothing real."""
    i32, i64 = np.int32, np.int64
    return StepInputs(
        req_ids=[],
        rows=np.zeros(0, dtype=i64),
        num_scheduled=np.zeros(0, dtype=i32),
        query_start_loc=np.zeros(1, dtype=i32),
        positions=np.zeros(0, dtype=i64),
        input_ids=np.zeros(0, dtype=i64),
        seq_lens=np.zeros(0, dtype=i32),
        block_tables={
            g: torch.zeros(0, buffers.max_blocks_per_req, dtype=torch.int32)
            for g in buffers.group_block_sizes
        },
        logits_indices=np.zeros(0, dtype=i64),
        num_logits=np.zeros(0, dtype=i32),
        draft_token_ids=[],
        max_num_blocks=0,
    )


def load_padded(buffers: StepBuffers, step: StepInputs, spec: GraphSpec) -> None:
    """Load ``step`` padded to the graph's tokens and rows (benign padding: token 0, position 0,
    slot PAD, zero table row, ``seq_len`` 0)."""
    buffers.copy_from(step, num_tokens_padded=spec.num_tokens, num_reqs_padded=spec.rows)
    spread_uniform_padding(buffers, spec)


def spread_uniform_padding(buffers: StepBuffers, spec: GraphSpec) -> None:
    """A uniform graph's metadata says every row has ``q`` queries, while the loader gave every
    padded token to the first padded row: spread them ``q`` per padded row (same tokens, same PAD
    slots)."""
    q = spec.descriptor.uniform_query_len
    r, t = buffers.num_reqs, buffers.num_tokens
    if q is None or r == spec.rows:
        return
    qsl = buffers.query_start_loc_cpu
    real_max = int((qsl[1 : r + 1] - qsl[:r]).max()) if r else 0
    spread = t + q * torch.arange(1, spec.rows - r + 1, dtype=torch.int32)
    qsl[r + 1 : spec.rows + 1] = spread
    buffers.query_start_loc[r + 1 : spec.rows + 1].copy_(spread)
    buffers.max_query_len = max(real_max, q)


def graph_metadata(buffers: StepBuffers, spec: GraphSpec, max_model_len: int) -> dict[str, AttentionMetadata]:
    """Per-group metadata over the static buffers with the host sizes fixed for ``spec``: full block
    table width, ``max_query_len`` of the graph and ``max_seq_len = max_model_len``, so one recorded
    graph serves every batch that dispatches to it."""
    metas = buffers.attn_metadata()
    return {
        g: replace(m, max_query_len=spec.max_query_len, max_seq_len=max_model_len) for g, m in metas.items()
    }


@dataclass(slots=True)
class DraftStatics:
    """Static inputs of drafter graphs: layout buffers over the drafter's groups, token ids and
    positions in them, and a feature buffer per phase whose passes read hidden states."""

    buffers: StepBuffers
    features: dict[str, torch.Tensor]

    @classmethod
    def for_runner(cls, runner: ModelRunner, drafter: Drafter) -> DraftStatics:
        # Normal tensors even under inference mode: attention backends track their versions.
        with torch.inference_mode(False):
            buffers = StepBuffers(
                max_num_tokens=runner.max_num_tokens,
                max_num_reqs=runner.max_num_reqs,
                max_blocks_per_req=runner.max_blocks_per_req,
                group_block_sizes={g.name: g.spec.block_size for g in drafter.graph_groups()},
                device=runner.device,
            )
            features = {}
            for phase in (DRAFT_PREFILL, DRAFT_DECODE):
                spec = drafter.feature_spec(phase)
                if spec is not None:
                    width, dtype = spec
                    features[phase] = torch.zeros(
                        runner.max_num_tokens, width, dtype=dtype, device=runner.device
                    )
        return cls(buffers, features)

    def inputs(self, spec: GraphSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Static token ids, positions and features (or None) of ``spec``'s token count."""
        t = spec.num_tokens
        feats = self.features.get(spec.phase)
        return (
            self.buffers.input_ids[:t],
            self.buffers.positions[:t],
            feats[:t] if feats is not None else None,
        )

    def load(
        self,
        spec: GraphSpec,
        dp: DraftPass | None = None,
        block_tables: dict[str, torch.Tensor] | None = None,
        input_ids: torch.Tensor | None = None,
        features: torch.Tensor | None = None,
    ) -> None:
        """Load drafter pass ``dp`` (default: no request, all padding) padded to ``spec``:
        ``block_tables`` are its host rows per drafter group, ``input_ids`` [T] and ``features``
        [T, F] device tensors. Padded tokens get id 0, position 0, slot PAD and zero features."""
        b = self.buffers
        if dp is None:
            empty = empty_step(b)
            qsl, positions, seq_lens, tables = (
                empty.query_start_loc,
                empty.positions,
                empty.seq_lens,
                empty.block_tables,
            )
        else:
            qsl, positions, seq_lens = dp.query_start_loc, dp.positions, dp.seq_lens
            tables = block_tables or {}
        b.load_layout(
            query_start_loc=qsl,
            positions=positions,
            seq_lens=seq_lens,
            block_tables=tables,
            num_tokens_padded=spec.num_tokens,
            num_reqs_padded=spec.rows,
        )
        spread_uniform_padding(b, spec)
        t, tp = b.num_tokens, b.num_tokens_padded
        if input_ids is not None:
            b.input_ids[:t].copy_(input_ids)
        b.input_ids[t:tp].zero_()
        feats = self.features.get(spec.phase)
        if feats is not None:
            if features is not None:
                feats[:t].copy_(features)
            feats[t:tp].zero_()
