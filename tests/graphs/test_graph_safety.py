"""The fake-tensor check of whether a graph's forward would record as a CUDA graph: safe graphs are
reported safe, a host read or data-dependent shape planted in the forward is reported with its op
and line, and the check leaves every real tensor (KV caches, buffers, weights) as it found it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from functools import cache

import pytest
import torch
from graph_fixtures import make_rig

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.engine import LLMEngine
from warmcap.graphs.capture.capturer import GraphCapturer
from warmcap.graphs.capture.planning import GraphSpec, plan_draft_graphs, plan_target_graphs
from warmcap.graphs.proof.safety import GraphSafety, check_graph_safe
from warmcap.graphs.startup import capture_graphs

THIS_FILE = "test_graph_safety.py:"


@cache
def _engine(model: str, spec: str | None) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=model, device="cpu", enforce_eager=True),
        cache=CacheConfig(block_size=16, num_blocks=32),
        scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64),
        speculative=SpeculativeConfig.parse(spec),
    )
    return LLMEngine(config, startup_hooks=[])


def _check(capturer: GraphCapturer, spec: GraphSpec) -> GraphSafety:
    capturer.load(spec)
    return check_graph_safe(capturer, spec, capturer.metadata(spec))


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["eagle:2", "draft_model:2"])
def test_tiny_llama_target_and_drafter_graphs_are_all_safe(spec: str) -> None:
    capturer = GraphCapturer(_engine("tiny-llama", spec).runner, "static")
    result = capturer.capture()
    assert {g.spec.subject for g in result.graphs} == {"target", "drafter"}
    for graph in result.graphs:
        capturer.load(graph.spec)
        assert check_graph_safe(capturer, graph) == GraphSafety(True), graph.spec.label


def _mlp_leak(body: Callable[[torch.Tensor], object]) -> Callable[[GraphCapturer, pytest.MonkeyPatch], None]:
    def plant(capturer: GraphCapturer, monkeypatch: pytest.MonkeyPatch) -> None:
        mlp = capturer.runner.model.model.layers[1].mlp
        honest = mlp.forward

        def leaky(x: torch.Tensor) -> torch.Tensor:
            body(x)
            return honest(x)

        monkeypatch.setattr(mlp, "forward", leaky)

    return plant


def _host_copy_leak(capturer: GraphCapturer, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = capturer.runner.attn_backend
    honest = backend.forward

    def leaky(q, k, v, kv_cache, meta, **kw):
        # No sync at all, but a replay would reuse the lengths seen at capture.
        lens = meta.seq_lens_cpu.to(q.device)
        return honest(q, k, v, kv_cache, meta, **kw) * (lens.sum() >= 0)

    monkeypatch.setattr(backend, "forward", leaky)


LEAKS = {
    "tolist": (_mlp_leak(lambda x: x.sum().tolist()), "(host read of device data)"),
    "int": (_mlp_leak(lambda x: int(x.argmax())), "(host read of device data)"),
    "nonzero": (_mlp_leak(lambda x: torch.nonzero(x > 0)), "aten.nonzero (data-dependent shape)"),
    "bool_mask": (_mlp_leak(lambda x: x[x > 0]), "aten.nonzero (data-dependent shape)"),
    "cpu": (_mlp_leak(lambda x: x.cpu()), "Tensor.cpu (device-to-host copy)"),
    "host_copy": (_host_copy_leak, "on host copy seq_lens_cpu"),
}


@pytest.mark.parametrize("leak", list(LEAKS))
def test_a_planted_host_read_is_reported_with_its_op_and_line(leak: str, monkeypatch) -> None:
    rig = make_rig(k=1)
    capturer = GraphCapturer(rig.runner, "static", capture_sizes=[4])
    specs = capturer.plan.specs
    assert all(_check(capturer, s).safe for s in specs)
    plant, expected = LEAKS[leak]
    plant(capturer, monkeypatch)
    for spec in specs:
        safety = _check(capturer, spec)
        assert not safety.safe, spec.label
        assert expected in safety.reason, safety.reason
        assert THIS_FILE in safety.reason, safety.reason


def test_a_write_into_a_tensor_the_check_did_not_fake_is_stopped(monkeypatch) -> None:
    rig = make_rig(k=1)
    capturer = GraphCapturer(rig.runner, "static", capture_sizes=[4])
    # A plain tensor attribute (not a parameter or buffer) that the forward updates in place.
    counter = torch.zeros(3)
    _mlp_leak(lambda x: counter.add_(1))(capturer, monkeypatch)
    spec = capturer.plan.specs[0]
    safety = _check(capturer, spec)
    assert not safety.safe and "check incomplete" in safety.reason and THIS_FILE in safety.reason
    assert torch.equal(counter, torch.zeros(3))


def _state(capturer: GraphCapturer, metas: dict) -> dict[str, torch.Tensor]:
    """Every real tensor a check could touch (the graph's metadata included), cloned."""
    runner = capturer.runner
    out = {f"kv.{n}": t.clone() for n, t in runner.kv_caches.tensors.items()}
    for group, meta in metas.items():
        out |= {f"meta.{group}.{n}": v.clone() for n, v in _tensor_fields(meta).items()}
    out |= {f"model.{n}": t.clone() for n, t in runner.model.state_dict(keep_vars=True).items()}
    if runner.drafter is not None:
        for attr, value in vars(runner.drafter).items():
            if isinstance(value, torch.nn.Module):
                out |= {f"drafter.{attr}.{n}": t.clone() for n, t in value.state_dict().items()}
    holders = {"buffers": runner.buffers}
    if runner.draft_executor is not None:
        statics = runner.draft_executor.buffers
        holders["drafts"] = statics.buffers
        out |= {f"features.{p}": t.clone() for p, t in statics.features.items()}
    for prefix, holder in holders.items():
        for name, value in vars(holder).items():
            if isinstance(value, torch.Tensor):
                out[f"{prefix}.{name}"] = value.clone()
            elif isinstance(value, dict):
                out |= {
                    f"{prefix}.{name}.{g}": t.clone() for g, t in value.items() if isinstance(t, torch.Tensor)
                }
    return out


def _tensor_fields(meta) -> dict[str, torch.Tensor]:
    return {f.name: v for f in fields(meta) if isinstance(v := getattr(meta, f.name), torch.Tensor)}


@pytest.mark.parametrize(("model", "spec"), [("tiny-llama", "eagle:2"), ("tiny-hybrid", None)])
def test_a_check_changes_no_real_state_and_leaves_eager_output_unchanged(
    model: str, spec: str | None
) -> None:
    runner = _engine(model, spec).runner
    capturer = GraphCapturer(runner, "static", capture_sizes=[4])
    generator = torch.Generator().manual_seed(0)
    # Non-zero caches: a check that wrote into them (KV, Mamba state) would show.
    for tensor in runner.kv_caches.tensors.values():
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    for graph_spec in [*capturer.plan.specs, *capturer.draft_plan.specs]:
        capturer.load(graph_spec)
        metas = capturer.metadata(graph_spec)
        with torch.inference_mode():
            before = capturer.forward(graph_spec, metas)[0].clone()
        state = _state(capturer, metas)
        plans = {k: id(v) for k, v in runner.attn_backend._plans.items()}
        aux = runner.last_aux_hidden_states
        check_graph_safe(capturer, graph_spec, metas)
        after = _state(capturer, metas)
        assert after.keys() == state.keys()
        changed = [name for name in state if not torch.equal(state[name], after[name])]
        assert changed == [], f"{graph_spec.label}: {changed[:5]}"
        assert {k: id(v) for k, v in runner.attn_backend._plans.items()} == plans
        assert runner.last_aux_hidden_states is aux
        with torch.inference_mode():
            again = capturer.forward(graph_spec, metas)[0]
        assert type(again) is torch.Tensor and torch.equal(before, again), graph_spec.label


@pytest.mark.parametrize("model", ["tiny-deepseek-v3", "tiny-deepseek-v32", "tiny-hybrid"])
def test_uniform_decode_target_graphs_of_the_presets_are_safe(model: str) -> None:
    capturer = GraphCapturer(_engine(model, None).runner, "static")
    decode = [s for s in capturer.plan.specs if s.descriptor.is_uniform_decode]
    assert decode
    for spec in decode:
        assert _check(capturer, spec) == GraphSafety(True), spec.label


def test_tiny_hybrid_mixed_graphs_are_unsafe_in_the_ragged_mamba_scan() -> None:
    capturer = GraphCapturer(_engine("tiny-hybrid", None).runner, "static")
    mixed = [s for s in capturer.plan.specs if not s.descriptor.is_uniform_decode]
    assert mixed
    for spec in mixed:
        safety = _check(capturer, spec)
        assert not safety.safe and "warmcap/runner_v2/attention/mamba2.py:" in safety.reason, (
            spec.label,
            safety,
        )


def test_cuda_planning_leaves_out_exactly_the_graphs_the_check_finds_unsafe() -> None:
    """Two independent answers agree: the ``cuda`` plan's Mamba rule, and the fake run."""
    runner = _engine("tiny-hybrid", "draft_model:2@self").runner
    capturer = GraphCapturer(runner, "static")
    cuda_target = plan_target_graphs(runner, backend="cuda")
    cuda = {*cuda_target.specs, *plan_draft_graphs(runner, cuda_target, backend="cuda").specs}
    planned = [*capturer.plan.specs, *capturer.draft_plan.specs]
    assert cuda < set(planned) and any(s.subject == "drafter" for s in cuda)
    assert {s for s in planned if _check(capturer, s).safe} == cuda


@pytest.mark.parametrize(("model", "unsafe_phases"), [("tiny-llama", set()), ("tiny-hybrid", {"mixed"})])
def test_static_capture_reports_cuda_safety_of_the_largest_graph_of_each_phase(
    model: str, unsafe_phases: set[str]
) -> None:
    engine = _engine(model, None)
    startup = capture_graphs(engine.runner, engine.kv_cache_manager, backend="static", verify=False)
    records = startup.records
    checked = [r for r in records if r.cuda_safe is not None]
    # One check per phase, on its largest graph (capture order is largest first).
    assert sorted(r.phase for r in checked) == sorted({r.phase for r in records})
    for r in checked:
        assert r is next(x for x in records if x.phase == r.phase)
        assert r.cuda_safe is (r.phase not in unsafe_phases), r
        assert ("mamba2.py" in r.cuda_unsafe_reason) is (r.phase in unsafe_phases)
        assert ("cuda plan runs this phase eagerly" in r.cuda_unsafe_reason) is (r.phase in unsafe_phases)
    report = startup.report(model=model, device="cpu")
    assert report.totals.cuda_unsafe == len(unsafe_phases)
    engine.runner.attach_graphs(None)
