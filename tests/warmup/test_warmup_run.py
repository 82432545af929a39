"""Executing warmup plans on real (tiny) engines: audit clean, audit able to fail, no trace (I2, I3)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.engine import LLMEngine
from warmcap.graphs.proof.report import CaptureReport, report_schema
from warmcap.sampling_params import SamplingParams
from warmcap.startup import run_startup
from warmcap.warmup.hook import warmup_hook
from warmcap.warmup.planner import plan_warmup
from warmcap.warmup.run import BatchSnapshot, run_warmup

KV_METHODS = ["draft_model:2", "eagle:3", "eagle3:2", "mtp:2", "dflash:3", "ngram:3", None]


def _config(spec: str | None, model: str = "tiny-llama", **sched) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model, device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=192),
        scheduler=SchedulerConfig(
            max_num_seqs=sched.get("max_num_seqs", 4), max_num_batched_tokens=128, max_model_len=256
        ),
        speculative=SpeculativeConfig.parse(spec),
    )


def _engine(spec: str | None, **kw) -> LLMEngine:
    return LLMEngine(_config(spec, **kw), startup_hooks=[])


@pytest.mark.parametrize("spec", KV_METHODS)
def test_warmup_on_each_drafter_writes_only_owned_blocks(spec):
    engine = _engine(spec)
    result = warmup_hook(engine.startup_context, audit=True, strict=True)
    assert result.audit.ok, [str(v) for v in result.audit.violations[:5]]
    assert result.audit.slots_checked > 0
    if spec and not spec.startswith("ngram"):
        # the drafter's own passes were audited too, not only the target's
        assert result.num_passes > len(result.plan.steps) * len(engine.kv_groups)


@pytest.mark.parametrize("spec", ["dflash:7", "eagle:8"])
def test_a_plan_built_without_lookahead_is_caught_by_the_audit(spec):
    engine = _engine(spec)
    broken = plan_warmup(engine.config, engine.kv_groups, engine.num_blocks, lookahead_override=0)
    result = run_warmup(engine.runner, engine.kv_cache_manager, broken, audit=True)
    assert not result.audit.ok
    v = result.audit.violations[0]
    assert v.phase.startswith("draft"), str(v)
    assert "past the" in v.reason or "null block" in v.reason
    # and the same engine with the correct plan is clean
    good = plan_warmup(engine.config, engine.kv_groups, engine.num_blocks)
    assert run_warmup(engine.runner, engine.kv_cache_manager, good, audit=True).audit.ok


def _snapshot(engine: LLMEngine):
    return (
        engine.kv_cache_manager.pool.snapshot(),
        BatchSnapshot.of(engine.runner),
        {name: t.clone() for name, t in engine.runner.kv_caches.tensors.items()},
    )


def _kv_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


PROMPTS = [[5, 9, 11, 3, 7, 2, 8, 13, 21, 34, 55, 89, 144 % 500, 233, 377, 10, 20], [4, 4, 8, 15, 16, 23, 42]]


def _generate(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [o.token_ids for o in engine.generate(PROMPTS, [params] * len(PROMPTS))]


@pytest.mark.parametrize("spec", ["eagle:3", "dflash:3", None])
def test_warmup_leaves_no_trace_even_when_used_blocks_hold_garbage(spec):
    fresh = _generate(_engine(spec))

    engine = _engine(spec)
    pool0, batch0, kv0 = _snapshot(engine)

    def dirty(runner, used):
        ids = torch.tensor(used)
        for t in runner.kv_caches.tensors.values():
            dim = 1 if t.dim() == 5 else 0
            t.index_fill_(dim, ids, float("nan"))

    plan = plan_warmup(engine.config, engine.kv_groups, engine.num_blocks)
    run_warmup(engine.runner, engine.kv_cache_manager, plan, before_scrub=dirty)
    pool1, batch1, kv1 = _snapshot(engine)
    assert pool0.differences(pool1) == []
    assert batch0 == batch1
    assert _kv_equal(kv0, kv1)
    assert _generate(engine) == fresh


def test_nan_left_in_warmup_blocks_changes_nothing_even_unscrubbed():
    """NaN left in warmup blocks sits in the masked tails of later requests' last blocks. Attention
    never multiplies an unread position by a zero weight (runner_v2/attention/torch_paged.py), so
    generation equals a fresh engine's with the scrub and without it: the scrub is hygiene, and a
    masked tail that leaked (0 * NaN is NaN) would fail this test."""
    from warmcap.warmup import run as run_mod

    fresh = _generate(_engine("eagle:3"))
    engine = _engine("eagle:3")
    plan = plan_warmup(engine.config, engine.kv_groups, engine.num_blocks)

    def dirty(runner, used):
        for t in runner.kv_caches.tensors.values():
            t.index_fill_(1 if t.dim() == 5 else 0, torch.tensor(used), float("nan"))

    original = run_mod.scrub
    run_mod.scrub = lambda runner, used: None
    try:
        run_warmup(engine.runner, engine.kv_cache_manager, plan, before_scrub=dirty)
    finally:
        run_mod.scrub = original
    assert any(t.isnan().any() for t in engine.runner.kv_caches.tensors.values())
    assert _generate(engine) == fresh
    engine_scrubbed = _engine("eagle:3")
    run_warmup(engine_scrubbed.runner, engine_scrubbed.kv_cache_manager, plan, before_scrub=dirty)
    assert _generate(engine_scrubbed) == fresh


def test_warmup_run_with_enforce_eager_reports_that_no_graph_was_captured():
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu", enforce_eager=True),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128),
    )
    run = run_startup(config, smoke_tokens=4, num_smoke_prompts=1)
    report = run.report
    assert report.backend == "eager" and report.graphs == [] and run.engine.runner.graphs is None
    assert any("not captured" in note for note in report.notes)
    assert report.warmup_audit.violations == 0 and report.warmup_audit.slots_checked > 0
    assert not run.failed_verification and len(run.smoke_texts) == 1
    data = json.loads(report.to_json())
    jsonschema.validate(data, report_schema(), cls=jsonschema.Draft202012Validator)
    assert CaptureReport.from_dict(data).backend == "eager"


def test_warmup_run_reports_prefix_caching_off_on_a_hybrid_in_one_note():
    config = EngineConfig(
        model=ModelConfig(model="tiny-hybrid", device="cpu", dtype="float32", enforce_eager=True),
        cache=CacheConfig(block_size=16, num_blocks=64, mamba_cache_mode="align"),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128),
    )
    run = run_startup(config, smoke_tokens=4, num_smoke_prompts=1)
    notes = [n for n in run.report.notes if "prefix caching" in n]
    assert len(notes) == 1 and "cache mode 'align'" in notes[0] and "\n" not in notes[0]
    assert not run.engine.kv_cache_manager.enable_caching


@pytest.mark.parametrize(("spec", "max_model_len"), [(None, 10), ("eagle:3", 16)])
def test_a_warmup_request_ending_at_max_model_len_hands_its_seat_and_blocks_on_cleanly(spec, max_model_len):
    """With a short context a warmup request reaches max_model_len and ends as in serving: the next
    step names it finished and its blocks go to a later request. The runner drops its row, the
    audit finds every write in owned blocks, and the engine is left as it was."""
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model="tiny-llama", device="cpu"),
            cache=CacheConfig(block_size=8, num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=max_model_len),
            speculative=SpeculativeConfig.parse(spec),
        ),
        startup_hooks=[],
    )
    pool0, batch0, kv0 = _snapshot(engine)
    plan = plan_warmup(engine.config, engine.kv_groups, engine.num_blocks)
    ends = [i for i, s in enumerate(plan.steps) if s.scheduler_output.finished_req_ids]
    assert ends, "the plan should end a request at max_model_len"
    gone = plan.steps[ends[0]].scheduler_output.finished_req_ids
    reused = {
        b for s in plan.steps[: ends[0]] for r in s.requests if r.req_id in gone for b in r.blocks["full"]
    }
    later = {b for s in plan.steps[ends[0] :] for r in s.requests for b in r.blocks["full"]}
    assert reused & later
    result = run_warmup(engine.runner, engine.kv_cache_manager, plan, audit=True)
    assert result.audit.ok, [str(v) for v in result.audit.violations[:5]]
    pool1, batch1, kv1 = _snapshot(engine)
    assert pool0.differences(pool1) == []
    assert batch0 == batch1
    assert _kv_equal(kv0, kv1)
