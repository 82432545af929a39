"""The batch-invariant attention path (``--batch-invariant``): a token's output is a function of its
own query, position and keys, bit for bit, whatever batch it runs in — alone as a decode row, as one
query of a prefill chunk, beside other rows and padding, under a graph's wide metadata — and it is
still attention (the SDPA path agrees to float rounding, and no unseen position is read)."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_metadata import paged_metadata, poisoned_step
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention

INVARIANT = TorchPagedAttention(batch_invariant=True)


@settings(max_examples=15, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 150), st.sampled_from([1, 2, 5, 17])), min_size=1, max_size=3),
    pad_rows=st.integers(0, 2),
    group=st.sampled_from([1, 3]),
    window=st.one_of(st.none(), st.integers(1, 70)),
    graph=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_it_is_attention_and_reads_nothing_a_query_cannot_see(rows, pad_rows, group, window, graph, seed):
    q, k, v, cache, meta = poisoned_step(
        seed, rows, pad_rows=pad_rows, pad_tokens=2 if pad_rows else 0, num_kv_heads=2, group=group,
        head_dim=16, block_size=16, window=window, share=True,
        extra_columns=3 if graph else 0, extra_query_len=4 if graph else 0,
    )  # fmt: skip
    sdpa = TorchPagedAttention()
    sdpa._kernel_loaded = True  # gather + SDPA on every step: the other torch path
    want = sdpa.forward(q, k, v, cache.clone(), meta, scale=0.25, sliding_window=window)
    got = INVARIANT.forward(q, k, v, cache.clone(), meta, scale=0.25, sliding_window=window)
    assert not got.isnan().any(), "read a position no query can see (NaN there)"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    real = int(meta.query_start_loc[len(rows)])
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))


def _single_row(cache: torch.Tensor, table_row: torch.Tensor, seq_len: int, query_len: int, slots):
    table = table_row[None].clone()
    return paged_metadata([0, query_len], [seq_len], table, slots, cache.shape[2])


@settings(max_examples=15, deadline=None)
@given(
    computed=st.integers(0, 140),
    scheduled=st.integers(2, 20),
    neighbour=st.tuples(st.integers(0, 90), st.integers(1, 9)),
    window=st.one_of(st.none(), st.integers(1, 70)),
    seed=st.integers(0, 2**16),
)
def test_a_tokens_output_does_not_depend_on_the_batch_around_it(computed, scheduled, neighbour, window, seed):
    """Each query of a prefill chunk (in a batch with a neighbour row and padding) equals, bit for
    bit, the same token run alone as a one-query decode step over the keys the chunk wrote, and the
    same token under a graph's metadata (the table's full width, graph bounds)."""
    q, k, v, cache, meta = poisoned_step(
        seed, [(computed, scheduled), neighbour], pad_rows=1, pad_tokens=3, num_kv_heads=1, group=3,
        head_dim=16, block_size=16, window=window, share=False, extra_columns=2,
    )  # fmt: skip
    batched = INVARIANT.forward(q, k, v, cache, meta, scale=0.25, sliding_window=window)
    wide = dataclasses.replace(meta, max_seq_len=meta.block_table.shape[1] * 16, graph_bounds=True)
    graphed = INVARIANT.forward(q, k, v, cache, wide, scale=0.25, sliding_window=window, kv_written=True)
    assert torch.equal(graphed, batched)
    for j in range(scheduled):
        alone = _single_row(cache, meta.block_table[0], computed + j + 1, 1, meta.slot_mapping[j : j + 1])
        out = INVARIANT.forward(
            q[j : j + 1], k[j : j + 1], v[j : j + 1], cache, alone, scale=0.25, sliding_window=window,
            kv_written=True,
        )  # fmt: skip
        assert torch.equal(out[0], batched[j]), f"query {j} of the chunk differs when run alone"
