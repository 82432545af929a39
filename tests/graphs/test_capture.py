"""Capture + verification on CPU with the ``static`` backend (invariant I4)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from graph_fixtures import NUM_BLOCKS, count_forwards, make_rig
from rich.console import Console

from warmcap.errors import ConfigError
from warmcap.graphs.capture.capturer import GraphCapturer
from warmcap.graphs.capture.descriptors import BatchDescriptor, CUDAGraphMode
from warmcap.graphs.capture.planning import plan_target_graphs
from warmcap.graphs.proof.render import render
from warmcap.graphs.proof.report import SpecInfo, report_schema
from warmcap.graphs.proof.verify import verify_graphs
from warmcap.graphs.startup import capture_graphs

FULL = CUDAGraphMode.FULL


@pytest.fixture(scope="module")
def captured():
    rig = make_rig(k=1)
    pool_before = rig.manager.pool.snapshot()
    startup = capture_graphs(rig.runner, rig.manager, backend="static")
    return rig, startup, pool_before


def test_graph_set_covers_decode_without_holes_and_the_ladder(captured) -> None:
    _, startup, _ = captured
    keys = {g.spec.descriptor for g in startup.result.graphs}
    uniform = {BatchDescriptor(FULL, 2 * n, n, 2) for n in range(1, 5)}
    mixed = {BatchDescriptor(FULL, s, min(s, 4)) for s in (1, 2, 4, 8, 16)}
    assert keys == uniform | mixed
    assert startup.result.plan.capture_sizes == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("shapes", ["sizes", "decode"])
def test_graph_shapes_at_the_capture_sizes_pad_decode_steps_and_verify(shapes) -> None:
    """``sizes``: decode graphs only where a decode step's token count is a capture size (a step of
    3 requests pads to the 4-request graph) and the mixed ladder; ``decode``: no mixed graph."""
    from warmcap.graphs.capture.descriptors import BatchShape, Dispatcher

    rig = make_rig(k=1)
    startup = capture_graphs(
        rig.runner, rig.manager, backend="static", capture_sizes=[1, 2, 8], graph_shapes=shapes
    )
    keys = {g.spec.descriptor for g in startup.result.graphs}
    # k = 1: a decode row is 2 tokens, so 2 and 8 tokens are 1 and 4 requests (4 = 6 tokens has none)
    uniform = {BatchDescriptor(FULL, 2, 1, 2), BatchDescriptor(FULL, 8, 4, 2)}
    mixed = {BatchDescriptor(FULL, s, min(s, 4)) for s in (1, 2, 8)} if shapes == "sizes" else set()
    assert keys == uniform | mixed
    assert startup.checks and all(c.verified for c in startup.checks)
    three = BatchShape.from_query_lens([2, 2, 2], all_decode=True)
    assert Dispatcher(keys).dispatch(three) == BatchDescriptor(FULL, 8, 4, 2)


def test_every_graph_replays_bit_equal_and_real_rows_match(captured) -> None:
    _, startup, _ = captured
    assert len(startup.checks) == len(startup.result.graphs) == 9
    specs = {g.spec.label: g.spec for g in startup.result.graphs}
    for check in startup.checks:
        assert check.verified, check
        assert check.max_abs_diff == 0.0
        assert check.real_rows_max_abs_diff <= 1e-5 and check.greedy_match
        # There was padding to prove something about, except in graphs too small to pad.
        d = specs[check.label].descriptor
        unpaddable = d.num_tokens == 1 or (d.is_uniform_decode and d.num_reqs == 1)
        assert check.num_real_tokens < d.num_tokens or unpaddable


def test_all_eager_passes_come_first_then_largest_first(captured) -> None:
    _, startup, _ = captured
    order = startup.result.order
    stages = [stage for stage, _ in order]
    n = len(startup.result.graphs)
    assert stages == ["eager"] * n + ["capture"] * n
    sizes = [g.spec.num_tokens for g in startup.result.graphs]
    assert sizes == sorted(sizes, reverse=True)
    assert [label for _, label in order[n:]] == [g.spec.label for g in startup.result.graphs]


def test_capture_and_verification_leave_no_trace(captured) -> None:
    rig, _, pool_before = captured
    assert rig.manager.pool.snapshot().differences(pool_before) == []
    # Fresh caches were zero; only the sink block (index NUM_BLOCKS, never read) may hold padding.
    for tensor in rig.runner.kv_caches.tensors.values():
        assert tensor[:, :NUM_BLOCKS].abs().sum() == 0


def test_verification_catches_padding_that_writes_into_a_real_block() -> None:
    rig = make_rig(k=1)
    capturer = GraphCapturer(rig.runner, "static", capture_sizes=[8])
    result = capturer.capture()
    target = capturer.subjects["target"]
    honest_load = target.load

    def leaky_load(spec, step=None):
        honest_load(spec, step)
        if step is not None and step.num_tokens < spec.num_tokens:
            # Bug under test: padded tokens write over the first real row's context slot 0.
            for g, slots in rig.runner.buffers.slot_mappings.items():
                first_block = int(step.block_tables[g][0, 0])
                slots[step.num_tokens : spec.num_tokens] = first_block * 4

    target.load = leaky_load
    checks = verify_graphs(capturer, result.graphs, rig.manager)
    assert not all(c.verified for c in checks)
    assert any(c.real_rows_max_abs_diff > 1e-3 for c in checks)


def test_static_capture_runs_each_shape_once_and_still_replays_like_eager() -> None:
    rig = make_rig(k=1)
    # Capture alone (the CUDA-safety trace is the proof's, graphs/proof/safety.py).
    capturer = GraphCapturer(rig.runner, "static", capture_sizes=[1, 2, 4])
    calls = count_forwards(capturer)
    result = capturer.capture()
    # The eager pass is the capture: no second forward over the same all-padding inputs.
    assert calls == {g.spec.label: 1 for g in result.graphs}
    assert len({g.output.data_ptr() for g in result.graphs}) == len(result.graphs)
    checks = verify_graphs(capturer, result.graphs, rig.manager)
    assert checks and all(c.verified and c.max_abs_diff == 0.0 for c in checks)


def test_cuda_backend_is_refused_without_a_cuda_runner() -> None:
    rig = make_rig()
    with pytest.raises(ConfigError, match="static"):
        GraphCapturer(rig.runner, "cuda")
    with pytest.raises(ConfigError, match="unknown graph backend"):
        GraphCapturer(rig.runner, "tensorrt")


def test_static_report_validates_and_says_no_graph_was_recorded(captured) -> None:
    _, startup, _ = captured
    report = startup.report(model="tiny-llama", device="cpu", spec=SpecInfo("eagle", 1))
    jsonschema.validate(json.loads(report.to_json()), report_schema(), cls=jsonschema.Draft202012Validator)
    assert report.totals.count == 9 and report.totals.all_verified
    assert report.timings["capture"] > 0 and report.timings["verify"] > 0
    console = Console(record=True, width=160, color_system=None)
    render(report, console)
    assert "No CUDA graph was recorded on this machine" in console.export_text()


def test_graph_memory_on_static_is_the_output_buffer_or_the_recordings_intermediates(captured) -> None:
    _, startup, _ = captured
    for g in startup.result.graphs:
        output = g.spec.num_tokens * 32 * torch.float32.itemsize
        if g.program is None:
            assert g.memory_bytes == output
        else:
            # A recorded graph keeps every tensor its forward made, the output among them.
            assert g.memory_bytes == g.program.scratch_bytes > output


def test_cuda_planning_keeps_every_graph_of_a_model_without_mamba_layers() -> None:
    """Only Mamba layers make the ``cuda`` plan drop ragged graphs (see test_mamba_graphs)."""
    rig = make_rig(k=1)
    static = plan_target_graphs(rig.runner, backend="static")
    assert plan_target_graphs(rig.runner, backend="cuda") == static
    assert {s.phase for s in static.specs} == {"decode", "mixed"}
