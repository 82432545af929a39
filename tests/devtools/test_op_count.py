"""The op counter (``devtools/op_count.py``): what counts as an op, per-layer attribution, and the ops of a
decode step as a bound, so a change that adds ops to a layer fails here (the CPU proxy for CUDA
kernels a step, issue 27; ``benchmarks/bench_ops_per_step.py`` prints the numbers)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from warmcap.devtools.op_count import count_ops, decode_step_ops
from warmcap.engine import LLMEngine
from warmcap.llm import build_config

#: the compiled CPU kernels off: the path CUDA runs (plain linears, torch norms, RoPE, attention)
TORCH_PATH = ("WARMCAP_CPU_LAYER_OPS", "WARMCAP_CPU_GEMM", "WARMCAP_CPU_ATTENTION")


def test_views_and_no_op_conversions_count_nothing_and_work_counts_once():
    x = torch.randn(4, 6)
    _, views = count_ops(lambda: (x.view(24), x.t(), x.reshape(6, 4), x.to(torch.float32), x[1:]))
    assert views.total == 0
    _, work = count_ops(lambda: (x + 1, x.to(torch.bfloat16), x.t().contiguous()))
    assert work.total == 3
    assert work.by_op == {"aten::add": 1, "aten::_to_copy": 1, "aten::clone": 1}


def test_inference_mode_conversions_are_counted():
    # NOTE: a TorchDispatchMode misses Tensor.to under inference mode; every runner step runs in it.
    with torch.inference_mode():
        x = torch.randn(3, 5)
        _, counts = count_ops(lambda: x.to(torch.bfloat16))
    assert counts.total == 1


def test_ops_inside_the_given_layers_are_counted_per_layer():
    layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def run():
        h = torch.randn(2, 4) * 2  # 2 ops outside (randn, mul)
        for layer in layers:
            h = layer(h).relu()  # 2 ops each: linear, relu
        return h

    _, counts = count_ops(run, layers)
    assert counts.num_layers == 2
    assert counts.in_layers == 2  # relu runs after the layer's forward
    assert counts.total == 6
    assert counts.per_layer == 1.0


def _engine(model: str, dtype: str) -> LLMEngine:
    config = build_config(
        model, device="cpu", dtype=dtype, enforce_eager=True, max_model_len=256, max_num_seqs=2
    )
    return LLMEngine(config, startup_hooks=[])


@pytest.mark.slow
def test_decode_step_ops_per_layer_stay_within_their_bound(monkeypatch):
    from warmcap.models.fused_ops import FusedOps, attach_fused_ops

    for env in TORCH_PATH:
        monkeypatch.setenv(env, "torch")
    prompt = list(range(3, 21))
    torch_path = decode_step_ops(_engine("tiny-llama", "bfloat16"), prompt)
    fused_engine = _engine("tiny-llama", "bfloat16")
    attach_fused_ops(fused_engine.runner.model, FusedOps(torch.device("cpu")))
    fused = decode_step_ops(fused_engine, prompt)
    assert torch_path.num_layers == fused.num_layers == 2
    # Outside attention a layer is 4 GEMMs (q/k/v and gate/up stacked), 4 fused ops and the MLP's
    # residual add; the torch path needs 29 (main at bebd658, measured with this counter).
    assert fused.per_layer_outside_attention <= 9, fused.by_op_in_layers
    assert fused.by_op_in_layers["aten::linear"] == 2 * 4
    assert torch_path.per_layer_outside_attention <= 29, torch_path.by_op_in_layers
    for op in ("rms_norm", "add_rms_norm", "silu_mul", "rope_write_kv"):
        assert fused.by_op_in_layers[f"warmcap_fused::{op}"] == 2, fused.by_op_in_layers
    # The backend no longer writes K/V when the layer did (two index_copy_ a layer before).
    assert fused.by_op_in_layers["aten::index_copy_"] == 0
    assert torch_path.by_op_in_layers["aten::index_copy_"] == 4
