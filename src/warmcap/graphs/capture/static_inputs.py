"""Loading batches into static buffers in the shape of a graph.

Target graphs use the runner's own :class:`~warmcap.runner_v2.step_buffers.StepBuffers` (sized to
the maximum plus one spare padding row, refilled by ``copy_from``); drafter graphs the runner's
drafter buffers (:class:`~warmcap.runner_v2.draft_buffers.DraftBuffers`). This module adds what
graphs need on top: benign all-padding inputs, uniform spreading of padded tokens, and metadata
whose host-side sizes are fixed per graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from warmcap.runner_v2.input_batch import StepInputs
from warmcap.runner_v2.step_buffers import StepBuffers

if TYPE_CHECKING:
    from warmcap.contracts import AttentionMetadata
    from warmcap.graphs.capture.planning import GraphSpec
    from warmcap.runner_v2.collaborators import DraftPass


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
    graph serves every batch that dispatches to it; ``graph_bounds`` tells attention those are bounds,
    so it reads each row's length from the ``seq_lens`` tensor of the buffers."""
    metas = buffers.attn_metadata()
    return {
        g: replace(m, max_query_len=spec.max_query_len, max_seq_len=max_model_len, graph_bounds=True)
        for g, m in metas.items()
    }


@dataclass(frozen=True, slots=True)
class DraftInputs:
    """A drafter pass to load: its layout, token ids ``[T]`` and features ``[T, F]`` (or None)."""

    dp: DraftPass
    input_ids: torch.Tensor
    features: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.dp.num_tokens

    @property
    def num_reqs(self) -> int:
        return self.dp.num_reqs
