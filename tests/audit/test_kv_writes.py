from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.audit.kv_writes import audit_records
from warmcap.runner_v2.kv_writes import KVWriteRecord

BS = 16


def _record(req_blocks: dict[str, list[int]], spans: dict[str, tuple[int, int]], pad: int = 0, *, shift=0):
    """Slot mappings computed from the block tables exactly as the runner does, plus PAD tail."""
    qsl, positions, slots = [0], [], []
    for req_id, (start, n) in spans.items():
        table = req_blocks[req_id]
        for p in range(start, start + n):
            col = p // BS
            block = table[col] if col < len(table) else 0
            positions.append(p)
            slots.append(block * BS + p % BS + shift)
        qsl.append(len(positions))
    positions += [0] * pad
    slots += [-1] * pad
    return KVWriteRecord("target", "full", list(spans), qsl, torch.tensor(positions), torch.tensor(slots))


def test_writes_inside_held_blocks_and_pad_tail_are_clean():
    held = {"a": [3, 7], "b": [5]}
    rec = _record(held, {"a": (14, 4), "b": (0, 9)}, pad=3)
    res = audit_records("s", [rec], {r: {"full": ids} for r, ids in held.items()}, {"full": BS})
    assert res.ok and res.slots_checked == 4 + 9 + 3 and res.passes == 1


def test_a_write_past_the_reservation_lands_in_the_null_block_and_is_reported():
    held = {"a": [3]}
    # positions 14..17: 16 and 17 need a second block the request does not hold; a zeroed table
    # column sends them to block 0, exactly the silent bug warmcap exists to catch
    rec = _record(held, {"a": (14, 4)})
    res = audit_records("s", [rec], {"a": {"full": [3]}}, {"full": BS})
    assert [v.position for v in res.violations] == [16, 17]
    assert all(v.block == 0 and "past the 1 block" in v.reason for v in res.violations)


def test_a_padded_token_with_a_real_slot_is_reported():
    rec = _record({"a": [3]}, {"a": (0, 2)}, pad=2)
    rec.slot_mapping[-1] = 3 * BS + 5
    res = audit_records("s", [rec], {"a": {"full": [3]}}, {"full": BS})
    assert len(res.violations) == 1 and res.violations[0].request == "<padding>"


def test_another_requests_block_is_reported():
    rec = _record({"a": [3, 9]}, {"a": (0, 20)})
    res = audit_records("s", [rec], {"a": {"full": [3, 4]}}, {"full": BS})
    assert {v.position for v in res.violations} == set(range(16, 20))
    assert all("not held" in v.reason for v in res.violations)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 80), st.integers(1, 20), st.integers(0, 3)), min_size=1, max_size=6),
    st.integers(0, 5),
)
def test_audit_flags_exactly_the_tokens_outside_the_allocation(reqs, pad):
    """Property: allocate cdiv(start+n, BS) - short blocks; the audit reports exactly the tokens whose
    column is past what was allocated."""
    next_block, held, spans, expected = 1, {}, {}, set()
    for i, (start, n, short) in enumerate(reqs):
        need = -(-(start + n) // BS)
        have = max(need - short, 0)
        held[f"r{i}"] = list(range(next_block, next_block + have))
        next_block += have
        spans[f"r{i}"] = (start, n)
        expected |= {(f"r{i}", p) for p in range(start, start + n) if p // BS >= have}
    rec = _record(held, spans, pad)
    res = audit_records("s", [rec], {r: {"full": ids} for r, ids in held.items()}, {"full": BS})
    assert {(v.request, v.position) for v in res.violations} == expected
