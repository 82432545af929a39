"""Triton slot-mapping kernel: same semantics as :func:`warmcap.runner_v2.slot_mapping.compute_slot_mapping`.

One program per request walks its tokens in ``BLOCK`` chunks; one extra program writes the PAD tail.
Runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warmcap.contracts import PAD_SLOT_ID

_BLOCK = 128


@triton.jit
def _slot_mapping_kernel(
    block_table_ptr,
    table_stride,
    query_start_loc_ptr,
    positions_ptr,
    out_ptr,
    num_reqs,
    num_tokens_padded,
    block_size: tl.constexpr,
    pad_id: tl.constexpr,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if req == num_reqs:
        # The extra program: PAD everything after the last real token.
        tail = tl.load(query_start_loc_ptr + num_reqs)
        for start in range(tail, num_tokens_padded, BLOCK):
            idx = start + offs
            tl.store(out_ptr + idx, tl.full((BLOCK,), pad_id, tl.int64), mask=idx < num_tokens_padded)
    else:
        begin = tl.load(query_start_loc_ptr + req)
        end = tl.load(query_start_loc_ptr + req + 1)
        row_ptr = block_table_ptr + req.to(tl.int64) * table_stride
        for start in range(begin, end, BLOCK):
            idx = start + offs
            mask = idx < end
            pos = tl.load(positions_ptr + idx, mask=mask, other=0).to(tl.int64)
            block = tl.load(row_ptr + pos // block_size, mask=mask, other=0).to(tl.int64)
            tl.store(out_ptr + idx, block * block_size + pos % block_size, mask=mask)


def triton_slot_mapping(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Fill ``out`` like ``compute_slot_mapping``; ``block_table`` rows must be contiguous."""
    num_reqs = block_table.shape[0]
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    _slot_mapping_kernel[(num_reqs + 1,)](
        block_table,
        block_table.stride(0),
        query_start_loc,
        positions,
        out,
        num_reqs,
        out.shape[0],
        block_size=block_size,
        pad_id=PAD_SLOT_ID,
        BLOCK=_BLOCK,
    )
    return out
