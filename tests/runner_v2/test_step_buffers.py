"""Static step buffers: real rows copied, padding benign (slot PAD, zero table row, seq_len 0)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.contracts import PAD_SLOT_ID
from warmcap.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from warmcap.runner_v2.input_batch import InputBatch
from warmcap.runner_v2.step_buffers import StepBuffers
from warmcap.sampling_params import SamplingParams


def _step():
    batch = InputBatch(max_num_reqs=4, max_model_len=32, max_blocks_per_req=4, group_names=["full"])
    new = [
        NewRequestData("a", [1, 2, 3, 4, 5], SamplingParams(), {"full": [3, 7]}, 0),
        NewRequestData("b", [6, 7], SamplingParams(), {"full": [2]}, 0),
    ]
    out = SchedulerOutput(scheduled_new_reqs=new, num_scheduled_tokens={"a": 5, "b": 2})
    batch.update(out)
    return batch.prepare_inputs(out)


def _buffers() -> StepBuffers:
    return StepBuffers(
        max_num_tokens=16, max_num_reqs=4, max_blocks_per_req=4, group_block_sizes={"full": 4}, device="cpu"
    )


def test_padded_step_has_benign_padding() -> None:
    buf = _buffers()
    buf.block_tables["full"].fill_(9)  # stale content from an earlier step
    buf.copy_from(_step(), num_tokens_padded=10, num_reqs_padded=3)
    meta = buf.attn_metadata()["full"]
    assert meta.num_tokens == 10 and meta.num_reqs == 3
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, 28, 8, 9] + [PAD_SLOT_ID] * 3
    assert meta.query_start_loc.tolist() == [0, 5, 7, 10]
    assert meta.seq_lens.tolist() == [5, 2, 0]
    assert meta.block_table[2].tolist() == [0, 0, 0, 0]
    assert buf.input_ids[:10].tolist() == [1, 2, 3, 4, 5, 6, 7, 0, 0, 0]
    assert buf.logits_indices[: buf.num_logits].tolist() == [4, 6]


def test_eager_step_trims_columns_and_padding_needs_a_row() -> None:
    buf = _buffers()
    step = _step()
    buf.copy_from(step)
    assert buf.attn_metadata(num_columns=step.max_num_blocks)["full"].block_table.tolist() == [[3, 7], [2, 0]]
    with pytest.raises(ValueError, match="padded row"):
        buf.copy_from(step, num_tokens_padded=9)


# ---- block-table rows kept in the buffers between steps --------------------------------------------

BS, WIDTH = 4, 6


def _kept_rows_buffers() -> StepBuffers:
    return StepBuffers(
        max_num_tokens=24,
        max_num_reqs=4,
        max_blocks_per_req=WIDTH,
        group_block_sizes={"full": BS},
        device="cpu",
    )


def _fresh_batch() -> tuple[InputBatch, StepBuffers]:
    batch = InputBatch(
        max_num_reqs=4, max_model_len=BS * WIDTH, max_blocks_per_req=WIDTH, group_names=["full"]
    )
    return batch, _kept_rows_buffers()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_kept_block_table_rows_equal_a_full_reload(data: st.DataObject) -> None:
    """Steps of a random life (requests joining, decoding across block boundaries, leaving, the
    scheduler's order changing, other loads and paddings in between): after every load the buffers
    (table rows, slot mapping, the layout a decode step keeps) hold what loading afresh gives."""
    batch, buf = _fresh_batch()
    ref = _kept_rows_buffers()
    state: dict[str, list[int]] = {}  # req -> [computed, num_tokens]
    next_block, next_id = 1, 0
    for _ in range(data.draw(st.integers(3, 14), label="steps")):
        out = SchedulerOutput()
        # Leave: a random subset of the running requests.
        for req_id in list(state):
            if data.draw(st.booleans(), label=f"finish {req_id}") and len(state) > 1:
                out.finished_req_ids.add(req_id)
                del state[req_id]
        # Join: a new request with a prompt of 1..5 tokens, all of it scheduled now.
        if len(state) < 4 and data.draw(st.booleans(), label="join"):
            req_id, n = f"r{next_id}", data.draw(st.integers(1, 5), label="prompt")
            next_id += 1
            blocks = list(range(next_block, next_block + (n + BS - 1) // BS))
            next_block += len(blocks)
            out.scheduled_new_reqs.append(
                NewRequestData(req_id, list(range(10, 10 + n)), SamplingParams(), {"full": blocks}, 0)
            )
            out.num_scheduled_tokens[req_id] = n
            state[req_id] = [0, n]
        # Decode the others one token each (a new block when the token starts one).
        order = [r for r in state if r not in out.num_scheduled_tokens]
        order = (
            data.draw(st.permutations(order), label="order")
            if data.draw(st.booleans(), label="shuffle")
            else order
        )
        for req_id in order:
            computed, num_tokens = state[req_id]
            if num_tokens >= BS * WIDTH - 1:
                continue
            new = []
            if computed % BS == 0 and computed // BS >= len(
                batch.block_tables["full"].row(batch.row_of[req_id])
            ):
                new = [next_block]
                next_block += 1
            out.scheduled_cached_reqs.append(CachedRequestData(req_id, {"full": new}, computed))
            out.num_scheduled_tokens[req_id] = 1
        if not out.num_scheduled_tokens:
            continue
        batch.update(out)
        step = batch.prepare_inputs(out)
        if data.draw(st.booleans(), label="foreign load first"):
            # Another pass through the same buffers (a graph's padding load, a verification).
            buf.load_layout(
                query_start_loc=np.zeros(2, dtype=np.int32),
                positions=np.zeros(0, dtype=np.int64),
                seq_lens=np.zeros(1, dtype=np.int32),
                block_tables={"full": np.full((1, WIDTH), 7, dtype=np.int32)},
            )
        r = step.num_reqs
        rp = data.draw(st.integers(r, 5), label="padded rows")
        pad = {} if rp == r else {"num_reqs_padded": rp, "num_tokens_padded": step.num_tokens + rp - r}
        buf.copy_from(step, **pad)
        ref.copy_from(replace(step, tables_key=None, decode=False), **pad)
        assert buf.block_tables["full"][:rp].tolist() == ref.block_tables["full"][:rp].tolist()
        expected = [batch.block_tables["full"].row(int(row)) for row in step.rows]
        assert [
            row[: len(e)] for row, e in zip(buf.block_tables["full"][:r].tolist(), expected, strict=True)
        ] == expected
        tp = buf.num_tokens_padded
        assert buf.slot_mappings["full"][:tp].tolist() == ref.slot_mappings["full"][:tp].tolist()
        # The layout a decode step keeps: query offsets (both copies) and sampling indices.
        assert buf.query_start_loc[: rp + 1].tolist() == ref.query_start_loc[: rp + 1].tolist()
        assert buf.query_start_loc_cpu[: rp + 1].tolist() == ref.query_start_loc_cpu[: rp + 1].tolist()
        n = buf.num_logits
        assert n == ref.num_logits and buf.logits_indices[:n].tolist() == ref.logits_indices[:n].tolist()
        for name in ("positions", "input_ids"):
            assert getattr(buf, name)[:tp].tolist() == getattr(ref, name)[:tp].tolist()
        assert buf.seq_lens[:rp].tolist() == ref.seq_lens[:rp].tolist()
        # Then the tokens join: each sampled one.
        batch.append_sampled(step.rows, [[99] if n else [] for n in step.num_logits.tolist()])
        for req_id, n in out.num_scheduled_tokens.items():
            state[req_id][0] += n
            if step.num_logits[step.req_ids.index(req_id)]:
                state[req_id][1] += 1
