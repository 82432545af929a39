"""Step metadata for tests that build a batch over a paged KV cache by hand."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from warmcap.contracts import PAD_SLOT_ID, AttentionMetadata


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


def poisoned_step(
    seed: int,
    rows: list[tuple[int, int]],
    *,
    pad_rows: int,
    pad_tokens: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    window: int | None,
    share: bool,
    extra_columns: int = 0,
    extra_query_len: int = 0,
):
    """One step over a paged cache, ``rows`` of (computed, scheduled) tokens: (q, k, v, cache, meta).

    The cache starts as NaN everywhere (``serve/poison.py``); only positions some query can see hold
    finite K/V, so reading anything else shows in the output. Pages are shuffled; with ``share``
    every row starts with row 0's first full page when both computed past it (a prefix-cache hit).
    Pages wholly before every query's window are the null block 0, as the engine hands them back.
    ``extra_columns`` and ``extra_query_len`` widen the metadata as a graph's static buffers do
    (``graph_bounds``). q is a view of a fused projection, as models pass it; padding tokens are
    large, so a leak into real rows shows."""
    gen = torch.Generator().manual_seed(seed)
    hq = num_kv_heads * group
    cols = max(-(-(c + s) // block_size) for c, s in rows)
    num_blocks = len(rows) * cols + 2
    cache = torch.full((2, num_blocks + 1, block_size, num_kv_heads, head_dim), float("nan"))
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(rows) + pad_rows, cols + extra_columns, dtype=torch.int32)
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    slots, qsl, seq_lens = [], [0], []
    for r, (computed, scheduled) in enumerate(rows):
        seq = computed + scheduled
        pages = [free.pop() for _ in range(-(-seq // block_size))]
        if share and r > 0 and computed >= block_size and rows[0][0] >= block_size:
            pages[0] = int(table[0, 0])
        first_visible = 0 if window is None else max(0, computed - window + 1)
        for column in range(first_visible // block_size):
            pages[column] = 0
        table[r, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        pos = torch.arange(seq)
        where = torch.tensor(pages)[pos // block_size] * block_size + pos % block_size
        visible = where[first_visible:computed]
        flat[:, visible] = torch.randn(2, len(visible), num_kv_heads, head_dim, generator=gen)
        slots.append(where[computed:])
        qsl.append(qsl[-1] + scheduled)
        seq_lens.append(seq)
    for p in range(pad_rows):
        qsl.append(qsl[-1] + (pad_tokens if p == pad_rows - 1 else 0))
        seq_lens.append(0)
    slots.append(torch.full((qsl[-1] - qsl[len(rows)],), PAD_SLOT_ID))
    meta = paged_metadata(qsl, seq_lens, table, torch.cat(slots).long(), block_size)
    if extra_columns or extra_query_len:
        meta = dataclasses.replace(
            meta,
            max_seq_len=table.shape[1] * block_size,
            max_query_len=meta.max_query_len + extra_query_len,
            graph_bounds=True,
        )
    t = qsl[-1]
    qkv = torch.randn(t, hq + 2 * num_kv_heads, head_dim, generator=gen)
    qkv[qsl[len(rows)] :] *= 100  # padding must not leak into real rows
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + num_kv_heads], qkv[:, hq + num_kv_heads :]
    return q, k, v, cache, meta
