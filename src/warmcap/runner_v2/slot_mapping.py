"""Slot mapping: where each scheduled token's K/V goes in the paged cache.

Slot of position ``p`` of row ``r`` = ``table[r, p // bs] * bs + p % bs``; the tail of the output
buffer past the real tokens is PAD (-1). The torch version is the reference and the CPU path; on
CUDA the Triton kernel in :mod:`warmcap.runner_v2.triton_slot_mapping` computes the same thing.
"""

from __future__ import annotations

import torch

from warmcap.contracts import PAD_SLOT_ID


def compute_slot_mapping(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Fill ``out`` (int64 ``[T_padded]``) with the slots of ``positions`` (``[T]``, the real tokens,
    row ``r`` owning ``[qsl[r], qsl[r+1])``) and PAD past ``T``. Returns ``out``."""
    num_tokens = positions.shape[0]
    num_reqs = block_table.shape[0]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    # output_size keeps repeat_interleave from syncing to learn the length.
    rows = torch.repeat_interleave(
        torch.arange(num_reqs, device=positions.device), query_lens.to(torch.int64), output_size=num_tokens
    )
    blocks = block_table[rows, positions // block_size].to(torch.int64)
    out[:num_tokens] = blocks * block_size + positions % block_size
    out[num_tokens:] = PAD_SLOT_ID
    return out


def slot_mapping(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """The slot mapping on the tensors' device: the Triton kernel on CUDA, torch elsewhere."""
    if out.is_cuda:
        from warmcap.runner_v2.triton_slot_mapping import triton_slot_mapping

        return triton_slot_mapping(block_table, query_start_loc, positions, block_size, out)
    return compute_slot_mapping(block_table, query_start_loc, positions, block_size, out)
