"""Persistent batch deltas and the per-step inputs built from them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _plain_inputs(b: InputBatch, sched: dict[str, int], drafts: dict[str, list[int]]):
    """The step's inputs token by token, as the definitions say (the oracle of the array code)."""
    positions, ids, logits, num_logits = [], [], [], []
    for req_id, n in sched.items():
        row = b.row_of[req_id]
        start = int(b.num_computed[row])
        first = len(positions)
        positions += range(start, start + n)
        ids += [int(b.token_ids[row, p]) for p in range(start, start + n)]
        k = len(drafts.get(req_id, []))
        samples = start + n >= int(b.num_tokens[row]) + k
        num_logits.append(1 + k if samples else 0)
        logits += range(first + n - num_logits[-1], first + n)
    return positions, ids, logits, num_logits


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_prepare_inputs_matches_the_token_by_token_definition(data) -> None:
    # Decode steps (one token a request) take a short path of their own; mixed steps the general
    # one. Both must agree with the definition, step after step, as tokens are appended.
    b = InputBatch(max_num_reqs=4, max_model_len=64, max_blocks_per_req=8, group_names=["full"])
    n = data.draw(st.integers(1, 4))
    for i in range(n):
        prompt = data.draw(st.lists(st.integers(1, 99), min_size=1, max_size=12))
        b.add_request(_new(f"r{i}", prompt, [1 + i, 5 + i]))
    for _ in range(data.draw(st.integers(1, 4))):
        sched, drafts = {}, {}
        order = data.draw(st.permutations([f"r{i}" for i in range(n)]))
        for req_id in order:
            row = b.row_of[req_id]
            known, done = int(b.num_tokens[row]), int(b.num_computed[row])
            if done < known - 1:  # a prompt still to run: a chunk of it, maybe to its end
                sched[req_id] = data.draw(st.integers(1, known - done))
            else:
                b.num_computed[row] = known - 1
                k = data.draw(st.integers(0, 2))
                if k:
                    drafts[req_id] = data.draw(st.lists(st.integers(1, 99), min_size=k, max_size=k))
                sched[req_id] = 1 + k
        out = SchedulerOutput(num_scheduled_tokens=sched, scheduled_spec_decode_tokens=drafts)
        b.update(out)
        want = _plain_inputs(b, sched, drafts)
        step = b.prepare_inputs(out)
        got = (step.positions.tolist(), step.input_ids.tolist(), step.logits_indices.tolist())
        assert (*got, step.num_logits.tolist()) == want
        assert step.seq_lens.tolist() == [int(b.num_computed[b.row_of[r]]) + m for r, m in sched.items()]
        # The step's tokens become computed; each sampling request gains a token (drafts rejected).
        sampled = [[7] if m else [] for m in step.num_logits.tolist()]
        for req_id, m in sched.items():
            b.num_computed[b.row_of[req_id]] += m
        before = {r: b.token_ids[b.row_of[r], : b.num_tokens[b.row_of[r]]].tolist() for r in sched}
        b.append_sampled(step.rows, sampled)
        for (req_id, toks), tail in zip(before.items(), sampled, strict=True):
            row = b.row_of[req_id]
            assert b.token_ids[row, : b.num_tokens[row]].tolist() == toks + tail
            b.num_computed[row] = min(int(b.num_computed[row]), int(b.num_tokens[row]) - 1)


def test_append_sampled_places_accepted_runs_after_each_request() -> None:
    b = _batch()
    b.update(
        SchedulerOutput(scheduled_new_reqs=[_new("a", [1, 2], [5]), _new("b", [3], [6]), _new("c", [4], [7])])
    )
    rows = b.prepare_inputs(SchedulerOutput(num_scheduled_tokens={"c": 1, "a": 2, "b": 1})).rows
    b.append_sampled(rows, [[9, 8, 7], [], [6]])
    assert [b.token_ids[b.row_of[r], : b.num_tokens[b.row_of[r]]].tolist() for r in "abc"] == [
        [1, 2],
        [3, 6],
        [4, 9, 8, 7],
    ]


def test_a_step_with_the_same_requests_reuses_nothing_stale_after_the_batch_changes() -> None:
    # The rows of a step are cached while the scheduled requests and the batch's composition hold:
    # a request that leaves and another that takes its row must be seen.
    b = _batch()
    b.update(SchedulerOutput(scheduled_new_reqs=[_new("a", [1, 2], [5]), _new("b", [3, 4], [6])]))
    sched = SchedulerOutput(num_scheduled_tokens={"b": 2})
    assert b.prepare_inputs(sched).input_ids.tolist() == [3, 4]
    b.update(SchedulerOutput(finished_req_ids={"a", "b"}))
    b.update(SchedulerOutput(scheduled_new_reqs=[_new("b", [8, 9], [6])]))
    step = b.prepare_inputs(sched)
    assert step.rows.tolist() == [0] and step.input_ids.tolist() == [8, 9]


@pytest.mark.parametrize("runs", [False, True], ids=["one-each", "accepted-runs"])
def test_append_sampled_scatter_of_a_large_batch_equals_appending_request_by_request(runs) -> None:
    # From 8 rows the tokens go in with one scatter; it must place them as appending one by one does.
    twins = [
        InputBatch(max_num_reqs=12, max_model_len=64, max_blocks_per_req=8, group_names=["full"])
        for _ in range(2)
    ]
    prompts = [[i + 1] * (1 + i % 4) for i in range(10)]
    for b in twins:
        for i, p in enumerate(prompts):
            b.add_request(_new(f"r{i}", p, [i + 1]))
    order = [f"r{i}" for i in (3, 0, 9, 1, 8, 2, 7, 4, 6, 5)]
    sampled = [[50 + i] * ((i % 3) if runs else 1) for i in range(10)]
    fast, slow = twins
    fast.append_sampled(np.array([fast.row_of[r] for r in order]), sampled)
    for r, toks in zip(order, sampled, strict=True):
        slow.append_tokens(r, toks)
    assert (fast.token_ids == slow.token_ids).all() and (fast.num_tokens == slow.num_tokens).all()
