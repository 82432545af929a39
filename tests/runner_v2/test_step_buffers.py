"""Static step buffers: real rows copied, padding benign (slot PAD, zero table row, seq_len 0)."""

from __future__ import annotations

import pytest

from warmcap.contracts import PAD_SLOT_ID
from warmcap.core.outputs import NewRequestData, SchedulerOutput
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
