"""I4 for drafter graphs whose cache is not per-token attention KV: a Mamba draft LM (tiny-hybrid
drafting for itself) keeps one state per block, an MTP head on DeepSeek-V3 one latent per token.
Every drafter graph verifies on what its real rows wrote, generation through the graphs equals
``enforce_eager`` generation, and a replay whose writes are wrong or missing is caught."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.kv_spec import MambaSpec
from warmcap.drafters.base import DRAFT_DECODE, DRAFT_PREFILL
from warmcap.engine import LLMEngine
from warmcap.graphs.capture.capturer import CapturedGraph, GraphCapturer
from warmcap.graphs.hook import graph_capture_hook
from warmcap.graphs.proof.verify import GraphCheck, verify_graphs
from warmcap.runner_v2.kv_cache import KV_LAYOUTS
from warmcap.sampling_params import SamplingParams

SELF_DRAFT = "draft_model:2@self"
# Lengths cross the 16-token block and the 16-token step budget (chunked prefill, mixed steps).
PROMPTS = [[3 + (7 * i + j) % 90 for j in range(n)] for i, n in enumerate((7, 20, 3, 11))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _config(model: str, spec: str, *, mode: str = "none", eager: bool = False) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model, device="cpu", enforce_eager=eager),
        cache=CacheConfig(block_size=16, num_blocks=48, mamba_cache_mode=mode),
        scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=96),
        speculative=SpeculativeConfig.parse(spec),
    )


def _generate(engine: LLMEngine) -> tuple[list[list[int]], tuple[int, int]]:
    outputs = engine.generate(PROMPTS, [GREEDY] * len(PROMPTS))
    m = engine.spec_metrics
    return [o.token_ids for o in outputs], (m.num_draft_tokens, m.num_accepted_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "all", "align"])
def test_mamba_self_draft_graphs_verify_and_generate_like_eager(mode: str) -> None:
    expected = _generate(
        LLMEngine(_config("tiny-hybrid", SELF_DRAFT, mode=mode, eager=True), startup_hooks=[])
    )
    engine = LLMEngine(_config("tiny-hybrid", SELF_DRAFT, mode=mode), startup_hooks=[graph_capture_hook])
    startup = engine.graph_startup
    assert any(isinstance(g.spec, MambaSpec) for g in engine.runner.drafter.graph_groups())
    drafts = [g for g in startup.result.graphs if g.spec.subject == "drafter"]
    assert {g.spec.phase for g in drafts} == {DRAFT_PREFILL, DRAFT_DECODE}
    assert len(startup.checks) == len(startup.result.graphs)
    for check in startup.checks:
        assert check.verified, check
        assert check.max_abs_diff == 0.0 and check.greedy_match
        assert check.real_rows_max_abs_diff <= 1e-5

    # Same tokens, and the self-drafter still has every draft accepted (I5).
    got = _generate(engine)
    assert got == expected
    drafted, accepted = got[1]
    assert drafted > 0 and accepted == drafted
    runner = startup.graph_runner
    for phase in (DRAFT_PREFILL, DRAFT_DECODE):
        assert sum(n for (p, _), n in runner.draft_replays.items() if p == phase) > 0, phase


# ---- a replay that writes the wrong thing, or nothing, must not verify ------------------------

Tamper = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def _corrupt(cache: torch.Tensor, before: torch.Tensor, written: torch.Tensor) -> None:
    cache[written] += 1.0


def _unwrite(cache: torch.Tensor, before: torch.Tensor, written: torch.Tensor) -> None:
    cache[written] = before[written]


def _tampered(
    graph: CapturedGraph, caches: list[tuple[torch.Tensor, int]], tamper: Tamper, seen: list[int]
) -> Callable[[], None]:
    """``graph``'s replay, then ``tamper`` on every entry of ``caches`` (tensor, block dim) that the
    replay changed outside the PAD sink; ``seen`` collects how many entries each replay changed."""
    honest = graph.replay_fn

    def replay() -> None:
        befores = [cache.clone() for cache, _ in caches]
        honest()
        changed = 0
        for (cache, dim), before in zip(caches, befores, strict=True):
            written = cache != before
            written.narrow(dim, cache.shape[dim] - 1, 1).fill_(False)
            changed += int(written.sum())
            tamper(cache, before, written)
        seen.append(changed)

    return replay


def _draft_checks(
    engine: LLMEngine, kinds: set[str], tamper: Tamper | None, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[GraphCheck], list[int]]:
    """Capture the engine's graphs (two small ladder sizes) and verify the drafter's, with
    ``tamper`` applied after each replay to the drafter layers of spec ``kinds``."""
    runner = engine.runner
    capturer = GraphCapturer(runner, "static", capture_sizes=[4, 8])
    graphs = [g for g in capturer.capture().graphs if g.spec.subject == "drafter"]
    caches = [
        (runner.kv_caches.tensors[layer], KV_LAYOUTS[g.spec.kind].block_dim)
        for g in runner.drafter.graph_groups()
        if g.spec.kind in kinds
        for layer in g.layer_names
    ]
    assert graphs and caches
    seen: list[int] = []
    if tamper is not None:
        for graph in graphs:
            monkeypatch.setattr(graph, "replay_fn", _tampered(graph, caches, tamper, seen))
    return verify_graphs(capturer, graphs, engine.kv_cache_manager), seen


@pytest.fixture(scope="module")
def hybrid() -> LLMEngine:
    return LLMEngine(_config("tiny-hybrid", SELF_DRAFT, mode="align"), startup_hooks=[])


@pytest.mark.parametrize("tamper", [None, _corrupt, _unwrite], ids=["honest", "corrupt", "unwritten"])
def test_mamba_state_written_by_real_rows_is_compared(
    hybrid: LLMEngine, tamper: Tamper | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks, seen = _draft_checks(hybrid, {"mamba"}, tamper, monkeypatch)
    if tamper is None:
        assert all(c.verified for c in checks), [c for c in checks if not c.verified]
        return
    # Every replay wrote some real row's state, which was then spoiled or undone after the fact.
    assert len(seen) == len(checks) and all(n > 0 for n in seen)
    for check in checks:
        # The outputs still replay exactly: only the state comparison can catch it.
        assert check.max_abs_diff == 0.0 and check.greedy_match
        assert not check.verified and check.real_rows_max_abs_diff > 1e-3, check


def test_latent_slots_written_by_real_rows_are_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    """An MTP head on DeepSeek-V3 writes one MLA latent per token (``[blocks, block_size, D]``)."""
    engine = LLMEngine(_config("tiny-deepseek-v3", "mtp:2"), startup_hooks=[])
    checks, seen = _draft_checks(engine, {"mla"}, _corrupt, monkeypatch)
    assert len(seen) == len(checks) and all(n > 0 for n in seen)
    for check in checks:
        assert check.max_abs_diff == 0.0
        assert not check.verified and check.real_rows_max_abs_diff > 1e-3, check
