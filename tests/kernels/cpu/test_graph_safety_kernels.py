"""The fake-tensor CUDA-graph safety check (``graphs/proof/safety.py``) on a CPU engine whose
attention, layer ops and linears run the compiled kernels: the check goes through the kernels'
operators (their fake implementations), never their C code, and finds the graphs safe."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from warmcap.engine import LLMEngine
from warmcap.graphs.capture.capturer import GraphCapturer
from warmcap.graphs.proof.safety import GraphSafety, check_graph_safe
from warmcap.kernels.cpu import gemm, layer_ops, paged_attention
from warmcap.kernels.cpu.gemm import Gemm
from warmcap.kernels.cpu.layer_ops import LayerOps
from warmcap.kernels.cpu.paged_attention import PagedAttentionKernel


def test_the_safety_check_runs_through_the_kernels_fake_implementations(monkeypatch) -> None:
    for env in (paged_attention.ENV, layer_ops.ENV, gemm.ENV):
        monkeypatch.setenv(env, "kernel")
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu", enforce_eager=True),
        cache=CacheConfig(block_size=16, num_blocks=32),
        scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64),
    )
    runner = LLMEngine(config, startup_hooks=[]).runner
    capturer = GraphCapturer(runner, "static", capture_sizes=[2])
    specs = [s for s in capturer.plan.specs if s.max_query_len <= paged_attention.MAX_QUERY_LEN]
    assert specs, "a decode graph to check"

    seen: dict[str, list[bool]] = {"attention": [], "rms_norm": [], "rope_": [], "linear": [], "silu_mul": []}

    def spy(name, real):
        def wrapped(*args, **kwargs):
            seen[name].append(any(isinstance(a, FakeTensor) for a in args if isinstance(a, torch.Tensor)))
            return real(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(PagedAttentionKernel, "__call__", spy("attention", PagedAttentionKernel.__call__))
    for name in ("rms_norm", "rope_"):
        monkeypatch.setattr(LayerOps, name, spy(name, getattr(LayerOps, name)))
    for name in ("linear", "silu_mul"):
        monkeypatch.setattr(Gemm, name, spy(name, getattr(Gemm, name)))
    c_calls: list[str] = []
    monkeypatch.setattr(paged_attention, "_entry_point", lambda: c_calls.append("attention"))
    monkeypatch.setattr(layer_ops, "_c", lambda: c_calls.append("layer ops"))
    monkeypatch.setattr(gemm, "_entry_points", lambda: c_calls.append("gemm"))

    for spec in specs:
        capturer.load(spec)
        assert check_graph_safe(capturer, spec, capturer.metadata(spec)) == GraphSafety(True), spec.label
    for name, calls in seen.items():
        assert calls and all(calls), f"the check must reach {name} with fake tensors: {calls}"
    assert c_calls == [], "fake tensors reached the C code"
