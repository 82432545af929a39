"""The KV-write audit is enforced: a start-up with a stray write yields no engine, ``warmup run``
exits 1, and ``audit_serving`` fails the serving step that writes outside its blocks (I2).

Faults are injected where real bugs would live: a warmup plan built without the drafter's
lookahead, or a scheduler that reserves no lookahead while the drafter writes ahead.
"""

from __future__ import annotations

import json
from functools import partial

import pytest
from typer.testing import CliRunner

import warmcap.warmup.hook
from warmcap.audit.kv_writes import AuditViolationError
from warmcap.cli import app as cli_app
from warmcap.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StartupOptions,
)
from warmcap.engine import LLMEngine
from warmcap.llm import LLM
from warmcap.sampling_params import SamplingParams
from warmcap.warmup.planner import plan_warmup

SPEC_METHODS = ["draft_model:2", "eagle:3", "eagle3:2", "mtp:2", "dflash:3", "ngram:3"]
PROMPTS = [[5, 9, 11, 3, 7, 2, 8, 13, 21, 34, 55, 89, 144, 233], [4, 4, 8, 15, 16, 23, 42] * 4]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _config(spec: str | None, **model) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu", **model),
        cache=CacheConfig(block_size=16, num_blocks=192),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=256),
        speculative=SpeculativeConfig.parse(spec),
    )


@pytest.fixture
def planner_without_lookahead(monkeypatch):
    """The warmup planner forgets the drafter's lookahead: its drafter passes write past the blocks."""
    monkeypatch.setattr(warmcap.warmup.hook, "plan_warmup", partial(plan_warmup, lookahead_override=0))


def test_llm_refuses_to_start_when_the_warmup_audit_finds_a_stray_write(planner_without_lookahead):
    with pytest.raises(AuditViolationError) as caught:
        LLM(
            "tiny-llama",
            device="cpu",
            enforce_eager=True,
            num_blocks=192,
            max_model_len=256,
            speculative_config="dflash:7",
        )
    message = str(caught.value)
    count = int(message.split("warmup audit found ")[1].split(" ")[0])
    assert count > 0
    # the first violation names its request, group, position, slot and block, then what to do
    for part in ("warmup-", "group draft.", "position ", "-> slot ", "(block ", "report it"):
        assert part in message, message
    assert "\n" not in message


def test_the_same_start_up_without_the_fault_is_clean():
    engine = LLMEngine(_config("dflash:7", enforce_eager=True))
    assert engine.warmup_result is not None and engine.warmup_result.audit.ok
    assert engine.warmup_result.audit.slots_checked > 0


def test_warmup_run_exits_1_on_one_line_and_still_writes_the_report(planner_without_lookahead, tmp_path):
    out = tmp_path / "report.json"
    args = ["run", "--model", "tiny-llama", "--spec", "dflash:7", "--num-blocks", "192"]
    args += ["--max-model-len", "256", "--capture-sizes", "1,2", "--out", str(out)]
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    fail = [line for line in result.output.splitlines() if "FAIL" in line]
    assert len(fail) == 1 and "stray KV write" in fail[0] and "group draft." in fail[0], result.output
    audit = json.loads(out.read_text())["warmup_audit"]
    assert audit["violations"] > 0 and audit["violation_samples"][0] in fail[0]


def _generate(engine: LLMEngine) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, [GREEDY] * len(PROMPTS))]


@pytest.mark.parametrize("spec", SPEC_METHODS)
def test_audited_serving_generates_exactly_what_unaudited_serving_does(spec):
    plain = LLMEngine(_config(spec), startup_hooks=[])
    audited = LLMEngine(_config(spec), startup=StartupOptions(audit_serving=True), startup_hooks=[])
    assert _generate(audited) == _generate(plain)
    totals = audited.serving_audit.totals
    assert totals.ok and totals.steps > 0 and totals.slots_checked > 0
    if not spec.startswith("ngram"):
        # the drafter's passes were audited too, not only the target's
        assert totals.passes > totals.steps * len(
            [g for g in audited.kv_groups if not g.name.startswith("draft.")]
        )
    # the log is cleared after each audited step, so memory stays bounded
    assert len(audited.runner.kv_write_log) == 0 and not audited.runner.kv_write_log.recording


def test_llm_audit_serving_covers_replayed_graphs_too():
    llm = LLM("tiny-llama", device="cpu", num_blocks=192, max_model_len=256, audit_serving=True)
    plain = LLM("tiny-llama", device="cpu", num_blocks=192, max_model_len=256)
    assert llm.engine.graph_startup is not None
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert llm.engine.serving_audit.totals.ok and llm.engine.serving_audit.totals.steps >= 20


def _drop_served_lookahead(allocate_slots):
    """Fault: a KV manager that forgets the lookahead for served requests (warmup's own requests,
    ``warmup-*``, still get it) while the scheduler still tells the runner the full lookahead, so
    dflash's drafts land up to 7 slots past the blocks a request holds."""

    def allocate(self, req, num_new_tokens, *args, num_lookahead_tokens=0, **kwargs):
        if not req.request_id.startswith("warmup-"):
            num_lookahead_tokens = 0
        return allocate_slots(
            self, req, num_new_tokens, *args, num_lookahead_tokens=num_lookahead_tokens, **kwargs
        )

    return allocate


def _drafter_writing_past_its_blocks(audit_serving: bool) -> LLMEngine:
    engine = LLMEngine(
        _config("dflash:7"), startup=StartupOptions(audit_serving=audit_serving), startup_hooks=[]
    )
    manager = engine.kv_cache_manager
    manager.allocate_slots = _drop_served_lookahead(type(manager).allocate_slots).__get__(manager)
    return engine


def test_a_drafter_writing_past_its_blocks_fails_the_serving_step_that_did_it():
    engine = _drafter_writing_past_its_blocks(audit_serving=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, GREEDY, request_id=f"r{i}")
    steps = 0
    with pytest.raises(AuditViolationError) as caught:
        while engine.has_unfinished():
            steps += 1
            engine.step()
    message = str(caught.value)
    # raised by the step that wrote, before its tokens reached anyone
    assert message.startswith(f"serving audit (step {steps}) found"), message
    first = message.split("stray KV write(s): ")[1]
    for part in (" r0 ", "group draft.", "position ", "-> slot ", "(block ", "is past the"):
        assert part in first.split(";")[0], message
    # the step's requests were aborted and their blocks freed; the engine stays usable
    pool = engine.kv_cache_manager.pool
    assert not engine.has_unfinished() and pool.num_free_blocks == pool.num_blocks - 1
    del engine.kv_cache_manager.allocate_slots  # the fault mended, the same engine serves correctly
    assert _generate(engine) == _generate(LLMEngine(_config("dflash:7"), startup_hooks=[]))


def test_without_audit_serving_the_same_fault_goes_unnoticed():
    outputs = _generate(_drafter_writing_past_its_blocks(audit_serving=False))
    assert [len(o) for o in outputs] == [GREEDY.max_tokens] * len(PROMPTS)


def test_generate_audit_serving_fails_the_faulty_step_with_one_line_exit_1(monkeypatch):
    from warmcap.core.kv_cache_manager import KVCacheManager

    # Fault: serving reserves no lookahead (warmup's plan still does), while dflash writes 7 ahead.
    monkeypatch.setattr(
        KVCacheManager, "allocate_slots", _drop_served_lookahead(KVCacheManager.allocate_slots)
    )
    args = ["generate", "--model", "tiny-llama", "--spec", "dflash:7", "--no-chat", "--max-tokens", "40"]
    result = CliRunner().invoke(cli_app, [*args, "--prompt", "a b c d e f g h i j k l", "--audit-serving"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "serving audit (step " in errors[0] and "group draft." in errors[0], (
        result.output
    )
