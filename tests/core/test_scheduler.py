from __future__ import annotations

import random

import pytest
from core_fakes import FakeRunner, make_request, make_scheduler, run_to_completion

from warmcap.core.outputs import ModelRunnerOutput, SchedulerOutput
from warmcap.core.request import Request, RequestStatus
from warmcap.core.scheduler import Scheduler
from warmcap.errors import CapacityError, ConfigError


def step(sched: Scheduler, sampled: dict[str, list[int]], drafts: dict[str, list[int]] | None = None):
    """Schedule one step and feed back the given tokens; returns (scheduler output, results)."""
    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(req_ids, [sampled.get(r, []) for r in req_ids], drafts or {})
    return out, sched.update_from_output(out, runner)


def test_prefill_then_decode():
    sched = make_scheduler()
    sched.add_request(make_request("a", list(range(20)), max_tokens=3))
    out, results = step(sched, {"a": [7]})
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens, new.block_ids) == ("a", 0, {"full": [1, 2]})
    assert out.num_scheduled_tokens == {"a": 20}
    assert results[0].new_token_ids == [7] and not results[0].finished
    out, _ = step(sched, {"a": [8]})
    (cached,) = out.scheduled_cached_reqs
    assert (cached.num_computed_tokens, cached.new_block_ids, out.num_scheduled_tokens) == (
        20,
        {"full": []},
        {"a": 1},
    )
    _, results = step(sched, {"a": [9]})
    assert results[0].finished and results[0].finish_reason == "length"
    assert step(sched, {})[0].finished_req_ids == {"a"}
    assert sched.kv.pool.num_free_blocks == 63


def test_chunked_prefill_splits_a_long_prompt_by_the_budget():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(make_request("a", list(range(70))))
    chunks = []
    while not sched.requests["a"].output_token_ids:
        out, _ = step(sched, {"a": [1]} if sched.requests["a"].num_computed_tokens >= 38 else {})
        chunks.append(out.num_scheduled_tokens["a"])
    assert chunks == [32, 32, 6]


def test_prompt_tokens_beside_decodes_stay_within_the_cap_and_a_burst_alone_takes_the_budget():
    sched = make_scheduler(max_num_batched_tokens=64, max_prefill_tokens_with_decodes=16)
    # Nothing decodes yet: two prompts share the whole 64-token budget.
    sched.add_request(make_request("a", list(range(40)), max_tokens=20))
    sched.add_request(make_request("b", list(range(100, 130)), max_tokens=20))
    out, _ = step(sched, {"a": [1]})
    assert out.num_scheduled_tokens == {"a": 40, "b": 24}
    # a decodes now: b's last 6 prompt tokens and c's first 10 fill the 16-token allowance.
    sched.add_request(make_request("c", list(range(200, 240)), max_tokens=20))
    sched.add_request(make_request("d", list(range(300, 310)), max_tokens=20))
    out, _ = step(sched, {"a": [2], "b": [3]})
    assert out.num_scheduled_tokens == {"a": 1, "b": 6, "c": 10}
    # b decodes too; c's running chunk takes the whole allowance, so d (waiting) gets none.
    out, _ = step(sched, {"a": [4], "b": [5]})
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 16}
    out, _ = step(sched, {"a": [6], "b": [7], "c": [8]})
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 14, "d": 2}
    assert [r.request_id for r in sched.waiting] == []


def test_without_chunking_a_prompt_waits_for_room():
    sched = make_scheduler(max_num_batched_tokens=32, chunked_prefill=False)
    with pytest.raises(ConfigError, match="40-token prompt exceeds max_num_batched_tokens 32"):
        sched.add_request(make_request("big", list(range(40))))
    sched.add_request(make_request("a", list(range(20))))
    sched.add_request(make_request("b", list(range(100, 120))))
    out, _ = step(sched, {"a": [1]})
    assert out.num_scheduled_tokens == {"a": 20}  # b (20) does not fit in the 12 left
    out, _ = step(sched, {"a": [2], "b": [3]})
    assert out.num_scheduled_tokens == {"a": 1, "b": 20}


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [i, i + 1]))
    out, _ = step(sched, {"r0": [1], "r1": [1]})
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert sched.get_num_unfinished_requests() == 3


def test_spec_decode_schedules_drafts_reserves_lookahead_and_rolls_back():
    sched = make_scheduler(spec="eagle3:3", block_size=4)
    sched.add_request(make_request("a", list(range(6)), max_tokens=20))
    out, _ = step(sched, {"a": [10]}, drafts={"a": [11, 12, 13]})
    assert out.num_lookahead_tokens == {"a": 3}
    assert sched.kv.num_held_blocks("a") == {"full": 3}  # cdiv(6 + 3, 4)
    out, results = step(sched, {"a": [11, 50]}, drafts={"a": [51, 52, 53]})
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}
    assert sched.kv.num_held_blocks("a") == {"full": 4}  # cdiv(6 + 4 + 3, 4)
    assert results[0].new_token_ids == [11, 50] and results[0].num_accepted_tokens == 1
    req = sched.requests["a"]
    assert req.num_computed_tokens == 8 and req.num_tokens == 9 and req.spec_token_ids == [51, 52, 53]
    stats = sched.stats().spec_decode
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.mean_acceptance_length == 2.0


def test_scheduled_drafts_stay_as_scheduled_after_new_drafts_arrive():
    sched = make_scheduler(spec="eagle3:3", block_size=4)
    sched.add_request(make_request("a", list(range(6)), max_tokens=20))
    step(sched, {"a": [10]}, drafts={"a": [11, 12, 13]})
    out, _ = step(sched, {"a": [11, 50]}, drafts={"a": [51, 52, 53]})
    later, _ = step(sched, {"a": [51]}, drafts={"a": [61, 62, 63]})
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}
    assert later.scheduled_spec_decode_tokens == {"a": [51, 52, 53]}


def test_dflash_reserves_k_plus_one_and_ngram_none():
    for spec, lookahead in (("dflash:3", 4), ("ngram:3", 0), ("mtp:2", 2), (None, 0)):
        sched = make_scheduler(spec=spec)
        sched.add_request(make_request("a", [1, 2, 3]))
        assert sched.schedule().num_lookahead_tokens == {"a": lookahead}


def test_runner_cannot_accept_more_than_the_drafts():
    sched = make_scheduler(spec="eagle:2")
    sched.add_request(make_request("a", [1, 2, 3]))
    step(sched, {"a": [4]})  # no drafts proposed
    with pytest.raises(ValueError, match="2 tokens for 'a' with 0 drafts"):
        step(sched, {"a": [5, 6]})


def test_drafts_are_truncated_at_max_model_len():
    sched = make_scheduler(spec="eagle:4", max_model_len=12, block_size=4)
    sched.add_request(make_request("a", list(range(8)), max_tokens=100))
    step(sched, {"a": [1]}, drafts={"a": [2, 3, 4, 5]})
    out, results = step(sched, {"a": [2, 3, 4]}, drafts={"a": [6, 7, 8, 9]})
    # 8 computed, at most 11 positions: the real token and 2 drafts
    assert out.scheduled_spec_decode_tokens == {"a": [2, 3]}
    assert results[0].finished and results[0].finish_reason == "length"
    assert len(sched.kv.pool.snapshot().free_order) == sched.kv.pool.num_blocks - 1


def test_stops_on_eos_and_stop_tokens_and_truncates_accepted_tokens():
    sched = make_scheduler(spec="eagle:3", eos_token_id=2)
    sched.add_request(make_request("eos", [5, 6], max_tokens=50))
    sched.add_request(make_request("stop", [5, 6], max_tokens=50, stop_token_ids=(9,), ignore_eos=True))
    sched.add_request(make_request("ignore", [5, 6], max_tokens=50, ignore_eos=True))
    sched.add_request(make_request("max", [5, 6], max_tokens=2, ignore_eos=True))
    first = {r: [7] for r in ("eos", "stop", "ignore", "max")}
    step(sched, first, drafts={r: [2, 9, 4] for r in first})
    _, results = step(sched, {r: [2, 9, 4, 3] for r in first})
    by_id = {r.req_id: r for r in results}
    assert (by_id["eos"].new_token_ids, by_id["eos"].finish_reason) == ([2], "stop")
    assert (by_id["stop"].new_token_ids, by_id["stop"].finish_reason) == ([2, 9], "stop")
    assert (by_id["max"].new_token_ids, by_id["max"].finish_reason) == ([2], "length")
    assert by_id["ignore"].new_token_ids == [2, 9, 4, 3] and not by_id["ignore"].finished
    assert sched.requests.keys() == {"ignore"}


def test_preemption_recomputes_the_newest_request():
    # 4 usable blocks of 4 tokens; two requests of 7 tokens each take 2 blocks
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=16)
    sched.add_request(make_request("old", list(range(7)), max_tokens=8))
    sched.add_request(make_request("new", list(range(10, 17)), max_tokens=8))
    step(sched, {"old": [1], "new": [2]})
    out, _ = step(sched, {"old": [3], "new": [4]})  # both now hold 8 tokens' worth
    out, _ = step(sched, {"old": [5]})  # old needs a third block: new is preempted
    assert out.preempted_req_ids == {"new"} and list(out.num_scheduled_tokens) == ["old"]
    victim = sched.requests["new"]
    assert (victim.status, victim.num_computed_tokens, victim.num_preemptions) == (
        RequestStatus.PREEMPTED,
        0,
        1,
    )
    assert sched.waiting[0] is victim and sched.kv.num_held_blocks("new") == {"full": 0}
    while "old" in sched.requests:
        out, _ = step(sched, {"old": [6]})
    out, _ = step(sched, {"new": [7]})
    (resumed,) = out.scheduled_new_reqs
    assert resumed.output_token_ids == [2, 4] and resumed.num_computed_tokens == 0
    assert out.num_scheduled_tokens == {"new": 9}
    assert sched.num_preemptions == 1


def test_a_request_that_cannot_grow_preempts_itself():
    sched = make_scheduler(num_blocks=3, block_size=4, max_model_len=8)
    sched.add_request(make_request("a", list(range(4)), max_tokens=3))
    sched.add_request(make_request("b", list(range(4)), max_tokens=3))
    step(sched, {"a": [1], "b": [1]})
    out, _ = step(sched, {"a": [2]})
    assert out.preempted_req_ids == {"b"}


def test_abort_frees_blocks_and_is_reported_next_step():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", list(range(20))))
    sched.add_request(make_request("wait", list(range(20)), max_tokens=4))
    step(sched, {"run": [1]})
    assert sched.abort_request("run") and sched.abort_request("wait")
    assert not sched.abort_request("run")
    out = sched.schedule()
    assert out.finished_req_ids == {"run", "wait"} and out.is_empty
    assert sched.kv.pool.num_free_blocks == 63 and not sched.has_unfinished_requests()


def test_prefix_hits_skip_computed_tokens():
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", list(range(10)), max_tokens=1))
    step(sched, {"a": [1]})
    sched.add_request(make_request("b", [*range(9), 77]))
    out, _ = step(sched, {"b": [1]})
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens == {"b": 2}
    assert sched.requests["b"].num_cached_tokens == 8


def test_pd_consumer_waits_for_its_remote_kv_then_speculates():
    sched = make_scheduler(spec="eagle:2", kv_role="consumer")
    req = make_request("a", list(range(30)))
    req.num_external_computed_tokens = 29
    sched.add_request(req)
    # The load starts: blocks for the loaded tokens, no lookahead, and no forward.
    out, _ = step(sched, {"a": [5]})
    assert out.num_scheduled_tokens == {} and out.scheduled_new_reqs == []
    load = out.kv_loads["a"]
    assert (load.num_local_tokens, load.num_external_tokens, load.block_ids) == (0, 29, {"full": [1, 2]})
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and sched.has_unfinished_requests()
    # Until the runner reports the load done, the request stays parked.
    out, _ = step(sched, {})
    assert out.num_scheduled_tokens == {} and out.kv_loads == {}
    sched.update_from_output(SchedulerOutput(), ModelRunnerOutput(finished_recving={"a"}))
    # Arrived: scheduled from its loaded tokens with the full lookahead, and it drafts.
    out, _ = step(sched, {"a": [5]}, drafts={"a": [6, 7]})
    (new,) = out.scheduled_new_reqs
    assert (new.num_computed_tokens, new.block_ids, out.num_scheduled_tokens, out.num_lookahead_tokens) == (
        29,
        {"full": [1, 2]},
        {"a": 1},
        {"a": 2},
    )
    out, _ = step(sched, {"a": [6]})
    assert out.num_lookahead_tokens == {"a": 2} and out.num_scheduled_tokens == {"a": 3}


def test_pd_consumer_abort_while_loading_frees_its_blocks():
    sched = make_scheduler(spec="eagle:2", kv_role="consumer")
    req = make_request("a", list(range(30)))
    req.num_external_computed_tokens = 29
    sched.add_request(req)
    free = sched.kv.pool.num_free_blocks
    step(sched, {})
    assert sched.kv.pool.num_free_blocks == free - 2
    assert sched.abort_request("a")
    assert sched.kv.pool.num_free_blocks == free and not sched.has_unfinished_requests()
    # A late completion report for the aborted request changes nothing.
    sched.update_from_output(SchedulerOutput(), ModelRunnerOutput(finished_recving={"a"}))
    assert not sched.has_unfinished_requests()


def test_blocks_still_loading_are_not_prefix_hits():
    sched = make_scheduler(kv_role="consumer", block_size=4)
    req = make_request("a", list(range(12)))
    req.num_external_computed_tokens = 11
    sched.add_request(req)
    step(sched, {})
    # Same prompt while the first one's KV is still in flight: nothing may be read from those blocks.
    sched.add_request(make_request("b", list(range(12))))
    out, _ = step(sched, {"b": [1]})
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens) == ("b", 0)


def test_producer_reserves_no_lookahead():
    sched = make_scheduler(spec="eagle3:3", kv_role="producer")
    sched.add_request(make_request("a", [1, 2, 3]))
    assert sched.schedule().num_lookahead_tokens == {"a": 0}


def test_add_request_rejects_requests_that_could_never_run():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ConfigError, match="empty prompt"):
        sched.add_request(make_request("e", []))
    with pytest.raises(ConfigError, match="32 tokens leaves no room"):
        sched.add_request(make_request("long", list(range(32))))
    with pytest.raises(CapacityError, match="may need 5 KV blocks"):
        sched.add_request(make_request("big", list(range(10)), max_tokens=10))
    sched.add_request(make_request("ok", list(range(10)), max_tokens=2))
    with pytest.raises(ValueError, match="already queued"):
        sched.add_request(make_request("ok", [1]))


def test_scheduler_fills_in_the_default_eos():
    sched = make_scheduler(eos_token_id=2)
    req = Request("a", [1])
    sched.add_request(req)
    assert req.eos_token_id == 2
    _, results = step(sched, {"a": [2]})
    assert results[0].finish_reason == "stop"


def test_empty_step_carries_finished_ids_only():
    sched = make_scheduler()
    out = sched.schedule()
    assert isinstance(out, SchedulerOutput) and out.is_empty and not out.finished_req_ids


def test_without_chunking_a_resumed_request_longer_than_the_budget_is_recomputed_in_chunks():
    sched = make_scheduler(
        block_size=4, num_blocks=9, max_num_batched_tokens=16, chunked_prefill=False, enable_caching=False
    )
    sched.add_request(make_request("a", list(range(8)), max_tokens=20, ignore_eos=True))
    sched.add_request(make_request("b", list(range(50, 58)), max_tokens=20, ignore_eos=True))
    outputs = run_to_completion(sched, FakeRunner(random.Random(0), k=0))
    assert sched.num_preemptions >= 1
    resumed = [(o, n) for o in outputs for n in o.scheduled_new_reqs if n.output_token_ids]
    assert resumed, "b was never resumed"
    out, new = resumed[0]
    assert len(new.prompt_token_ids) + len(new.output_token_ids) > 16 == out.num_scheduled_tokens[new.req_id]
    assert sched.kv.pool.num_free_blocks == 8
