"""Per-step model state plugs into the runner as state handlers: an attention-only model has none, a
hybrid has its Mamba handler, and the step drives whatever handlers there are through the contract."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from test_model_runner import PROMPTS, _setup

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from warmcap.contracts import AttentionMetadata, StateHandler
from warmcap.core.kv_spec import MambaSpec
from warmcap.engine import LLMEngine
from warmcap.runner_v2.mamba_state import MambaStates
from warmcap.sampling_params import SamplingParams


class RecordingHandler:
    """A handler of no group that notes every call the runner makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def handles(self, group: str) -> bool:
        return False

    def forget(self, req_ids: Iterable[str]) -> None:
        self.calls.append(("forget", set(req_ids)))

    def begin_step(
        self, req_ids: Sequence[str], block_tables: Mapping[str, torch.Tensor], num_drafts: Sequence[int]
    ) -> None:
        self.calls.append(("begin_step", list(req_ids)))

    def metadata(
        self, metas: dict[str, AttentionMetadata], *, static: bool = False
    ) -> dict[str, AttentionMetadata]:
        self.calls.append(("metadata", static))
        return metas

    def finish_step(
        self, req_ids: Sequence[str], seq_lens: Sequence[int], sampled: Sequence[Sequence[int]]
    ) -> None:
        self.calls.append(("finish_step", [len(s) for s in sampled]))

    def write_slots(self, group: str, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("write_slots of a handler that handles no group")


def test_an_attention_only_runner_has_no_state_handlers() -> None:
    _, runner, _ = _setup()
    assert runner.state_handlers == []
    assert runner.mamba_states is None


def test_the_step_drives_each_handler_at_its_points() -> None:
    _, runner, sched = _setup(budget=32)
    handler = RecordingHandler()
    handler_type_check: StateHandler = handler
    runner.state_handlers.append(handler_type_check)
    sched.add("a", PROMPTS["a"], SamplingParams(temperature=0.0, max_tokens=2))
    with runner.recording_kv_writes(True):
        while sched.reqs:
            out = sched.schedule()
            sched.update(out, runner.execute_model(out))
        runner.execute_model(sched.schedule())  # delivers the finish
    names = [name for name, _ in handler.calls]
    # prefill step, decode step, then the empty step that only forgets the finished request
    assert names == ["forget", "begin_step", "metadata", "finish_step"] * 2 + ["forget"]
    assert handler.calls[1] == ("begin_step", ["a"])
    assert handler.calls[3] == ("finish_step", [1])
    assert handler.calls[-1] == ("forget", {"a"})
    assert runner.kv_write_log.records


def test_a_hybrid_runner_has_one_mamba_handler_for_its_mamba_groups() -> None:
    config = EngineConfig(
        model=ModelConfig(model="tiny-hybrid", dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=48),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64),
    )
    runner = LLMEngine(config, startup_hooks=[]).runner
    (handler,) = runner.state_handlers
    assert isinstance(handler, MambaStates) and runner.mamba_states is handler
    mamba_groups = {g.name for g in runner.kv_groups if isinstance(g.spec, MambaSpec)}
    assert mamba_groups
    assert {g.name for g in runner.kv_groups if handler.handles(g.name)} == mamba_groups
