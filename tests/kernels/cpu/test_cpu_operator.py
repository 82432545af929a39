"""How a compiled CPU kernel is called (``kernels/cpu/policy.py`` ``CpuOperator``): a call nothing
watches runs the kernel without torch's dispatcher, and gives the operator's bits; a call something
watches (a dispatch mode, the profiler, fake tensors) goes through the operator, so the graph safety
pass, the op counts and shape tracing still see every kernel."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from warmcap.kernels.cpu import layer_ops
from warmcap.kernels.cpu.layer_ops import LayerOps


@pytest.fixture(scope="session")
def ops(cpu_layer_ops: LayerOps) -> LayerOps:
    return cpu_layer_ops


def _refuse(*args: object) -> None:
    raise AssertionError("the call went through torch's dispatcher")


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_an_unwatched_call_skips_the_dispatcher_with_the_operators_bits(ops):
    gen = torch.Generator().manual_seed(7)
    x, delta, weight = (torch.randn(3, 64, generator=gen) for _ in range(3))
    weight = weight[0].contiguous()
    expected = torch.ops.warmcap.rms_norm.default(x, weight, 1e-6)
    expected_h, expected_norm = torch.ops.warmcap.add_rms_norm.default(x, delta, weight, 1e-6)
    with (
        mock.patch.object(layer_ops._RMS_NORM, "op", _refuse),
        mock.patch.object(layer_ops._ADD_RMS_NORM, "op", _refuse),
    ):
        got = ops.rms_norm(x, weight, 1e-6)
        h, norm = ops.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(got, expected)
    assert torch.equal(h, expected_h) and torch.equal(norm, expected_norm)


def test_a_dispatch_mode_and_the_profiler_see_every_kernel_call(ops):
    x, weight = torch.randn(2, 64), torch.randn(64)
    with _Recorder() as recorder:
        ops.rms_norm(x, weight, 1e-6)
    assert "warmcap.rms_norm.default" in recorder.seen
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.rms_norm(x, weight, 1e-6)
    assert "warmcap::rms_norm" in {e.key for e in prof.key_averages()}


def test_fake_tensors_get_the_fake_implementation(ops):
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(5, 64))
        weight = mode.from_tensor(torch.randn(64))
        out = ops.rms_norm(x, weight, 1e-6)
    assert isinstance(out, FakeTensor) and out.shape == (5, 64)
