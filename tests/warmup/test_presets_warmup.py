"""Warmup on the MLA, sparse-MLA and Mamba-hybrid presets: plans hold exactly the rule's blocks in
every group (Mamba: + k state blocks; align: no lookahead), warmup writes only held blocks (latent,
indexer and Mamba state included), every captured graph verifies, and start-up leaves no trace."""

from __future__ import annotations

from dataclasses import replace

import pytest

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.kv_spec import MambaSpec
from warmcap.core.reservation import blocks_covering, reserved_blocks
from warmcap.drafters import build_drafter
from warmcap.engine import LLMEngine
from warmcap.kv_layout import build_kv_groups, meta_model
from warmcap.models.presets import resolve_model
from warmcap.sampling_params import SamplingParams
from warmcap.warmup.hook import warmup_hook
from warmcap.warmup.planner import plan_warmup
from warmcap.warmup.run import run_warmup

MAX_MODEL_LEN = 64
PLAN_CASES = [
    ("tiny-deepseek-v3", "none", None),
    ("tiny-deepseek-v3", "none", "mtp:2"),
    ("tiny-deepseek-v32", "none", "eagle:1"),
    *[
        ("tiny-hybrid", mode, spec)
        for mode in ("none", "all", "align")
        for spec in (None, "ngram:2", "draft_model:3")
    ],
]


def _config(model: str, mode: str, spec: str | None, *, enforce_eager: bool = False) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model, device="cpu", enforce_eager=enforce_eager),
        cache=CacheConfig(block_size=16, num_blocks=64, mamba_cache_mode=mode),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=MAX_MODEL_LEN),
        speculative=SpeculativeConfig.parse(spec),
    )


def _expected_mamba(spec: MambaSpec, num_tokens: int, lookahead: int, k: int) -> int:
    """The Mamba rows of the reservation table (docs/warmup.md), written out per mode."""
    if spec.cache_mode == "align":
        return int(blocks_covering(num_tokens, spec.block_size)) + k
    return int(blocks_covering(min(num_tokens + lookahead, MAX_MODEL_LEN), spec.block_size)) + k


@pytest.mark.parametrize(("model", "mode", "spec"), PLAN_CASES)
def test_plan_holds_the_rules_blocks_in_every_group(model: str, mode: str, spec: str | None) -> None:
    config = _config(model, mode, spec)
    meta, _ = meta_model(resolve_model(model, config_only=True), config)
    groups = build_kv_groups(meta, config, build_drafter(config, meta))
    plan = plan_warmup(config, groups, 64)
    k, lookahead = config.num_speculative_tokens, config.num_lookahead_tokens
    kinds = {g.spec.kind for g in groups}
    assert ("mamba" in kinds) == (model == "tiny-hybrid")
    assert ("indexer" in kinds) == (model == "tiny-deepseek-v32")
    assert plan.steps and any(r.num_spec_tokens for s in plan.steps for r in s.requests) == (k > 0)
    for step in plan.steps:
        for r in step.requests:
            n = r.num_computed_tokens + r.num_scheduled_tokens
            for g in groups:
                held = len(r.blocks[g.name])
                rule = reserved_blocks(
                    g.spec, n, num_lookahead_tokens=r.num_lookahead_tokens, max_model_len=MAX_MODEL_LEN
                )
                assert held == rule, f"{step.name} {r.req_id} {g.name}: {held} != {rule}"
                if isinstance(g.spec, MambaSpec):
                    assert held == _expected_mamba(g.spec, n, lookahead, k)
                    if mode == "none":
                        assert held == 1 + k  # one block spans max_model_len
    mamba_json = [g for g in plan.to_json()["kv_groups"] if g["kind"] == "mamba"]
    assert all(g["cache_mode"] == mode for g in mamba_json)


def _generate(engine: LLMEngine) -> list[list[int]]:
    prompts = [[(7 * i + 3) % 500 + 3 for i in range(n)] for n in (5, 19, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, [params] * len(prompts))]


STARTUP_CASES = [
    ("tiny-deepseek-v3", "none", "mtp:2"),
    ("tiny-deepseek-v32", "none", None),
    ("tiny-hybrid", "none", "ngram:2"),
    ("tiny-hybrid", "all", "eagle:2"),
    ("tiny-hybrid", "align", "ngram:3"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "mode", "spec"), STARTUP_CASES)
def test_default_startup_audits_clean_verifies_every_graph_and_leaves_no_trace(
    model: str, mode: str, spec: str | None
) -> None:
    engine = LLMEngine(_config(model, mode, spec))
    audit = engine.warmup_result.audit
    assert audit.ok and audit.slots_checked > 0, [str(v) for v in audit.violations[:5]]
    checks = engine.graph_startup.checks
    assert checks and all(c.verified for c in checks), [c for c in checks if not c.verified]
    assert _generate(engine) == _generate(LLMEngine(_config(model, mode, spec), startup_hooks=[]))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "align"])
def test_warmup_with_a_mamba_draft_model_audits_its_state_writes(mode: str) -> None:
    config = _config("tiny-hybrid", mode, "draft_model:2@self", enforce_eager=True)
    engine = LLMEngine(config, startup_hooks=[warmup_hook])
    audit = engine.warmup_result.audit
    assert audit.ok and audit.slots_checked > 0, [str(v) for v in audit.violations[:5]]
    assert _generate(engine) == _generate(LLMEngine(config, startup_hooks=[]))


def test_a_plan_without_the_speculative_state_blocks_is_caught() -> None:
    """A planner that forgets Mamba's + k blocks: verify steps write draft states past them."""
    engine = LLMEngine(_config("tiny-hybrid", "none", "ngram:2"), startup_hooks=[])
    forgetful = [
        replace(g, spec=replace(g.spec, num_speculative_blocks=0)) if isinstance(g.spec, MambaSpec) else g
        for g in engine.kv_groups
    ]
    plan = plan_warmup(engine.config, forgetful, engine.num_blocks)
    result = run_warmup(engine.runner, engine.kv_cache_manager, plan, audit=True)
    mamba = [v for v in result.audit.violations if v.group == "mamba"]
    assert mamba and all("past the 1 block" in v.reason for v in mamba), result.audit.violations[:3]
