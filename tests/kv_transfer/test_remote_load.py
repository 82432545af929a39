"""A P/D consumer's request whose prompt KV is loaded from outside: it waits, with no forward, until
its blocks have arrived, then runs with the full lookahead. No drafter pass ever writes outside the
blocks the request holds (the reference engine's second seed bug: a loading step that reserved no
lookahead still drafted, writing past the request's blocks into the null block 0)."""

from __future__ import annotations

import random

import pytest

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.request import RequestStatus
from warmcap.engine import LLMEngine
from warmcap.errors import ConfigError
from warmcap.sampling_params import SamplingParams

BLOCK_SIZE = 16


def _consumer(spec: str) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
        speculative=SpeculativeConfig.parse(spec),
        kv_role="consumer",
    )
    return LLMEngine(config, startup_hooks=[])


def _strays(engine: LLMEngine, held: list[dict[str, dict[str, list[int]]]]) -> list[tuple]:
    """(phase, group, request, position, slot) of every recorded write outside the blocks the
    manager held for that request at that step (block 0 is never a request's own)."""
    strays = []
    for rec in engine.runner.kv_write_log.records:
        slots, positions = rec.slot_mapping.numpy(), rec.positions.numpy()
        for i, req_id in enumerate(rec.req_ids):
            own = set(held[rec.step - 1][req_id][rec.group])
            for t in range(rec.query_start_loc[i], rec.query_start_loc[i + 1]):
                block = int(slots[t]) // BLOCK_SIZE
                if slots[t] >= 0 and (block == 0 or block not in own):
                    strays.append((rec.phase, rec.group, req_id, int(positions[t]), int(slots[t])))
    return strays


@pytest.mark.parametrize("spec", ["eagle:3", "dflash:3", "draft_model:2"])
def test_a_loading_request_waits_then_drafts_only_inside_its_blocks(spec: str) -> None:
    engine = _consumer(spec)
    held: list[dict[str, dict[str, list[int]]]] = []

    def snapshotting(execute):
        def snapshot_then_execute(sched_out):
            # The blocks each request holds when its step runs: what the audit checks writes against.
            held.append({r: engine.kv_cache_manager.get_block_ids(r) for r in engine.scheduler.requests})
            return execute(sched_out)

        return snapshot_then_execute

    # The test drives the runner itself (execute_model), then the engine (execute_model_result).
    runner = engine.runner
    runner.execute_model = snapshotting(runner.execute_model)
    runner.execute_model_result = snapshotting(runner.execute_model_result)
    rng = random.Random(0)
    # 32 prompt tokens, 31 of them loaded: the one computed token sits at the end of block 1, so any
    # draft write lands past the request's blocks unless the lookahead was reserved.
    prompt = [rng.randrange(3, 512) for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with engine.runner.recording_kv_writes(True):
        engine.add_request({"prompt_token_ids": prompt}, params, "remote", num_external_computed_tokens=31)
        engine.add_request({"prompt_token_ids": prompt[:20]}, params, "local")
        first = engine.scheduler.schedule()
        # The loading request holds blocks for its loaded tokens but runs no forward this step.
        assert "remote" not in first.num_scheduled_tokens and "local" in first.num_scheduled_tokens
        assert engine.scheduler.requests["remote"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
        assert engine.kv_cache_manager.get_block_ids("remote")["full"][:2] != [0, 0]
        outputs = engine.runner.execute_model(first)
        assert "remote" in outputs.finished_recving
        engine.scheduler.update_from_output(first, outputs)
        second = engine.scheduler.schedule()
        # Arrived: scheduled like any request, from its loaded tokens, with the full lookahead.
        (new,) = second.scheduled_new_reqs
        assert (new.req_id, new.num_computed_tokens, second.num_scheduled_tokens["remote"]) == (
            "remote",
            31,
            1,
        )
        assert second.num_lookahead_tokens["remote"] == engine.config.num_lookahead_tokens > 0
        engine.scheduler.update_from_output(second, engine.runner.execute_model(second))
        while engine.has_unfinished():
            engine.step()
    assert _strays(engine, held) == []
    draft_phases = {rec.phase for rec in engine.runner.kv_write_log.records if rec.phase != "target"}
    assert draft_phases, "the drafter ran after the load"
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.num_blocks - 1


def test_a_step_that_reserved_no_lookahead_drafts_nothing() -> None:
    engine = _consumer("eagle:3")
    engine.add_request({"prompt_token_ids": list(range(3, 35))}, SamplingParams(max_tokens=4), "a")
    out = engine.scheduler.schedule()
    out.num_lookahead_tokens = dict.fromkeys(out.num_lookahead_tokens, 0)
    with engine.runner.recording_kv_writes(True):
        result = engine.runner.execute_model(out)
    assert result.draft_token_ids == {}
    assert {rec.phase for rec in engine.runner.kv_write_log.records} == {"target"}


def test_a_drafting_step_with_a_request_short_of_lookahead_is_refused() -> None:
    engine = _consumer("eagle:3")
    for name in ("a", "b"):
        engine.add_request({"prompt_token_ids": list(range(3, 20))}, SamplingParams(max_tokens=4), name)
    out = engine.scheduler.schedule()
    out.num_lookahead_tokens["b"] = 0
    with pytest.raises(RuntimeError, match=r"\['b'\] reserved less than the drafter's lookahead 3"):
        engine.runner.execute_model(out)


def test_add_request_refuses_external_tokens_covering_the_whole_prompt() -> None:
    engine = _consumer("eagle:3")
    with pytest.raises(ConfigError, match=r"num_external_computed_tokens 5 is outside 0\.\.4"):
        engine.add_request({"prompt_token_ids": [3, 4, 5, 6, 7]}, num_external_computed_tokens=5)
    assert not engine.has_unfinished()


class _SlowLoads:
    """A worker connector whose loads finish only when the test says so."""

    def __init__(self) -> None:
        self.tensors: dict | None = None
        self.metadata: list[object] = []
        self.done: set[str] = set()
        self.saves = 0

    def register_kv_caches(self, kv_caches: dict) -> None:
        self.tensors = kv_caches

    def start_load_kv(self, metadata: object) -> None:
        self.metadata.append(metadata)

    def wait_for_save(self) -> None:
        self.saves += 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done, self.done = self.done, set()
        return set(), done

    def get_load_errors(self) -> dict[str, str]:
        return {}


def test_a_load_in_flight_keeps_the_request_parked_until_the_worker_reports_it() -> None:
    engine = _consumer("eagle:3")
    worker = _SlowLoads()
    engine.runner.attach_kv_connector(worker)
    assert worker.tensors is engine.runner.kv_caches.tensors
    engine.add_request(
        {"prompt_token_ids": list(range(3, 35))},
        SamplingParams(max_tokens=3),
        "a",
        num_external_computed_tokens=31,
    )
    for _ in range(3):
        assert engine.step() == []
        assert engine.scheduler.requests["a"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    worker.done.add("a")
    engine.step()  # the report arrives with this step's output
    outputs = engine.step()  # scheduled from its loaded tokens: the first token comes out
    assert [o.request_id for o in outputs] == ["a"] and len(outputs[0].outputs[0].token_ids) >= 1
    assert len(worker.metadata) == 5 and worker.saves == 1
