"""Recorded CPU graphs (``graphs/capture/cpu_program.py``): a ``static`` graph on CPU replays the
kernel calls and torch ops its forward made, not the forward; what cannot be replayed that way is
refused with the reason, and the graph then runs its forward as before."""

from __future__ import annotations

import ctypes

import pytest
import torch
from graph_fixtures import count_forwards, make_rig

from warmcap.graphs.capture import capturer as capture_module
from warmcap.graphs.capture.capturer import GraphCapturer
from warmcap.graphs.capture.cpu_program import CpuProgram, Refused, record
from warmcap.graphs.proof.verify import verify_graphs
from warmcap.kernels.cpu.gemm import BlockedWeight, Gemm
from warmcap.kernels.cpu.policy import CpuOperator, c_call, host_sync
from warmcap.llm import LLM
from warmcap.sampling_params import SamplingParams

# Two operators built like the compiled kernels' (CpuOperator), over a C function of libc: one
# whose C call returns a status read from a tensor, one whose implementation also computes in torch.
_LIBC = ctypes.CDLL(None)
_LIBC.abs.argtypes, _LIBC.abs.restype = [ctypes.c_int], ctypes.c_int


def _status_impl(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    status = c_call(_LIBC.abs, int(x.shape[0]))  # a launch returning a status fixed by the shape
    if status != x.shape[0]:
        raise RuntimeError("libc abs failed")
    return out


def _torch_inside_impl(x: torch.Tensor) -> torch.Tensor:
    c_call(_LIBC.abs, 1)
    return x.clone()


_STATUS_OP = CpuOperator("test_status", "(Tensor x) -> Tensor", _status_impl, lambda x: torch.empty_like(x))


class _PeerLeft(Exception):
    pass


# The same call, with the operator's own exception for a status (as the shared-memory all-reduce has).
_STATUS_ERROR_OP = CpuOperator(
    "test_status_error",
    "(Tensor x) -> Tensor",
    _status_impl,
    lambda x: torch.empty_like(x),
    status_error=lambda status: _PeerLeft(f"status {status}"),
)
_TORCH_INSIDE_OP = CpuOperator(
    "test_torch_inside", "(Tensor x) -> Tensor", _torch_inside_impl, lambda x: torch.empty_like(x)
)


def test_a_recording_replays_functional_and_in_place_ops_on_new_values() -> None:
    a, b = torch.arange(4.0), torch.ones(4)
    buf = torch.zeros(4)

    def forward() -> torch.Tensor:
        buf.copy_(a)
        buf.mul_(3)
        return torch.where(buf > 4, buf + b, torch.full_like(buf, -1.0))

    out, program = record(forward)
    assert isinstance(program, CpuProgram)
    assert out.tolist() == [-1.0, -1.0, 7.0, 10.0]
    # Functional ops replay through their out= overloads into the recorded tensors (no allocation).
    assert {str(c.func) for c in program._calls if "out" in getattr(c, "kwargs", {})} >= {
        "aten.add.out",
        "aten.where.self_out",
        "aten.gt.Scalar_out",
    }
    a.copy_(torch.tensor([2.0, 0.0, 1.0, 5.0]))
    b.fill_(0.5)
    program.replay()
    # The recorded output tensor holds the new result, as a CUDA graph's static output would.
    assert out.tolist() == [6.5, -1.0, -1.0, 15.5]
    assert torch.equal(out, forward())


@pytest.mark.parametrize(
    ("forward", "reason"),
    [
        (lambda x: x.sum().item(), "aten.item"),
        (lambda x: x * 2 if bool(x[0] > 0) else x, "aten.is_nonzero"),
        (lambda x: torch.equal(x, x + 1), "aten.equal"),
        (lambda x: x.tolist(), "Tensor.tolist"),
        (lambda x: x.numpy().copy(), "Tensor.numpy"),
        (lambda x: torch.nonzero(x), "nonzero"),
        (lambda x: torch.rand(3) + x[:3], "rand"),
        (lambda x: c_call(_LIBC.abs, -3), "outside any warmcap operator"),
        (lambda x: _TORCH_INSIDE_OP(x), "also ran aten.clone"),
    ],
    ids=["item", "bool", "equal", "tolist", "numpy", "nonzero", "random", "bare-c-call", "torch-in-kernel"],
)
def test_what_cannot_replay_is_refused_with_the_op_and_the_run_still_completes(forward, reason) -> None:
    x = torch.arange(1.0, 6.0)
    result, program = record(lambda: forward(x))
    assert isinstance(program, Refused)
    assert reason in program.reason
    assert result is not None  # the forward itself ran to its end


def test_a_launch_that_returns_another_status_at_replay_raises_naming_the_operator() -> None:
    x = torch.ones(3)
    holder = {"x": x}
    _, program = record(lambda: _STATUS_OP(holder["x"]))
    assert isinstance(program, CpuProgram) and program.kernel_calls == 1
    program.replay()  # same arguments, same status
    (launch,) = [c for c in program._calls if hasattr(c, "fn")]
    object.__setattr__(launch, "args", (-7,))  # as if the inputs had moved out of what was recorded
    with pytest.raises(RuntimeError, match=r"warmcap\.test_status.*returned 7 \(at capture 3\)"):
        program.replay()


def test_a_changed_status_raises_the_operators_own_error_where_it_has_one() -> None:
    x = torch.ones(2)
    _, program = record(lambda: _STATUS_ERROR_OP(x))
    assert isinstance(program, CpuProgram)
    (launch,) = [c for c in program._calls if hasattr(c, "fn")]
    object.__setattr__(launch, "args", (-1005,))
    with pytest.raises(_PeerLeft, match="status 1005"):
        program.replay()


def test_a_wait_on_the_host_that_code_reports_refuses_the_recording() -> None:
    """A collective made in Python (its waits invisible to the recording) reports itself."""
    x = torch.ones(4)

    def forward() -> torch.Tensor:
        y = x * 2
        host_sync("a shared-memory collective in Python")
        return y + 1

    out, program = record(forward)
    assert isinstance(program, Refused)
    assert program.reason == "a shared-memory collective in Python: waits on the host"
    assert out.tolist() == [3.0] * 4
    host_sync("outside a recording: nothing happens")


def test_a_kernel_is_replayed_as_its_c_call_with_the_same_bits(cpu_gemm: Gemm) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = BlockedWeight.pack(torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen))
    x = torch.randn(5, 64, generator=gen)
    out, program = record(lambda: cpu_gemm.linear(x, weight))
    assert isinstance(program, CpuProgram)
    assert (len(program), program.kernel_calls) == (1, 1)
    x.copy_(torch.randn(5, 64, generator=gen))
    # Outgrow this thread's GEMM scratch first: the recorded launch works in a buffer of its own.
    cpu_gemm.linear(torch.randn(300, 64, generator=gen), weight)
    program.replay()
    assert torch.equal(out, cpu_gemm.linear(x, weight))
    # A strided x is copied inside the implementation: torch compute a replay would skip.
    wide = torch.randn(64, 5, generator=gen).t()
    _, refused = record(lambda: cpu_gemm.linear(wide, weight))
    assert isinstance(refused, Refused) and "also ran" in refused.reason


def test_small_static_graphs_on_cpu_replay_their_recording_and_not_the_forward() -> None:
    rig = make_rig(k=1)
    capturer = GraphCapturer(rig.runner, "static", capture_sizes=[1, 2, 4, 8])
    graphs = capturer.capture().graphs
    assert graphs and all(g.program is not None and g.not_recorded == "" for g in graphs)
    assert all(g.program.kernel_calls > 0 for g in graphs if g.program is not None)
    forwards = count_forwards(capturer)
    for g in graphs:
        g.replay_fn()
        replayed = g.output.clone()
        # The replay ran no forward; the forward over the same loaded buffers gives the same bits.
        assert forwards[g.spec.label] == 0
        assert torch.equal(replayed, capturer.forward(g.spec, g.metas)[0])
    checks = verify_graphs(capturer, graphs, rig.manager)
    assert checks and all(c.verified and c.max_abs_diff == 0.0 for c in checks), checks


def test_graphs_past_the_recording_limit_run_their_forward_and_the_notes_say_why(monkeypatch) -> None:
    monkeypatch.setattr(capture_module, "RECORD_MAX_TOKENS", 2)
    rig = make_rig(k=1)
    result = GraphCapturer(rig.runner, "static", capture_sizes=[1, 2, 4, 8]).capture()
    recorded = {g.spec.num_tokens for g in result.graphs if g.program is not None}
    assert recorded and max(recorded) <= 2
    big = [g for g in result.graphs if g.program is None]
    assert big and all("past the recording limit of 2" in g.not_recorded for g in big)
    (note,) = [n for n in result.notes if n.startswith("static on CPU")]
    assert f"{len(result.graphs) - len(big)} of {len(result.graphs)} graphs replay a recorded program" in note
    assert "past the recording limit of 2" in note


def test_recorded_graphs_serve_the_same_tokens_as_eager_after_a_long_prefill() -> None:
    """A long eager prefill between start-up and the recorded decode steps outgrows every scratch
    buffer the recordings point at; tokens stay those of an engine without graphs."""
    prompts = [[(7 * i + 3) % 400 + 20 for i in range(300)], list(range(30, 42))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs = {"device": "cpu", "max_num_seqs": 4, "max_model_len": 400, "max_num_batched_tokens": 512}
    eager = LLM("tiny-llama", enforce_eager=True, **kwargs)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    llm = LLM("tiny-llama", **kwargs)
    graphs = llm.engine.runner.graphs
    assert all(
        g.program is not None
        for by in graphs._graphs.values()
        for g in by.values()
        if g.spec.num_tokens <= 32
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert sum(graphs.replays.values()) >= 20


def test_recording_can_be_turned_off_and_keeps_its_own_start_up_verdicts(tmp_path, monkeypatch) -> None:
    """``record_cpu_graphs=False`` (``--no-record-cpu-graphs``): every replay runs the forward, the
    notes say so, tokens are the recorded engine's; the start-up cache keeps the two apart (the
    graphs replay different code)."""
    monkeypatch.setenv("WARMCAP_STARTUP_CACHE", str(tmp_path))
    prompts = [list(range(30, 42)), list(range(50, 57))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = {"device": "cpu", "max_num_seqs": 2, "max_model_len": 64, "capture_sizes": (1, 2)}
    recorded = LLM("tiny-llama", **kwargs)
    want = [o.outputs[0].token_ids for o in recorded.generate(prompts, params)]
    recorded.shutdown()
    off = LLM("tiny-llama", record_cpu_graphs=False, **kwargs)
    startup = off.engine.graph_startup
    graphs = [g for by in off.engine.runner.graphs._graphs.values() for g in by.values()]
    assert graphs and all(g.program is None and "recording is off" in g.not_recorded for g in graphs)
    assert any("0 of" in n and "recording is off" in n for n in startup.notes)
    assert startup.startup_cache is not None and startup.startup_cache.hits == 0
    assert [o.outputs[0].token_ids for o in off.generate(prompts, params)] == want
    assert sum(off.engine.runner.graphs.replays.values()) > 0
    off.shutdown()


def test_a_recording_replays_on_another_thread_while_this_one_runs_the_same_kernel(cpu_gemm: Gemm) -> None:
    """Two engines in one process: one replays its recording on a serving thread while the thread
    that recorded it runs the same GEMM eagerly; the recording works in buffers of its own, so
    neither sees the other's partial products."""
    import threading

    gen = torch.Generator().manual_seed(5)
    weight = BlockedWeight.pack(torch.randn(256, 512, generator=gen))
    x = torch.randn(16, 512, generator=gen)
    out, program = record(lambda: cpu_gemm.linear(x, weight))
    assert isinstance(program, CpuProgram)
    want = cpu_gemm.linear(x, weight).clone()
    other = torch.randn(16, 512, generator=gen)
    other_want = cpu_gemm.linear(other, weight).clone()
    wrong: list[str] = []

    def serve() -> None:
        for i in range(300):
            program.replay()
            if not torch.equal(out, want):
                wrong.append(f"replay {i}")
                return

    t = threading.Thread(target=serve)
    t.start()
    while t.is_alive():
        if not torch.equal(cpu_gemm.linear(other, weight), other_want):
            wrong.append("eager")
            break
    t.join()
    assert wrong == []
