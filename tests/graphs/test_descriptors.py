from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.errors import ConfigError
from warmcap.graphs.capture.descriptors import BatchDescriptor, BatchShape, CUDAGraphMode, Dispatcher
from warmcap.graphs.capture.sizes import default_capture_sizes, uniform_decode_sizes

FULL, PIECEWISE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE


def _fits(d: BatchDescriptor, shape: BatchShape) -> bool:
    """Plain statement of compatibility, written independently of the dispatcher's tables."""
    if shape.num_tokens > d.num_tokens or shape.num_reqs > d.request_cap:
        return False
    if d.uniform_query_len is None:
        return True
    return shape.all_decode and shape.uniform_query_len == d.uniform_query_len


def _policy_descriptors(max_num_seqs: int, k: int, mixed_mode: CUDAGraphMode) -> list[BatchDescriptor]:
    q = 1 + k
    uniform = [BatchDescriptor(FULL, n, n // q, q) for n in uniform_decode_sizes(max_num_seqs, k)]
    mixed = [BatchDescriptor(mixed_mode, n) for n in default_capture_sizes(max_num_seqs, k)]
    return uniform + mixed


descriptors = st.builds(
    lambda mode, reqs, q, uniform: (
        BatchDescriptor(mode, reqs * q, reqs, q) if uniform else BatchDescriptor(mode, reqs * q, reqs)
    ),
    st.sampled_from([FULL, PIECEWISE]),
    st.integers(1, 16),
    st.integers(1, 4),
    st.booleans(),
)

shapes = st.builds(
    lambda lens, all_decode: BatchShape.from_query_lens(lens, all_decode=all_decode),
    st.lists(st.integers(1, 6), min_size=1, max_size=20),
    st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(descriptors, max_size=12), shapes)
def test_dispatch_picks_smallest_compatible_graph_or_eager(captured: list[BatchDescriptor], shape) -> None:
    got = Dispatcher(captured).dispatch(shape)
    fitting = [d for d in captured if _fits(d, shape)]
    if got is None:
        assert fitting == []
        return
    assert got in captured and _fits(got, shape)
    assert got.num_tokens >= shape.num_tokens and got.request_cap >= shape.num_reqs
    if got.is_uniform_decode:
        assert shape.all_decode and got.uniform_query_len == shape.uniform_query_len
    assert got.num_tokens == min(d.num_tokens for d in fitting)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16), st.integers(0, 4), shapes, st.sampled_from([FULL, PIECEWISE]))
def test_policy_graphs_serve_every_decode_step_exactly(max_num_seqs, k, shape, mixed_mode) -> None:
    q = 1 + k
    dispatcher = Dispatcher(_policy_descriptors(max_num_seqs, k, mixed_mode))
    # A uniform decode step of n <= max_num_seqs requests gets a FULL graph of exactly its size.
    for n in range(1, max_num_seqs + 1):
        got = dispatcher.dispatch(BatchShape(q * n, n, q, True, q))
        assert got == BatchDescriptor(FULL, q * n, n, q)
    got = dispatcher.dispatch(shape)
    if got is not None and not shape.all_decode:
        assert not got.is_uniform_decode


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 16))
def test_prefill_never_hits_uniform_decode_graph(k: int, q_seen: int, reqs: int) -> None:
    # A prompt chunk whose length equals 1+k looks like a verify step but must not use its graph.
    q = 1 + k
    dispatcher = Dispatcher([BatchDescriptor(FULL, q * n, n, q) for n in range(1, 17)])
    assert dispatcher.dispatch(BatchShape(q * reqs, reqs, q, False, q)) is None
    lens = [q] * (reqs - 1) + [q_seen]
    assert dispatcher.dispatch(BatchShape.from_query_lens(lens, all_decode=False)) is None


def test_ties_prefer_uniform_then_full() -> None:
    uniform = BatchDescriptor(FULL, 8, 4, 2)
    mixed_full = BatchDescriptor(FULL, 8)
    mixed_pw = BatchDescriptor(PIECEWISE, 8)
    dispatcher = Dispatcher([mixed_pw, mixed_full, uniform])
    assert dispatcher.dispatch(BatchShape(6, 3, 2, True, 2)) is uniform
    assert dispatcher.dispatch(BatchShape(6, 3, 3, False, None)) is mixed_full
    # Above every captured size: eager.
    assert dispatcher.dispatch(BatchShape(9, 3, 3, False, None)) is None


def test_mixed_graph_request_cap_is_respected() -> None:
    small_cap = BatchDescriptor(PIECEWISE, 16, 2)
    roomy = BatchDescriptor(PIECEWISE, 32)
    dispatcher = Dispatcher([small_cap, roomy])
    assert dispatcher.dispatch(BatchShape(10, 2, 9, False, None)) is small_cap
    assert dispatcher.dispatch(BatchShape(10, 3, 8, False, None)) is roomy


def test_descriptor_rejects_inconsistent_keys() -> None:
    with pytest.raises(ConfigError, match="uniform_query_len"):
        BatchDescriptor(FULL, 7, 3, 2)
    with pytest.raises(ConfigError, match="num_reqs"):
        BatchDescriptor(FULL, 4, 5)
    with pytest.raises(ConfigError, match="NONE"):
        Dispatcher([BatchDescriptor(CUDAGraphMode.NONE, 4)])
