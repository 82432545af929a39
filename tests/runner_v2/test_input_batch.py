"""Persistent batch deltas and the per-step inputs built from them."""

from __future__ import annotations

from warmcap.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from warmcap.runner_v2.input_batch import InputBatch
from warmcap.sampling_params import SamplingParams


def _batch(**kw) -> InputBatch:
    return InputBatch(max_num_reqs=3, max_model_len=64, max_blocks_per_req=8, group_names=["full"], **kw)


def _new(req_id: str, prompt: list[int], blocks: list[int], computed: int = 0, **kw) -> NewRequestData:
    return NewRequestData(req_id, prompt, SamplingParams(**kw), {"full": blocks}, computed)


def test_rows_are_reused_lowest_first_without_stale_state() -> None:
    b = _batch()
    b.update(SchedulerOutput(scheduled_new_reqs=[_new("a", [1, 2, 3], [5, 6]), _new("b", [4], [7])]))
    assert b.row_of == {"a": 0, "b": 1}
    b.update(SchedulerOutput(finished_req_ids={"a"}))
    assert b.block_tables["full"].table[0].tolist() == [0] * 8
    assert b.token_ids[0].sum() == 0
    b.update(SchedulerOutput(scheduled_new_reqs=[_new("c", [9], [3], temperature=0.5)]))
    assert b.row_of == {"b": 1, "c": 0}
    assert b.block_tables["full"].row(0) == [3]
    assert b.temperature[0] == 0.5


def test_preempted_request_leaves_and_resumes_with_its_outputs() -> None:
    b = _batch()
    b.update(SchedulerOutput(scheduled_new_reqs=[_new("a", [1, 2], [5])]))
    b.update(SchedulerOutput(preempted_req_ids={"a"}))
    assert b.num_reqs == 0
    resumed = _new("a", [1, 2], [8])
    resumed.output_token_ids = [3, 4]
    b.update(SchedulerOutput(scheduled_new_reqs=[resumed], num_scheduled_tokens={"a": 4}))
    step = b.prepare_inputs(SchedulerOutput(num_scheduled_tokens={"a": 4}))
    assert step.input_ids.tolist() == [1, 2, 3, 4]
    assert step.logits_indices.tolist() == [3]


def test_prepare_inputs_chunked_prefill_decode_and_drafts() -> None:
    b = _batch()
    b.update(
        SchedulerOutput(
            scheduled_new_reqs=[_new("p", list(range(10, 20)), [1, 2, 3]), _new("d", [5, 6, 7], [4], 2)]
        )
    )
    b.append_tokens("d", [8])
    b.update(SchedulerOutput(scheduled_cached_reqs=[CachedRequestData("d", {"full": [9]}, 3)]))
    out = SchedulerOutput(num_scheduled_tokens={"p": 6, "d": 3}, scheduled_spec_decode_tokens={"d": [11, 12]})
    b.update(SchedulerOutput(scheduled_spec_decode_tokens={"d": [11, 12]}))
    step = b.prepare_inputs(out)
    assert step.query_start_loc.tolist() == [0, 6, 9]
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert step.input_ids.tolist() == [10, 11, 12, 13, 14, 15, 8, 11, 12]
    assert step.seq_lens.tolist() == [6, 6]
    # The prompt chunk does not reach the end: no logits; the decode verifies 2 drafts: 3 logits.
    assert step.num_logits.tolist() == [0, 3]
    assert step.logits_indices.tolist() == [6, 7, 8]
    assert step.block_tables["full"][:, :2].tolist() == [[1, 2], [4, 9]]
    assert step.max_num_blocks == 3
