"""Serving through captured graphs in the real engine: target graphs and every drafter's graphs are
captured at start-up (default hooks), verify (I4), are replayed, and generation is token-identical
to ``enforce_eager`` generation with the same drafter."""

from __future__ import annotations

from functools import partial

import pytest

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.drafters.base import DRAFT_DECODE, DRAFT_PREFILL
from warmcap.engine import LLMEngine
from warmcap.graphs.hook import graph_capture_hook
from warmcap.sampling_params import SamplingParams
from warmcap.warmup.planner import plan_warmup
from warmcap.warmup.run import run_warmup

# Lengths cross the 16-token block and the 16-token step budget (chunked prefill, mixed steps).
PROMPTS = [[3 + (7 * i + j) % 90 for j in range(n)] for i, n in enumerate((7, 20, 3, 11))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SPECS = [None, "ngram:2", "draft_model:2", "eagle:2", "eagle3:2", "mtp:2", "dflash:2"]


def _config(
    spec: str | None,
    *,
    eager: bool,
    model: str = "tiny-llama",
    max_model_len: int = 96,
    max_num_seqs: int = 3,
    budget: int = 16,
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model, device="cpu", enforce_eager=eager),
        cache=CacheConfig(block_size=16, num_blocks=48),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len
        ),
        speculative=SpeculativeConfig.parse(spec),
    )


def _generate(engine: LLMEngine, prompts: list) -> tuple[list[list[int]], tuple[int, int]]:
    outputs = engine.generate(prompts, [GREEDY] * len(prompts))
    m = engine.spec_metrics
    return [o.token_ids for o in outputs], (m.num_draft_tokens, m.num_accepted_tokens)


def _check_startup(engine: LLMEngine, *, real_rows: float = 1e-5) -> None:
    startup = engine.graph_startup
    graphs = startup.result.graphs
    # Every captured graph, target and drafter, verifies (I4).
    assert len(startup.checks) == len(graphs) > 0
    for check in startup.checks:
        assert check.verified, check
        assert check.max_abs_diff == 0.0 and check.greedy_match
        assert check.real_rows_max_abs_diff <= real_rows
    # All eager passes first, then capture: target graphs largest first, then drafter graphs.
    order = startup.result.order
    n = len(graphs)
    assert [stage for stage, _ in order] == ["eager"] * n + ["capture"] * n
    assert [label for _, label in order[n:]] == [g.spec.label for g in graphs]
    drafts = [g.spec.subject == "drafter" for g in graphs]
    assert drafts == sorted(drafts)
    for part in (
        [g for g in graphs if g.spec.subject == "target"],
        [g for g in graphs if g.spec.subject == "drafter"],
    ):
        sizes = [g.spec.num_tokens for g in part]
        assert sizes == sorted(sizes, reverse=True)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_generation_through_graphs_equals_eager(spec: str | None) -> None:
    # Warmup is token-neutral (I3, tested in tests/warmup): the eager reference skips it for time.
    eager = LLMEngine(_config(spec, eager=True), startup_hooks=[])
    assert eager.runner.graphs is None
    expected = _generate(eager, PROMPTS)

    engine = LLMEngine(_config(spec, eager=False))
    _check_startup(engine)
    # Same tokens, and the same drafts were proposed and accepted.
    assert _generate(engine, PROMPTS) == expected

    runner = engine.graph_startup.graph_runner
    assert runner is engine.runner.graphs
    assert sum(runner.replays.values()) > 0
    if spec is None or not spec.startswith("ngram"):
        # Every decode step carries exactly k drafts (ngram proposes only on a match).
        q = 1 + (engine.config.num_speculative_tokens if spec else 0)
        assert sum(n for d, n in runner.replays.items() if d.uniform_query_len == q) > 0
    phases = {g.spec.phase for g in engine.graph_startup.result.graphs if g.spec.subject == "drafter"}
    if spec is None or spec.startswith("ngram"):
        assert phases == set() and not runner.draft_replays
    else:
        assert phases == {DRAFT_PREFILL, DRAFT_DECODE}
        for phase in phases:
            assert sum(n for (p, _), n in runner.draft_replays.items() if p == phase) > 0, phase


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["eagle3:2", "dflash:2"])
def test_warmup_through_graphs_audits_drafter_passes_clean(spec: str) -> None:
    """Warmup run again after capture goes through target and drafter graphs; every padded pass
    is logged and the audit (I2) is clean."""
    engine = LLMEngine(_config(spec, eager=False))
    runner = engine.graph_startup.graph_runner
    before = sum(runner.draft_replays.values()), sum(runner.replays.values())
    phases: set[str] = set()
    execute = engine.runner.execute_model

    def spy(out):
        result = execute(out)
        phases.update(r.phase for r in engine.runner.kv_write_log.records)
        return result

    engine.runner.execute_model = spy
    plan = plan_warmup(engine.config, engine.kv_groups, engine.num_blocks)
    result = run_warmup(engine.runner, engine.kv_cache_manager, plan, audit=True)
    assert result.audit.ok, result.audit.violations[:3]
    assert sum(runner.draft_replays.values()) > before[0] and sum(runner.replays.values()) > before[1]
    assert {
        "target",
        DRAFT_PREFILL,
        "draft_step_0" if spec.startswith("dflash") else "draft_step_1",
    } <= phases


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_draft_model_graphs_verify_and_generate_like_eager() -> None:
    """The ``warmup run`` default drafter on the real checkpoint; few sizes keep it short."""
    spec = "draft_model:2"
    prompts = [[504, 3575, 282, 4649, 314], [19842, 940, 429, 28, 2143, 3789, 4140, 28, 2143, 3789]]
    small = {"model": "smollm2-135m", "max_model_len": 48, "max_num_seqs": 2, "budget": 8}
    eager = LLMEngine(_config(spec, eager=True, **small), startup_hooks=[])
    expected = _generate(eager, prompts)
    engine = LLMEngine(
        _config(spec, eager=False, **small), startup_hooks=[partial(graph_capture_hook, capture_sizes=[8])]
    )
    # Hidden states of magnitude ~40 through 30 layers: the default relative tolerance (1e-4) applies.
    _check_startup(engine, real_rows=1e-3)
    phases = {g.spec.phase for g in engine.graph_startup.result.graphs}
    assert phases == {"decode", "mixed", DRAFT_PREFILL, DRAFT_DECODE}
    assert _generate(engine, prompts) == expected
    runner = engine.graph_startup.graph_runner
    assert sum(runner.replays.values()) > 0 and sum(runner.draft_replays.values()) > 0
