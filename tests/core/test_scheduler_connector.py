"""The scheduler with a KV connector's scheduler side (core/kv_connector.py): the connector says
which tokens load, learns their blocks, describes each step, and on a producer keeps a finished
request's blocks until the runner reports its peer read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from core_fakes import make_request, make_scheduler

from warmcap.core.outputs import BlockIds, ModelRunnerOutput, SchedulerOutput
from warmcap.core.request import Request, RequestStatus


@dataclass
class RecordingConnector:
    """Loads ``matched`` tokens of every request and keeps finished requests' blocks if ``keep``."""

    matched: int = 0
    keep: bool = False
    allocs: list[tuple[str, BlockIds, int]] = field(default_factory=list)
    metas: list[set[str]] = field(default_factory=list)
    finished: list[tuple[str, BlockIds]] = field(default_factory=list)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return self.matched

    def update_state_after_alloc(
        self, request: Request, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        self.allocs.append((request.request_id, block_ids, num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        self.metas.append(set(scheduler_output.kv_loads))
        return {"loads": sorted(scheduler_output.kv_loads)}

    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, dict | None]:
        self.finished.append((request.request_id, block_ids))
        return self.keep, {"remote_block_ids": block_ids["full"], "remote_engine_id": "p0"}


def _run_one(sched, req_id: str, sampled: list[int]) -> SchedulerOutput:
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(ids, [sampled for _ in ids]))
    return out


def test_connector_loads_decide_the_external_tokens_and_see_their_blocks() -> None:
    connector = RecordingConnector(matched=40)
    sched = make_scheduler(spec="eagle:2", kv_role="consumer")
    sched.connector = connector
    sched.add_request(make_request("a", list(range(30))))
    out = sched.schedule()
    assert out.kv_connector_metadata == {"loads": ["a"]} and out.num_scheduled_tokens == {}
    # The connector offered 40 tokens; all but the prompt's last (29) are loaded.
    assert out.kv_loads["a"].num_external_tokens == 29
    assert connector.allocs == [("a", {"full": [1, 2]}, 29)]
    sched.update_from_output(out, ModelRunnerOutput())
    assert sched.requests["a"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.update_from_output(SchedulerOutput(), ModelRunnerOutput(finished_recving={"a"}))
    out = sched.schedule()
    assert (out.scheduled_new_reqs[0].num_computed_tokens, out.num_lookahead_tokens) == (29, {"a": 2})
    assert out.kv_connector_metadata == {"loads": []}


def test_producer_keeps_finished_blocks_until_the_peer_read_them() -> None:
    connector = RecordingConnector(keep=True)
    sched = make_scheduler(kv_role="producer")
    sched.connector = connector
    free = sched.kv.pool.num_free_blocks
    req = make_request("a", list(range(20)), max_tokens=1)
    sched.add_request(req)
    _run_one(sched, "a", [7])
    assert connector.finished == [("a", {"full": [1, 2]})]
    assert req.kv_transfer_params == {"remote_block_ids": [1, 2], "remote_engine_id": "p0"}
    assert not sched.has_unfinished_requests() and sched.kv.pool.num_free_blocks == free - 2
    sched.update_from_output(SchedulerOutput(), ModelRunnerOutput(finished_sending={"a"}))
    assert sched.kv.pool.num_free_blocks == free and sched.sending == {}


def test_without_keeping_blocks_are_freed_at_once() -> None:
    connector = RecordingConnector(keep=False)
    sched = make_scheduler(kv_role="producer")
    sched.connector = connector
    free = sched.kv.pool.num_free_blocks
    sched.add_request(make_request("a", list(range(20)), max_tokens=1))
    _run_one(sched, "a", [7])
    assert sched.kv.pool.num_free_blocks == free and connector.finished
