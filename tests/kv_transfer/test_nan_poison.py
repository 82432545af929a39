"""NaN in KV nobody may read changes nothing: every paged reader (the torch attention backend with
and without a sliding window, MLA on both paths, DFlash's block attention) gives bit-identical
outputs for a batch whose free blocks, page tails past each row's length, released window columns,
null block and sink hold NaN and the same batch over clean pages. ``serve/poison.py`` relies on it."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_metadata import paged_metadata
from warmcap.contracts import AttentionMetadata, MLAWeights
from warmcap.core.kv_spec import FullAttentionSpec, SlidingWindowSpec
from warmcap.core.reservation import reserved_blocks, skipped_blocks
from warmcap.drafters.dflash import block_attention
from warmcap.runner_v2.attention.mla import TorchMLABackend
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention

BS = 8
NUM_BLOCKS = 40


@dataclass(frozen=True, slots=True)
class Layout:
    """A step's metadata and the flat slots whose KV is real (context written before the step,
    or written by the step itself)."""

    meta: AttentionMetadata
    real_slots: torch.Tensor
    num_real_tokens: int


def _layout(
    spans: list[tuple[int, int]], *, window: int | None, pad_rows: int, pad_tokens: int, seed: int
) -> Layout:
    """``spans``: (computed, scheduled) per real row; padded rows (seq_len 0) follow, the last one
    with ``pad_tokens`` PAD tokens, as a captured graph pads a batch."""
    spec = SlidingWindowSpec(BS, sliding_window=window) if window else FullAttentionSpec(BS)
    free = list(range(1, NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    rows = len(spans) + pad_rows
    table = torch.zeros(rows, NUM_BLOCKS // 2, dtype=torch.int32)
    slots, real, qsl, seq_lens = [], [], [0], []
    for r, (computed, scheduled) in enumerate(spans):
        seq = computed + scheduled
        ids = [
            free.pop() for _ in range(reserved_blocks(spec, seq, num_lookahead_tokens=0, max_model_len=10**4))
        ]
        table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        released = skipped_blocks(spec, computed)
        table[r, :released] = 0  # out of every query's window: the row reads the null block there
        flat = [ids[p // BS] * BS + p % BS for p in range(seq)]
        slots += flat[computed:]
        real += flat[released * BS :]
        qsl.append(qsl[-1] + scheduled)
        seq_lens.append(seq)
    num_real = qsl[-1]
    for p in range(pad_rows):
        qsl.append(qsl[-1] + (pad_tokens if p == pad_rows - 1 else 0))
        seq_lens.append(0)
    slots += [-1] * (qsl[-1] - num_real)
    meta = paged_metadata(qsl, seq_lens, table, torch.tensor(slots, dtype=torch.int64), BS)
    return Layout(meta, torch.tensor(real, dtype=torch.int64), num_real)


def _pages(clean: torch.Tensor, layout: Layout, slot_dim: int) -> torch.Tensor:
    """``clean`` with NaN at every slot that holds no real KV (``slot_dim``: the flat slot axis of
    ``clean`` viewed with blocks and block offsets merged)."""
    poisoned = torch.full_like(clean, float("nan"))
    src = clean.flatten(slot_dim, slot_dim + 1)
    dst = poisoned.flatten(slot_dim, slot_dim + 1)
    dst.index_copy_(slot_dim, layout.real_slots, src.index_select(slot_dim, layout.real_slots))
    return poisoned


span = st.one_of(
    st.tuples(st.just(0), st.integers(1, 30)),  # prefill
    st.tuples(st.integers(1, 60), st.just(1)),  # decode
    st.tuples(st.integers(1, 60), st.integers(2, 6)),  # spec verify / chunked prefill
)


@settings(max_examples=40, deadline=None)
@given(
    spans=st.lists(span, min_size=1, max_size=4),
    window=st.one_of(st.none(), st.integers(1, 24)),
    group=st.sampled_from([1, 2]),
    pad_rows=st.integers(0, 2),
    pad_tokens=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_torch_attention_ignores_nan_where_no_query_looks(
    spans, window, group, pad_rows, pad_tokens, seed
) -> None:
    layout = _layout(spans, window=window, pad_rows=pad_rows, pad_tokens=pad_tokens, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    hkv, d, t = 2, 8, layout.meta.num_tokens
    clean = torch.randn(2, NUM_BLOCKS + 1, BS, hkv, d, generator=gen)
    poisoned = _pages(clean, layout, slot_dim=1)
    q = torch.randn(t, hkv * group, d, generator=gen)
    k, v = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    want = TorchPagedAttention().forward(q, k, v, clean, layout.meta, scale=0.3, sliding_window=window)
    got = TorchPagedAttention().forward(q, k, v, poisoned, layout.meta, scale=0.3, sliding_window=window)
    n = layout.num_real_tokens
    assert torch.equal(got[:n], want[:n])
    assert not got[n:].any()  # padded tokens stay zero


@pytest.mark.parametrize("absorbed_max_query_len", [0, 10**6])
@pytest.mark.parametrize("pad_tokens", [0, 3])
def test_mla_ignores_nan_where_no_query_looks(absorbed_max_query_len: int, pad_tokens: int) -> None:
    rank, rope, heads, dn, dv = 16, 4, 2, 8, 8
    layout = _layout(
        [(0, 11), (20, 1), (13, 4)],
        window=None,
        pad_rows=1 if pad_tokens else 0,
        pad_tokens=pad_tokens,
        seed=3,
    )
    gen = torch.Generator().manual_seed(3)
    t = layout.meta.num_tokens
    clean = torch.randn(NUM_BLOCKS + 1, BS, rank + rope, generator=gen)
    poisoned = _pages(clean, layout, slot_dim=0)
    weights = MLAWeights(
        torch.randn(heads, dn, rank, generator=gen), torch.randn(heads, dv, rank, generator=gen)
    )
    args = (
        torch.randn(t, heads, dn, generator=gen),
        torch.randn(t, heads, rope, generator=gen),
        torch.randn(t, rank + rope, generator=gen),
    )
    backend = TorchMLABackend(absorbed_max_query_len)
    want = backend.forward(*args, clean, layout.meta, weights, scale=0.2)
    got = backend.forward(*args, poisoned, layout.meta, weights, scale=0.2)
    n = layout.num_real_tokens
    assert torch.equal(got[:n], want[:n]) and want[:n].isfinite().all()


def test_dflash_block_attention_ignores_nan_past_each_row() -> None:
    layout = _layout([(17, 8), (30, 8), (5, 8)], window=None, pad_rows=0, pad_tokens=0, seed=5)
    gen = torch.Generator().manual_seed(5)
    clean = torch.randn(2, NUM_BLOCKS + 1, BS, 2, 8, generator=gen)
    poisoned = _pages(clean, layout, slot_dim=1)
    q = torch.randn(layout.meta.num_tokens, 4, 8, generator=gen)
    want = block_attention(q, clean, layout.meta, 0.3)
    got = block_attention(q, poisoned, layout.meta, 0.3)
    assert torch.equal(got, want) and want.isfinite().all()
