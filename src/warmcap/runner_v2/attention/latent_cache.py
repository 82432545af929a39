"""Per-token vector caches (MLA latents, indexer keys): writing a step's vectors and reading each
row's context, with tensor ops only (graph-safe: no host reads, no data-dependent shapes).

Cache layout: ``[num_blocks + 1, block_size, dim]``; the last block is the sink for PAD writes (see
:mod:`warmcap.contracts.metadata`). Shared by the torch MLA backend (:mod:`.mla`) and the torch
lightning-indexer backend (:mod:`.indexer`).
"""

from __future__ import annotations

import torch

from warmcap.contracts.metadata import AttentionMetadata


def write_slots(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``values`` [T, D] into ``cache`` [num_blocks + 1, block_size, D] at ``slot_mapping``;
    PAD (-1) slots land in the sink block (index ``num_blocks``)."""
    num_blocks_with_sink, block_size, dim = cache.shape
    sink = (num_blocks_with_sink - 1) * block_size
    slots = slot_mapping[: values.shape[0]]
    slots = torch.where(slots < 0, torch.full_like(slots, sink), slots)
    cache.view(-1, dim).index_copy_(0, slots, values.to(cache.dtype))


def gather_context(cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's cached vectors for positions ``0 .. max_seq_len - 1``.

    Returns ``(values [R, S, D], valid [R, S])`` with ``S = meta.max_seq_len``; ``valid`` is False past
    a row's ``seq_len``, and the caller masks those entries.

    NOTE: an entry past a row's length holds the row's last token (written by this step), not
    whatever its page holds there: the caller's mask gives it weight 0, and ``0 * finite`` is 0,
    while the page may hold NaN (``serve/poison.py``) and ``0 * NaN`` is NaN. Reading another slot
    costs nothing; zeroing the gathered entries would cost a pass over them.
    """
    _, block_size, dim = cache.shape
    rows, width = meta.block_table.shape
    pos = torch.arange(meta.max_seq_len, device=cache.device)
    seq_lens = meta.seq_lens[:, None].to(torch.int64)
    valid = pos[None, :] < seq_lens
    read = torch.where(valid, pos[None, :], (seq_lens - 1).clamp(min=0))
    blocks = meta.block_table.to(torch.int64).gather(1, (read // block_size).clamp(max=width - 1))
    slots = blocks * block_size + read % block_size
    values = cache.view(-1, dim).index_select(0, slots.reshape(-1)).view(rows, meta.max_seq_len, dim)
    return values, valid


def query_layout(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the step's tokens: its row and its position in the row's sequence.

    Tokens of padded rows get a negative position, so no context position is visible to them.
    """
    qsl = meta.query_start_loc.to(torch.int64)
    tokens = torch.arange(meta.num_tokens, device=qsl.device)
    rows = torch.searchsorted(qsl[1 : meta.num_reqs + 1], tokens, right=True).clamp(max=meta.num_reqs - 1)
    ends = qsl[rows + 1]
    positions = meta.seq_lens.to(torch.int64)[rows] - (ends - tokens)
    return rows, positions


def visible_mask(
    rows: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, allowed: torch.Tensor | None
) -> torch.Tensor:
    """[t, S] bool: context position s is visible to token i (causal, within its row's sequence,
    and selected by ``allowed`` when given)."""
    ctx_pos = torch.arange(valid.shape[1], device=valid.device)
    mask = valid[rows] & (ctx_pos[None, :] <= positions[:, None])
    if allowed is not None:
        mask &= allowed
    return mask
