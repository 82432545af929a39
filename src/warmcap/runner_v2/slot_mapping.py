"""Slot mapping: where each scheduled token's K/V goes in the paged cache.

Slot of position ``p`` of row ``r`` = ``table[r, p // bs] * bs + p % bs``; the tail of the output
buffer past the real tokens is PAD (-1). The torch version is the reference; the CPU step computes
it with numpy over the buffers' host views (:func:`host_slot_mapping`: a few array ops, a fraction
of the torch ops' dispatch cost); on CUDA the Triton kernel in
:mod:`warmcap.kernels.triton.slot_mapping` computes the same thing on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from warmcap.contracts import PAD_SLOT_ID

#: one-token-a-row steps up to this many tokens take the scalar path of :func:`host_slot_mapping`
SCALAR_MAX_TOKENS = 4


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
        from warmcap.kernels.triton.slot_mapping import triton_slot_mapping

        return triton_slot_mapping(block_table, query_start_loc, positions, block_size, out)
    return compute_slot_mapping(block_table, query_start_loc, positions, block_size, out)


def host_slot_mapping(
    block_table: np.ndarray,
    query_lens: np.ndarray | None,
    positions: np.ndarray,
    block_size: int,
    out: np.ndarray,
) -> np.ndarray:
    """:func:`compute_slot_mapping` on host arrays: ``block_table`` int32 ``[R, W]``, ``query_lens``
    ``[R]`` (row ``r`` owns the next ``query_lens[r]`` tokens; None: exactly one token a row, as in
    a decode step), ``positions`` int64 ``[T]``; fills ``out`` (int64 ``[T_padded]``)."""
    num_tokens = positions.shape[0]
    if query_lens is None and num_tokens <= SCALAR_MAX_TOKENS:
        # A small decode step: scalar stores cost less than the array ops' setup (~6 us).
        for i, p in enumerate(positions.tolist()):
            out[i] = int(block_table[i, p // block_size]) * block_size + p % block_size
        if num_tokens < len(out):
            out[num_tokens:] = PAD_SLOT_ID
        return out
    if query_lens is None:
        rows = np.arange(num_tokens)
    else:
        rows = np.repeat(np.arange(block_table.shape[0]), query_lens)
    column, offset = np.divmod(positions, block_size)
    blocks = block_table[rows, column]
    np.add(blocks * np.int64(block_size), offset, out=out[:num_tokens])
    if num_tokens < len(out):
        out[num_tokens:] = PAD_SLOT_ID
    return out
