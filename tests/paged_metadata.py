"""Step metadata for tests that build a batch over a paged KV cache by hand."""

from __future__ import annotations

import itertools

import torch

from warmcap.contracts import AttentionMetadata


def paged_metadata(
    qsl: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> AttentionMetadata:
    """The metadata the runner would build for rows with query start offsets ``qsl`` (one more
    than the rows, padded rows included) and sequence lengths ``seq_lens``, host copies included."""
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_tokens=qsl[-1],
        num_reqs=len(qsl) - 1,
        query_start_loc=qsl_t,
        seq_lens=seq_t,
        block_table=block_table,
        slot_mapping=slot_mapping,
        max_query_len=max(b - a for a, b in itertools.pairwise(qsl)),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=qsl_t,
        seq_lens_cpu=seq_t,
    )
