"""Slot mapping: torch reference vs the Triton kernel (interpreted on CPU), and the PAD tail."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.contracts import PAD_SLOT_ID
from warmcap.kernels.triton.slot_mapping import triton_slot_mapping
from warmcap.runner_v2.slot_mapping import compute_slot_mapping, host_slot_mapping


def _plain_slots(table: list[list[int]], qlens: list[int], starts: list[int], bs: int) -> list[int]:
    slots = []
    for row, (n, c) in enumerate(zip(qlens, starts, strict=True)):
        for p in range(c, c + n):
            slots.append(table[row][p // bs] * bs + p % bs)
    return slots


@st.composite
def _batches(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    width = draw(st.integers(1, 6))
    num_reqs = draw(st.integers(1, 5))
    table = [draw(st.lists(st.integers(1, 50), min_size=width, max_size=width)) for _ in range(num_reqs)]
    qlens, starts = [], []
    for _ in range(num_reqs):
        end = draw(st.integers(0, width * bs))
        n = draw(st.integers(0, end))
        qlens.append(n)
        starts.append(end - n)
    pad = draw(st.integers(0, 9))
    return bs, table, qlens, starts, pad


@settings(max_examples=200, deadline=None)
@given(_batches())
def test_torch_and_triton_agree_with_plain_formula(batch) -> None:
    bs, table, qlens, starts, pad = batch
    positions = torch.tensor(
        [p for n, c in zip(qlens, starts, strict=True) for p in range(c, c + n)], dtype=torch.int64
    )
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    bt = torch.tensor(table, dtype=torch.int32)
    total = positions.numel() + pad
    ref = compute_slot_mapping(bt, qsl, positions, bs, torch.full((total,), 7, dtype=torch.int64))
    tri = triton_slot_mapping(bt, qsl, positions, bs, torch.full((total,), 7, dtype=torch.int64))
    expected = _plain_slots(table, qlens, starts, bs) + [PAD_SLOT_ID] * pad
    host = host_slot_mapping(
        bt.numpy(), torch.tensor(qlens).numpy(), positions.numpy(), bs, np.full(total, 7)
    )
    assert ref.tolist() == expected
    assert tri.tolist() == expected
    assert host.tolist() == expected
    if all(n == 1 for n in qlens):
        # A decode step: the host path's short case (no query lengths), the same slots.
        one_each = host_slot_mapping(bt.numpy(), None, positions.numpy(), bs, np.full(total, 7))
        assert one_each.tolist() == expected


def test_long_request_crosses_kernel_chunks() -> None:
    # 300 tokens > one 128-token chunk of the kernel, spread over many blocks.
    bs = 16
    bt = torch.arange(1, 21, dtype=torch.int32).flip(0).reshape(1, 20)
    positions = torch.arange(5, 305)
    qsl = torch.tensor([0, 300], dtype=torch.int32)
    ref = compute_slot_mapping(bt, qsl, positions, bs, torch.empty(310, dtype=torch.int64))
    tri = triton_slot_mapping(bt, qsl, positions, bs, torch.empty(310, dtype=torch.int64))
    assert torch.equal(ref, tri)
    assert ref[-10:].eq(PAD_SLOT_ID).all()
