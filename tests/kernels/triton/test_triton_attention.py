"""The Triton paged-attention kernel (interpreted on CPU) against the torch reference backend.

Every cache position no query may see is NaN, so a kernel that reads one (a page's unread tail,
columns before a sliding window, padding) shows it in its output. Layouts are random: shuffled
pages, shared prefix pages, decode rows, verify queries of 1 + k, prefill chunks, padded rows and
tokens, and graph-shaped metadata (the table as wide as the model allows, ``max_seq_len`` and
``max_query_len`` the graph's bounds).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_metadata import poisoned_step
from warmcap.config import ATTENTION_BACKENDS
from warmcap.errors import ConfigError
from warmcap.kernels.triton.paged_attention import TritonPagedAttention, launch_shape
from warmcap.runner_v2.attention import selector
from warmcap.runner_v2.attention.selector import select_backend
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention, write_kv

#: the batch-invariant torch path: each query over exactly the keys it sees, no BLAS (the reference)
REFERENCE = TorchPagedAttention(batch_invariant=True)


# decode (1), verify (1 + k) and short prefill chunks; small sizes keep the interpreter fast
row = st.tuples(st.integers(0, 40), st.sampled_from([1, 1, 3, 5, 9]))


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(row, min_size=1, max_size=3),
    pad_rows=st.integers(0, 2),
    pad_tokens=st.integers(0, 3),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([16, 24]),
    block_size=st.sampled_from([4, 16]),
    window=st.one_of(st.none(), st.integers(1, 30)),
    share=st.booleans(),
    splits=st.sampled_from([1, 3]),
    graph=st.booleans(),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_triton_equals_the_torch_reference_and_never_reads_unseen_kv(
    rows,
    pad_rows,
    pad_tokens,
    num_kv_heads,
    group,
    head_dim,
    block_size,
    window,
    share,
    splits,
    graph,
    bf16,
    seed,
):
    q, k, v, cache, meta = poisoned_step(
        seed,
        rows,
        pad_rows=pad_rows,
        pad_tokens=pad_tokens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        window=window,
        share=share,
        extra_columns=3 if graph else 0,
        extra_query_len=4 if graph else 0,
    )
    scale = head_dim**-0.5
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v, cache = (x.to(dtype) for x in (q, k, v, cache))
    cache_ref, cache_tri = cache.clone(), cache.clone()
    want = REFERENCE.forward(
        q.float(), k.float(), v.float(), cache_ref.float(), meta, scale=scale, sliding_window=window
    )
    got = TritonPagedAttention(splits=splits).forward(
        q, k, v, cache_tri, meta, scale=scale, sliding_window=window
    )
    assert got.dtype == dtype
    assert not got.isnan().any(), "the kernel read a position no query can see (NaN there)"
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    real = int(meta.query_start_loc[len(rows)])
    assert torch.equal(got[real:], torch.zeros_like(got[real:])), "padded tokens must output zeros"
    # The same K/V reach every slot a real token owns (PAD goes to the sink in torch, nowhere here).
    write_kv(cache_ref, k, v, meta.slot_mapping)
    no_sink = slice(0, cache.shape[1] - 1)
    assert torch.equal(cache_tri[:, no_sink].nan_to_num(7.0), cache_ref[:, no_sink].nan_to_num(7.0))


def test_key_splits_give_the_same_result_as_one_pass():
    """Flash-decoding: one long row's keys split over programs and merged by log-sum-exp."""
    q, k, v, cache, meta = poisoned_step(
        3, [(150, 1), (70, 5)], pad_rows=0, pad_tokens=0, num_kv_heads=2, group=3,
        head_dim=16, block_size=16, window=None, share=False,
    )  # fmt: skip
    outs = [TritonPagedAttention(splits=s).forward(q, k, v, cache.clone(), meta, scale=0.25) for s in (1, 4)]
    want = REFERENCE.forward(q, k, v, cache.clone(), meta, scale=0.25)
    for out in outs:
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_the_launch_is_sized_from_static_sizes_only():
    """A graph's grid: tiles from ``max_query_len``, splits bounded by the table's width and the
    device's programs; the verify query of 1 + 4 with 3 query heads a KV head is one tile."""
    verify = launch_shape(rows=8, max_query_len=5, group=3, kv_heads=3, width=8192, programs=264)
    assert verify == (8, 32, 1, 11)
    assert launch_shape(rows=8, max_query_len=1, group=3, kv_heads=3, width=64, programs=264) == (1, 16, 1, 1)
    assert launch_shape(rows=1, max_query_len=80, group=3, kv_heads=3, width=8192, programs=1)[2:] == (5, 1)


def test_triton_is_a_named_backend_that_needs_cuda():
    assert "triton" in ATTENTION_BACKENDS
    with pytest.raises(ConfigError, match="CUDA"):
        select_backend("cpu", name="triton")


def test_auto_on_cuda_picks_triton_without_flashinfer_and_torch_for_batch_invariance(monkeypatch):
    """Selection only (no kernel runs): CUDA reported present, FlashInfer not importable."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(selector, "flashinfer_available", lambda: False)
    assert isinstance(select_backend("cuda"), TritonPagedAttention)
    assert isinstance(select_backend("cuda", name="triton"), TritonPagedAttention)
    invariant = select_backend("cuda", batch_invariant=True)
    assert isinstance(invariant, TorchPagedAttention)
    assert isinstance(select_backend("cpu"), TorchPagedAttention)
