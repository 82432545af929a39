"""Loading batches into the runner's static buffers in the shape of a graph.

The static buffers are the runner's own :class:`~warmcap.runner_v2.step_buffers.StepBuffers` (one
dataclass sized to the maximum, refilled by ``copy_from``); this module only adds what graphs need
on top: benign all-padding inputs, uniform spreading of padded tokens, and metadata whose host-side
sizes are fixed per graph.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from warmcap.runner_v2.input_batch import StepInputs
from warmcap.runner_v2.step_buffers import StepBuffers

if TYPE_CHECKING:
    from warmcap.graphs.planning import GraphSpec
    from warmcap.runner_v2.attention.base import AttentionMetadata
    from warmcap.runner_v2.model_runner import ModelRunner


def ensure_spare_row(runner: ModelRunner) -> None:
    """Give the runner's static buffers one row more than ``max_num_seqs``.

    NOTE: a mixed graph holding ``max_num_seqs`` requests still needs a padded row to own its padded
    tokens (``query_start_loc[R] == num_tokens``). When the runner allocated exactly
    ``max_num_seqs`` rows, its buffers are rebuilt once here, before any graph records addresses.
    """
    b = runner.buffers
    if b.max_num_reqs > runner.max_num_reqs:
        return
    # Normal tensors even when called under inference mode: attention backends track their versions.
    with torch.inference_mode(False):
        runner.buffers = StepBuffers(
            max_num_tokens=b.max_num_tokens,
            max_num_reqs=runner.max_num_reqs + 1,
            max_blocks_per_req=b.max_blocks_per_req,
            group_block_sizes=b.group_block_sizes,
            device=b.device,
        )


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
    q = spec.descriptor.uniform_query_len
    r = step.num_reqs
    if q is None or r == spec.rows:
        return
    # copy_from gives every padded token to the first padded row; a uniform graph's metadata says
    # each row has q queries, so spread them q per padded row (same tokens, same PAD slots).
    t = step.num_tokens
    spread = t + q * torch.arange(1, spec.rows - r + 1, dtype=torch.int32)
    buffers.query_start_loc_cpu[r + 1 : spec.rows + 1] = spread
    buffers.query_start_loc[r + 1 : spec.rows + 1].copy_(spread)
    buffers.max_query_len = max(step.max_query_len, q)


def graph_metadata(buffers: StepBuffers, spec: GraphSpec, max_model_len: int) -> dict[str, AttentionMetadata]:
    """Per-group metadata over the static buffers with the host sizes fixed for ``spec``: full block
    table width, ``max_query_len`` of the graph and ``max_seq_len = max_model_len``, so one recorded
    graph serves every batch that dispatches to it."""
    metas = buffers.attn_metadata()
    return {
        g: replace(m, max_query_len=spec.max_query_len, max_seq_len=max_model_len) for g, m in metas.items()
    }
