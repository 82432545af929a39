"""Graphs over Mamba layers: the ``cuda`` plan keeps only uniform (graph-safe) shapes, and a graph's
Mamba metadata is refilled in place for every batch it serves (the addresses a recorded graph
baked in stay valid), so serving through graphs generates what eager serving does."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.contracts import AttentionMetadata
from warmcap.core.kv_spec import MambaSpec
from warmcap.drafters.base import DRAFT_DECODE, DRAFT_PREFILL
from warmcap.engine import LLMEngine
from warmcap.graphs.capture.planning import plan_draft_graphs, plan_target_graphs
from warmcap.graphs.hook import graph_capture_hook
from warmcap.graphs.startup import capture_graphs
from warmcap.runner_v2.mamba_state import MambaMetadata, build_mamba_metadata, mamba_metadata, plan_state
from warmcap.sampling_params import SamplingParams

PROMPTS = [[3 + (7 * i + j) % 90 for j in range(n)] for i, n in enumerate((7, 20, 3))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _config(spec: str | None, *, mode: str = "align", eager: bool = False) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="tiny-hybrid", device="cpu", enforce_eager=eager),
        cache=CacheConfig(block_size=16, num_blocks=64, mamba_cache_mode=mode),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64),
        speculative=SpeculativeConfig.parse(spec),
    )


@pytest.mark.parametrize("spec", ["draft_model:2@self", "eagle:2"])
def test_cuda_plan_leaves_ragged_mamba_graphs_out_and_static_keeps_them(spec: str) -> None:
    runner = LLMEngine(_config(spec), startup_hooks=[]).runner
    static = plan_target_graphs(runner, backend="static")
    cuda = plan_target_graphs(runner, backend="cuda")
    assert {s.phase for s in static.specs} == {"decode", "mixed"}
    assert cuda.specs == [s for s in static.specs if s.phase == "decode"]
    assert any("Mamba layers: mixed prefill/decode batches run eagerly" in n for n in cuda.notes)
    assert not any("Mamba" in n for n in static.notes)

    draft_static = plan_draft_graphs(runner, static, backend="static")
    draft_cuda = plan_draft_graphs(runner, cuda, backend="cuda")
    assert {s.phase for s in draft_static.specs} == {DRAFT_PREFILL, DRAFT_DECODE}
    if spec.startswith("draft_model"):
        # The draft LM is the hybrid itself: its ragged prefills cannot be recorded either.
        assert draft_cuda.specs == [s for s in draft_static.specs if s.phase == DRAFT_DECODE]
        assert any("Mamba layers: draft prefills run eagerly" in n for n in draft_cuda.notes)
    else:
        # EAGLE's head is attention only: its prefills stay graphs on the target's ladder.
        assert draft_cuda.specs == draft_static.specs and not draft_cuda.notes


def test_static_metadata_is_refilled_in_place_and_one_off_metadata_is_left_alone() -> None:
    spec = MambaSpec(4, state_shapes=((3, 2), (2, 2, 2)), cache_mode="align", num_speculative_blocks=1)
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    seq_lens = torch.tensor([7, 2], dtype=torch.int32)
    table = torch.tensor([[7, 3, 9], [5, 6, 0]], dtype=torch.int32)
    meta = AttentionMetadata(4, 2, qsl, seq_lens, table, torch.full((4,), -1), 2, 7, 4, qsl, seq_lens)

    def plans(c: int, live: int | None) -> list:
        # Row 0 verifies one draft after ``c`` tokens; row 1 is a new two-token prompt.
        return [
            plan_state(
                spec, num_computed_tokens=c, num_scheduled_tokens=2, num_spec_tokens=1, live_column=live
            ),
            plan_state(
                spec, num_computed_tokens=0, num_scheduled_tokens=2, num_spec_tokens=0, live_column=None
            ),
        ]

    first, second = plans(1, 0), plans(5, 1)
    with torch.inference_mode():  # as at capture time
        static = mamba_metadata(meta, lambda m: first, static=True)
    assert isinstance(static, MambaMetadata) and static.static
    assert static.read_blocks is not None and static.write_blocks is not None
    pointers = (static.read_blocks.data_ptr(), static.write_blocks.data_ptr())
    # A later pass over the same buffers (outside inference mode too) refills the same tensors.
    assert mamba_metadata(static, lambda m: second) is static
    assert (static.read_blocks.data_ptr(), static.write_blocks.data_ptr()) == pointers
    want = build_mamba_metadata(meta, second)
    assert torch.equal(static.read_blocks, want.read_blocks)
    assert torch.equal(static.write_blocks, want.write_blocks)
    assert not torch.equal(static.write_blocks, build_mamba_metadata(meta, first).write_blocks)
    # Metadata built for one eager pass is used as built; plain metadata gets a new object.
    one_off = build_mamba_metadata(meta, first)
    assert mamba_metadata(one_off, lambda m: second) is one_off
    assert torch.equal(one_off.write_blocks, build_mamba_metadata(meta, first).write_blocks)
    assert mamba_metadata(meta, lambda m: first) is not mamba_metadata(meta, lambda m: first)


def _snapshot(meta: MambaMetadata) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    assert meta.read_blocks is not None and meta.write_blocks is not None
    return (
        meta.read_blocks.data_ptr(),
        meta.write_blocks.data_ptr(),
        meta.read_blocks.clone(),
        meta.write_blocks.clone(),
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "all"])
def test_graph_mamba_metadata_is_refilled_in_place_and_generation_equals_eager(mode: str) -> None:
    spec = "draft_model:2@self"
    eager = LLMEngine(_config(spec, mode=mode, eager=True), startup_hooks=[])
    expected = [o.token_ids for o in eager.generate(PROMPTS, [GREEDY] * len(PROMPTS))]

    engine = LLMEngine(
        _config(spec, mode=mode), startup_hooks=[partial(graph_capture_hook, capture_sizes=[8])]
    )
    startup = engine.graph_startup
    assert startup.checks and all(c.verified for c in startup.checks), startup.checks
    seen: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for graph in startup.result.graphs:
        states = [m for m in graph.metas.values() if isinstance(m, MambaMetadata)]
        assert len(states) == 1 and states[0].static, graph.spec.label
        seen[graph.spec.label] = [_snapshot(states[0])]

        def spy(replay=graph.replay_fn, meta=states[0], label=graph.spec.label) -> None:
            replay()
            seen[label].append(_snapshot(meta))

        graph.replay_fn = spy

    got = [o.token_ids for o in engine.generate(PROMPTS, [GREEDY] * len(PROMPTS))]
    assert got == expected
    uniform = {g.spec.label for g in startup.result.graphs if g.spec.phase in ("decode", DRAFT_DECODE)}
    for label in uniform:
        assert len(seen[label]) > 1, f"{label} never served a batch"
    for label, snaps in seen.items():
        # The graph's tensors are the ones it was captured over, whatever batch it served.
        assert {(r, w) for r, w, _, _ in snaps} == {snaps[0][:2]}, label
    served = [s for label in uniform for s in seen[label][1:]]
    # Replays read real state columns, and different batches read different ones.
    assert all(bool((reads >= 1).any()) for _, _, reads, _ in served)
    assert len({tuple(reads.tolist()) for _, _, reads, _ in served}) > 1


def test_cuda_plan_of_an_ngram_hybrid_replays_its_decode_steps() -> None:
    """ngram drafts nothing for a row without an earlier match, so most decode steps verify one
    query a row: with no mixed graphs on the ``cuda`` plan, they need one-query decode graphs, or
    generation replays nothing (seen on an H200). ``static`` capture of the ``cuda`` plan runs the
    same dispatch on CPU."""
    config = _config("ngram:2")
    expected = [
        o.token_ids
        for o in LLMEngine(_config("ngram:2", eager=True), startup_hooks=[]).generate(
            PROMPTS, [GREEDY] * len(PROMPTS)
        )
    ]
    engine = LLMEngine(config, startup_hooks=[])
    startup = capture_graphs(engine.runner, engine.kv_cache_manager, backend="static", plan_backend="cuda")
    decode = {g.spec.descriptor.uniform_query_len for g in startup.result.graphs}
    assert decode == {1, 3}, [g.spec.label for g in startup.result.graphs]
    assert all(c.verified for c in startup.checks), startup.checks
    assert any("ngram drafts 0..2 tokens a row" in n for n in startup.result.notes)

    got = [o.token_ids for o in engine.generate(PROMPTS, [GREEDY] * len(PROMPTS))]
    assert got == expected
    replays = startup.graph_runner.replays
    assert sum(n for d, n in replays.items() if d.uniform_query_len == 1) > 0, replays

    # A drafter that always drafts k keeps the plan as it was: no one-query graphs.
    runner = LLMEngine(_config("draft_model:2@self"), startup_hooks=[]).runner
    assert {s.descriptor.uniform_query_len for s in plan_target_graphs(runner, backend="cuda").specs} == {3}
