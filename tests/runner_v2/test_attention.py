"""Paged attention backends against a plain per-request reference on contiguous K/V."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_metadata import paged_metadata
from warmcap.contracts import PAD_SLOT_ID, AttentionMetadata
from warmcap.core.kv_spec import FullAttentionSpec, SlidingWindowSpec
from warmcap.core.reservation import reserved_blocks, skipped_blocks
from warmcap.errors import ConfigError
from warmcap.runner_v2.attention.selector import select_backend
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention

BLOCK_SIZE = 16
NUM_BLOCKS = 48
HEAD_DIM = 8


@dataclass
class Batch:
    meta: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: torch.Tensor
    # per real row: full K/V [seq, Hkv, D] and its query span
    rows: list[tuple[torch.Tensor, torch.Tensor, int, int]]
    num_real_tokens: int
    allocated: list[int]


def make_batch(
    gen: torch.Generator,
    spans: list[tuple[int, int]],
    *,
    num_kv_heads: int,
    group: int,
    window: int | None,
    pad_rows: int,
    pad_tokens: int,
) -> Batch:
    """spans: (computed, scheduled) per real row. Context K/V is pre-written into random blocks."""
    hq = num_kv_heads * group
    spec = SlidingWindowSpec(BLOCK_SIZE, sliding_window=window) if window else FullAttentionSpec(BLOCK_SIZE)
    cache = torch.randn(2, NUM_BLOCKS + 1, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    max_blocks = 8
    r_total = len(spans) + pad_rows
    table = torch.zeros(r_total, max_blocks, dtype=torch.int32)
    qs, ks, vs, slots, rows = [], [], [], [], []
    qsl, seq_lens, allocated = [0], [], []
    for r, (computed, scheduled) in enumerate(spans):
        seq = computed + scheduled
        n = reserved_blocks(spec, seq, num_lookahead_tokens=0, max_model_len=10_000)
        ids = [free.pop() for _ in range(n)]
        allocated += ids
        table[r, :n] = torch.tensor(ids, dtype=torch.int32)
        # Blocks wholly out of every query's window are handed back: the row reads the null block.
        table[r, : skipped_blocks(spec, computed)] = 0
        k_full = torch.randn(seq, num_kv_heads, HEAD_DIM, generator=gen)
        v_full = torch.randn(seq, num_kv_heads, HEAD_DIM, generator=gen)
        pos = torch.arange(seq)
        flat = torch.tensor(ids)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        cache[0].view(-1, num_kv_heads, HEAD_DIM)[flat[:computed]] = k_full[:computed]
        cache[1].view(-1, num_kv_heads, HEAD_DIM)[flat[:computed]] = v_full[:computed]
        qs.append(torch.randn(scheduled, hq, HEAD_DIM, generator=gen))
        ks.append(k_full[computed:])
        vs.append(v_full[computed:])
        slots.append(flat[computed:])
        rows.append((k_full, v_full, computed, scheduled))
        qsl.append(qsl[-1] + scheduled)
        seq_lens.append(seq)
    num_real = qsl[-1]
    for p in range(pad_rows):
        qsl.append(qsl[-1] + (pad_tokens if p == pad_rows - 1 else 0))
        seq_lens.append(0)
    extra = qsl[-1] - num_real
    qs.append(torch.randn(extra, hq, HEAD_DIM, generator=gen) * 100)
    ks.append(torch.randn(extra, num_kv_heads, HEAD_DIM, generator=gen) * 100)
    vs.append(torch.randn(extra, num_kv_heads, HEAD_DIM, generator=gen) * 100)
    slots.append(torch.full((extra,), PAD_SLOT_ID))
    meta = paged_metadata(qsl, seq_lens, table, torch.cat(slots).long(), BLOCK_SIZE)
    return Batch(meta, torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, rows, num_real, allocated)


def reference(batch: Batch, *, group: int, scale: float, window: int | None) -> torch.Tensor:
    """Per request: causal (windowed) SDPA over its contiguous K/V, no paging."""
    outs = []
    start = 0
    for k_full, v_full, computed, scheduled in batch.rows:
        q = batch.q[start : start + scheduled]
        start += scheduled
        qpos = torch.arange(computed, computed + scheduled)[:, None]
        kpos = torch.arange(computed + scheduled)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        k = k_full.repeat_interleave(group, dim=1).transpose(0, 1)
        v = v_full.repeat_interleave(group, dim=1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


span = st.one_of(
    st.tuples(st.just(0), st.integers(1, 40)),  # prefill
    st.tuples(st.integers(1, 80), st.just(1)),  # decode
    st.tuples(st.integers(1, 80), st.integers(2, 5)),  # spec verify / chunked prefill
)


@settings(max_examples=60, deadline=None)
@given(
    spans=st.lists(span, min_size=1, max_size=5),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    window=st.one_of(st.none(), st.integers(1, 40)),
    pad_rows=st.integers(0, 2),
    pad_tokens=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_paged_matches_reference_and_padding_is_inert(
    spans, num_kv_heads, group, window, pad_rows, pad_tokens, seed
):
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(
        gen,
        spans,
        num_kv_heads=num_kv_heads,
        group=group,
        window=window,
        pad_rows=pad_rows,
        pad_tokens=pad_tokens,
    )
    before = batch.cache.clone()
    scale = HEAD_DIM**-0.5
    out = TorchPagedAttention().forward(
        batch.q, batch.k, batch.v, batch.cache, batch.meta, scale=scale, sliding_window=window
    )
    n = batch.num_real_tokens
    expected = reference(batch, group=group, scale=scale, window=window)
    torch.testing.assert_close(out[:n], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padded tokens must output zeros"
    # Exactly the real slots changed among blocks 0..num_blocks-1 (PAD went to the sink only).
    real_slots = batch.meta.slot_mapping[:n]
    want = before.clone()
    want[0].view(-1, num_kv_heads, HEAD_DIM)[real_slots] = batch.k[:n]
    want[1].view(-1, num_kv_heads, HEAD_DIM)[real_slots] = batch.v[:n]
    assert torch.equal(batch.cache[:, :NUM_BLOCKS], want[:, :NUM_BLOCKS])


def test_padded_token_values_do_not_change_real_rows():
    gen = torch.Generator().manual_seed(0)
    kwargs = {"num_kv_heads": 2, "group": 2, "window": None, "pad_rows": 2, "pad_tokens": 4}
    a = make_batch(gen, [(0, 7), (20, 1), (33, 3)], **kwargs)
    b_q, b_k, b_v = a.q.clone(), a.k.clone(), a.v.clone()
    n = a.num_real_tokens
    b_q[n:], b_k[n:], b_v[n:] = -b_q[n:] * 7, b_k[n:] * 3, -b_v[n:]
    cache_b = a.cache.clone()
    backend = TorchPagedAttention()
    out_a = backend.forward(a.q, a.k, a.v, a.cache, a.meta, scale=0.3)
    out_b = backend.forward(b_q, b_k, b_v, cache_b, a.meta, scale=0.3)
    assert torch.equal(out_a[:n], out_b[:n])


@pytest.mark.parametrize("inference", [False, True])
def test_plan_is_rederived_when_metadata_buffers_change_in_place(inference):
    """A runner refilling static metadata buffers must never get the previous step's layout
    (inference-mode tensors have no version counter, so that path compares contents)."""
    gen = torch.Generator().manual_seed(1)
    kwargs = {"num_kv_heads": 1, "group": 2, "window": None, "pad_rows": 0, "pad_tokens": 0}
    with torch.inference_mode(inference):
        first = make_batch(gen, [(10, 1), (30, 1)], **kwargs)
        second = make_batch(gen, [(40, 1), (5, 1)], **kwargs)
        backend = TorchPagedAttention()
        backend.forward(first.q, first.k, first.v, first.cache, first.meta, scale=0.5)
        meta = first.meta
        meta.seq_lens.copy_(second.meta.seq_lens)
        meta.block_table.copy_(second.meta.block_table)
        meta.slot_mapping.copy_(second.meta.slot_mapping)
        meta.max_seq_len = second.meta.max_seq_len
        out = backend.forward(second.q, second.k, second.v, second.cache, meta, scale=0.5)
        expected = reference(second, group=2, scale=0.5, window=None)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 20])
def test_a_decode_beside_prompt_chunks_gets_the_bits_of_a_decode_only_step(window):
    """A step of decodes then prompt chunks (as the scheduler orders running requests first): the
    decodes are cut off and go to the kernel, as in a step of decodes alone, instead of being padded
    to the chunks' query span through SDPA, so a decode's attention does not depend on the prompts
    scheduled beside it; the chunks still match the reference."""
    gen = torch.Generator().manual_seed(3)
    kwargs = {"num_kv_heads": 2, "group": 3, "window": window, "pad_rows": 1, "pad_tokens": 3}
    batch = make_batch(gen, [(20, 1), (37, 1), (9, 2), (0, 30), (5, 12), (44, 1)], **kwargs)
    n = batch.num_real_tokens
    mixed = TorchPagedAttention().forward(
        batch.q, batch.k, batch.v, batch.cache.clone(), batch.meta, scale=0.4, sliding_window=window
    )
    expected = reference(batch, group=3, scale=0.4, window=window)
    torch.testing.assert_close(mixed[:n], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(mixed[n:], torch.zeros_like(mixed[n:]))
    # The three leading short rows (4 tokens) as a step of their own.
    m = batch.meta
    alone = paged_metadata(
        [0, 1, 2, 4], m.seq_lens[:3].tolist(), m.block_table[:3], m.slot_mapping[:4], BLOCK_SIZE
    )
    out = TorchPagedAttention().forward(
        batch.q[:4], batch.k[:4], batch.v[:4], batch.cache.clone(), alone, scale=0.4, sliding_window=window
    )
    assert torch.equal(mixed[:4], out), (mixed[:4] - out).abs().max()


def test_bf16_cache_matches_fp32_reference_loosely():
    gen = torch.Generator().manual_seed(2)
    kwargs = {"num_kv_heads": 2, "group": 2, "window": 9, "pad_rows": 1, "pad_tokens": 2}
    batch = make_batch(gen, [(0, 12), (25, 1), (17, 4)], **kwargs)
    n = batch.num_real_tokens
    out = TorchPagedAttention().forward(
        batch.q.bfloat16(),
        batch.k.bfloat16(),
        batch.v.bfloat16(),
        batch.cache.bfloat16(),
        batch.meta,
        scale=0.35,
        sliding_window=9,
    )
    assert out.dtype == torch.bfloat16
    expected = reference(batch, group=2, scale=0.35, window=9)
    torch.testing.assert_close(out[:n].float(), expected, atol=0.05, rtol=0.05)


def test_cpu_selects_torch_backend():
    assert isinstance(select_backend("cpu"), TorchPagedAttention)
    assert isinstance(select_backend(torch.device("cpu"), name="torch"), TorchPagedAttention)


def test_flashinfer_without_cuda_is_a_clear_error():
    with pytest.raises(ConfigError, match="CUDA"):
        select_backend("cpu", name="flashinfer")


def test_unknown_backend_name_lists_choices():
    with pytest.raises(ConfigError, match="torch"):
        select_backend("cpu", name="xformers")
