"""I4 for target graphs judges what the real rows wrote as well as what they output: the KV at the
real tokens' slots and, on a hybrid, the Mamba state at the real rows' write blocks. A replay that
corrupts, skips or misplaces those writes must not verify, while every graph of the presets' engines
(target and drafter) still does."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch
from graph_fixtures import make_rig

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.engine import LLMEngine
from warmcap.graphs.capture.capturer import CapturedGraph, GraphCapturer
from warmcap.graphs.proof import verify
from warmcap.graphs.proof.verify import GraphCheck, Tolerance, failed_bounds, verify_graphs
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention
from warmcap.runner_v2.mamba_state import MambaMetadata

if TYPE_CHECKING:
    from warmcap.contracts import AttentionMetadata


def _engine(model: str, spec: str | None = None, *, mode: str = "none") -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=model, device="cpu"),
            cache=CacheConfig(block_size=16, num_blocks=48, mamba_cache_mode=mode),
            scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=96),
            speculative=SpeculativeConfig.parse(spec),
        ),
        startup_hooks=[],
    )


def _capture(engine: LLMEngine, *, drafter_graphs: bool = False) -> tuple[GraphCapturer, list[CapturedGraph]]:
    """Graphs of two small ladder sizes (``static`` backend)."""
    capturer = GraphCapturer(engine.runner, "static", capture_sizes=[4, 8], drafter_graphs=drafter_graphs)
    return capturer, capturer.capture().graphs


@pytest.fixture(scope="module")
def hybrid() -> LLMEngine:
    # Mode none: a row keeps one committed state, so it writes the very block it reads.
    return _engine("tiny-hybrid")


@pytest.fixture(scope="module")
def llama() -> LLMEngine:
    return _engine("tiny-llama")


def _spoil_after_replay(engine: LLMEngine, graph: CapturedGraph, kind: str, seen: list[int]) -> None:
    """Make ``graph``'s replay add 1 to what its real rows wrote in the target's ``kind`` layers
    (the slots or state blocks its own metadata names for them); ``seen`` collects how many
    slots or blocks each replay spoiled."""
    runner = engine.runner
    honest = graph.replay_fn

    def replay() -> None:
        honest()
        spoiled = 0
        for group in runner.kv_groups:
            if group.spec.kind != kind or group.is_drafter:
                continue
            meta = graph.metas[group.name]
            for layer in group.layer_names:
                cache = runner.kv_caches.tensors[layer]
                if isinstance(meta, MambaMetadata):
                    blocks = meta.write_blocks
                    real = blocks[(blocks >= 0) & (blocks != cache.shape[0] - 1)]
                    cache[real] += 1.0
                else:
                    slots = meta.slot_mapping
                    real = slots[slots >= 0].long()
                    cache.flatten(1, 2)[:, real] += 1.0
                spoiled += real.numel()
        seen.append(spoiled)

    graph.replay_fn = replay


def _assert_caught_by_what_was_written(checks: list[GraphCheck]) -> None:
    assert checks
    for check in checks:
        # The outputs still replay exactly: only comparing what was written can catch it.
        assert check.max_abs_diff == 0.0 and check.greedy_match, check
        assert not check.verified and check.real_rows_max_abs_diff > 0.5, check
        # An unverified graph always says why, with the number that broke its bound.
        assert check.reason.startswith("real rows differ from the unpadded batch by "), check


@pytest.mark.parametrize(("engine", "kind"), [("hybrid", "mamba"), ("llama", "full")])
def test_a_replay_corrupting_what_real_rows_wrote_does_not_verify(
    engine: str, kind: str, request: pytest.FixtureRequest
) -> None:
    llm: LLMEngine = request.getfixturevalue(engine)
    capturer, graphs = _capture(llm)
    seen: list[int] = []
    for graph in graphs:
        _spoil_after_replay(llm, graph, kind, seen)
    checks = verify_graphs(capturer, graphs, llm.kv_cache_manager)
    # Every replay wrote some real row's state or KV, which was then spoiled after the fact.
    assert len(seen) == len(checks) and all(n > 0 for n in seen)
    _assert_caught_by_what_was_written(checks)


def test_a_replay_writing_state_to_the_wrong_block_does_not_verify(
    hybrid: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replay reads the right state but stores the new one one block further on."""
    capturer, graphs = _capture(hybrid)
    states = hybrid.runner.mamba_states
    plan = states.metadata
    num_blocks = hybrid.num_blocks
    replaying = [False]

    def shifted(metas: dict[str, AttentionMetadata], *, static: bool = False) -> dict[str, AttentionMetadata]:
        out = plan(metas, static=static)
        if replaying[0]:
            for meta in out.values():
                if isinstance(meta, MambaMetadata) and meta.write_blocks is not None:
                    w = meta.write_blocks
                    # Block b goes to b + 1 (the last real block to block 1): still a real block.
                    w.copy_(torch.where(w >= 0, w % (num_blocks - 1) + 1, w))
        return out

    monkeypatch.setattr(states, "metadata", shifted)
    for graph in graphs:

        def replay(honest: Callable[[], None] = graph.replay_fn) -> None:
            replaying[0] = True
            try:
                honest()
            finally:
                replaying[0] = False

        graph.replay_fn = replay
    checks = verify_graphs(capturer, graphs, hybrid.kv_cache_manager)
    assert checks
    for check in checks:
        assert not check.verified and check.real_rows_max_abs_diff > 0.5, check
        # An unverified graph always says why, with the number that broke its bound.
        assert check.reason.startswith("real rows differ from the unpadded batch by "), check


def test_each_run_reads_the_state_the_reference_read(
    hybrid: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row with a context writes the block it reads (mode none): without putting back what the
    reference wrote, the replay would start from the reference's new state and its outputs drift.
    With it (the default) every graph verifies exactly."""
    capturer, graphs = _capture(hybrid)
    checks = verify_graphs(capturer, graphs, hybrid.kv_cache_manager)
    assert checks and all(c.verified and c.max_abs_diff == 0.0 for c in checks), checks

    monkeypatch.setattr(verify, "_restore", lambda written, values: None)
    capturer, graphs = _capture(hybrid)
    checks = verify_graphs(capturer, graphs, hybrid.kv_cache_manager)
    assert checks and all(not c.verified and c.real_rows_max_abs_diff > 0.5 for c in checks), checks


@pytest.mark.parametrize(
    ("model", "spec", "mode"),
    [
        ("tiny-llama", None, "none"),
        ("tiny-llama", "eagle3:2", "none"),
        ("tiny-llama", "draft_model:2", "none"),
        ("tiny-deepseek-v3", "mtp:2", "none"),
        *[("tiny-hybrid", "draft_model:2@self", mode) for mode in ("none", "all", "align")],
    ],
)
def test_every_graph_of_the_presets_verifies(model: str, spec: str | None, mode: str) -> None:
    engine = _engine(model, spec, mode=mode)
    capturer, graphs = _capture(engine, drafter_graphs=True)
    assert any(g.spec.subject == "drafter" for g in graphs) == (spec is not None)
    checks = verify_graphs(capturer, graphs, engine.kv_cache_manager)
    assert len(checks) == len(graphs)
    for check in checks:
        assert check.verified, check
        assert check.max_abs_diff == 0.0 and check.greedy_match
        assert check.real_rows_max_abs_diff <= 1e-5


def test_the_reference_recomputes_each_row_so_a_misread_context_is_caught(monkeypatch) -> None:
    """The real rows' reference is a full recompute (each row's context and step in one prefill
    from position 0), which reads no context from the cache: attention that misreads cached
    context, in the replay and the padded pass alike, cannot also be their reference."""
    rig = make_rig()
    capturer = GraphCapturer(rig.runner, "static", capture_sizes=[4, 8])
    graphs = capturer.capture().graphs
    assert all(c.verified for c in verify_graphs(capturer, graphs, rig.manager))
    honest = TorchPagedAttention.forward

    def misread(self, q, k, v, kv_cache, meta, **kwargs):
        out = honest(self, q, k, v, kv_cache, meta, **kwargs)
        r = meta.num_reqs
        query_lens = meta.query_start_loc[1 : r + 1] - meta.query_start_loc[:r]
        reads_cache = bool((meta.seq_lens[:r] > query_lens).any())
        return out + 0.5 if reads_cache else out

    monkeypatch.setattr(TorchPagedAttention, "forward", misread)
    # Captured again with the misreading attention (a recorded CPU graph replays what it recorded).
    capturer = GraphCapturer(rig.runner, "static", capture_sizes=[4, 8])
    graphs = capturer.capture().graphs
    checks = verify_graphs(capturer, graphs, rig.manager)
    assert checks and not any(c.verified for c in checks)
    assert all(c.real_rows_max_abs_diff > 1e-2 for c in checks)
    assert all("real rows differ from the unpadded batch" in c.reason for c in checks)


def test_every_broken_bound_is_named_in_the_reason() -> None:
    tol = Tolerance(0.0, 1e-5, relative=False)
    assert failed_bounds(0.0, 1e-6, 1e-5, True, tol) == []
    reasons = failed_bounds(2e-3, float("nan"), 1e-5, False, tol)
    assert [r.split(" ")[0] for r in reasons] == ["replay", "real", "greedy"]
    assert "0.002" in reasons[0] and "nan" in reasons[1]
