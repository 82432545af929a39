"""The model threads of a CPU engine (``kernels/cpu/threads.py``) and the one OpenMP runtime they
run on (``kernels/cpu/build.py``): the kernels use torch's runtime, the ranks of a tensor-parallel
group never run more threads than there are cores, and pinning pins the threads that do the work."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from warmcap.config import EngineConfig
from warmcap.errors import ConfigError
from warmcap.kernels.cpu import build
from warmcap.kernels.cpu.threads import SPIN_COUNT, ThreadPlan, plan_threads

KERNELS = ("gemm.c", "layer_ops.c", "paged_attention.c", "threads.c")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=600
    )


def test_every_kernel_loaded_leaves_one_openmp_runtime_in_the_process():
    done = _python(
        f"""
        import torch
        from warmcap.kernels.cpu.build import load_library, mapped_openmp_runtimes
        for source in {KERNELS!r}:
            load_library(source)
        print(*mapped_openmp_runtimes(), sep="\\n")
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runtimes = done.stdout.split()
    assert len(runtimes) == 1, f"more than one OpenMP runtime mapped: {runtimes}"
    torch_dir = Path(torch.__file__).parent.resolve()
    assert torch_dir in Path(runtimes[0]).resolve().parents, f"{runtimes[0]} is not torch's own runtime"


def test_a_kernel_loaded_without_torch_brings_torchs_runtime_not_the_compilers():
    """What ``ldd`` on a kernel in the cache shows: the library names torch's runtime and finds it
    through its rpath, so no process can pair it with the compiler's ``libgomp``."""
    lib = build.load_library("gemm.c")
    path = Path(lib._name)
    runtime = build.openmp_runtime()
    assert runtime is not None
    done = _python(
        f"""
        import ctypes, sys
        ctypes.CDLL({str(path)!r})
        assert "torch" not in sys.modules
        from warmcap.kernels.cpu.build import mapped_openmp_runtimes
        print(*mapped_openmp_runtimes(), sep="\\n")
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [Path(p).resolve() for p in done.stdout.split()] == [runtime.resolve()]


def test_the_runtime_is_part_of_the_kernel_key(monkeypatch):
    cc = build.compiler()
    assert cc is not None
    before = build.library_path("gemm.c", cc)
    monkeypatch.setattr(build, "link_flags", lambda: ("-shared", "/elsewhere/libgomp.so.1"))
    assert build.library_path("gemm.c", cc) != before


def test_mapped_runtimes_are_counted_by_file(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r--p 00000000 08:01 111 /venv/torch/lib/libgomp.so.1\n"
        "7f01-7f02 r-xp 00001000 08:01 111 /venv/torch/lib/libgomp.so.1\n"
        "7f03-7f04 r-xp 00000000 08:01 222 /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0\n"
        "7f05-7f06 r-xp 00000000 08:01 333 /venv/torch/lib/libgomp-a34b3233.so.1\n"
        "7f07-7f08 r-xp 00000000 08:01 444 /usr/lib/libgompish.so\n"
        "7f09-7f0a rw-p 00000000 00:00 0 \n"
    )
    assert build.mapped_openmp_runtimes(str(maps)) == [
        Path("/venv/torch/lib/libgomp.so.1"),
        Path("/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0"),
        Path("/venv/torch/lib/libgomp-a34b3233.so.1"),
    ]


# ---- the plan ------------------------------------------------------------------------------------


@given(cores=st.integers(1, 32), ranks=st.integers(1, 8), bind=st.sampled_from(["auto", "none"]))
def test_tensor_parallel_ranks_never_run_more_threads_than_cores(cores, ranks, bind):
    cpus = list(range(100, 100 + cores))
    plans = [plan_threads(None, bind, rank=r, ranks=ranks, cpus=cpus, current=cores) for r in range(ranks)]
    assert all(p.threads >= 1 for p in plans)
    # More ranks than cores: one thread each is the least a rank can run.
    assert sum(p.threads for p in plans) <= max(cores, ranks)
    for p in plans:
        assert set(p.cpus) <= set(cpus) and len(p.cpus) >= min(p.threads, len(p.cpus))
    if ranks <= cores:
        pinned = [c for p in plans for c in p.cpus]
        assert len(pinned) == len(set(pinned)), "two ranks share a core"
        assert all(p.pin == (bind == "auto") for p in plans)


def test_one_rank_keeps_torchs_count_and_several_split_the_cores():
    assert plan_threads(None, "auto", cpus=[0, 1], current=2) == ThreadPlan(
        2, (0, 1), True, "2 thread(s) pinned to cores 0,1, 2 core(s)"
    )
    # The caller asked torch for more threads than cores: kept, but not pinned.
    many = plan_threads(None, "auto", cpus=[0, 1], current=3)
    assert (many.threads, many.pin) == (3, False)
    halves = [plan_threads(None, "auto", rank=r, ranks=2, cpus=[0, 1, 2, 3], current=4) for r in range(2)]
    assert [(p.threads, p.cpus) for p in halves] == [(2, (0, 1)), (2, (2, 3))]
    # OMP_NUM_THREADS=1 (torch's count 1) caps each rank's share.
    assert plan_threads(None, "auto", rank=1, ranks=2, cpus=[0, 1, 2, 3], current=1).cpus == (2,)


def test_threads_per_rank_are_honoured_or_refused_with_the_reason():
    assert plan_threads(1, "auto", rank=1, ranks=2, cpus=[0, 1, 2, 3]).cpus == (2,)
    with pytest.raises(
        ConfigError, match=r"cpu_threads=3 is more than the 2 core\(s\) of rank 0.*cpu_threads_bind=none"
    ):
        plan_threads(3, "auto", rank=0, ranks=2, cpus=[0, 1, 2, 3])
    unpinned = plan_threads(3, "none", rank=0, ranks=2, cpus=[0, 1, 2, 3])
    assert (unpinned.threads, unpinned.pin) == (3, False)


def test_cpu_lists_pin_each_rank_where_told():
    assert plan_threads(None, "3|1", rank=0, ranks=2, cpus=[0, 1, 2, 3]).cpus == (3,)
    assert plan_threads(None, "0-3", rank=1, ranks=2, cpus=[0, 1, 2, 3]).cpus == (2, 3)
    with pytest.raises(ConfigError, match=r"names core\(s\) \[7\] this process may not use"):
        plan_threads(None, "0,7", cpus=[0, 1])
    with pytest.raises(ConfigError, match="gives 3 CPU lists for 2 tensor-parallel ranks"):
        plan_threads(None, "0|1|2", rank=0, ranks=2, cpus=[0, 1, 2])
    with pytest.raises(ConfigError, match=r"only 1 core\(s\)"):
        plan_threads(2, "0|1", rank=0, ranks=2, cpus=[0, 1])


@pytest.mark.parametrize("bad", ["all", "0-", "1-0", "0,,1", "0|", "first"])
def test_a_bad_bind_is_refused_by_the_config(bad):
    with pytest.raises(ConfigError, match="cpu_threads_bind"):
        plan_threads(None, bad, cpus=[0, 1, 2])
    if bad != "1-0":  # a reversed range is caught when it is parsed
        with pytest.raises(ConfigError, match="cpu_threads_bind"):
            EngineConfig(cpu_threads_bind=bad)


def test_the_cli_refuses_a_bad_bind_in_one_line():
    from typer.testing import CliRunner

    from warmcap.cli import app

    result = CliRunner().invoke(app, ["plan", "--model", "tiny-llama", "--cpu-threads-bind", "cores"])
    assert result.exit_code == 2, result.output
    assert "cpu_threads_bind 'cores' is not auto, none or a CPU list" in result.output
    assert "Traceback" not in result.output


# ---- applied -------------------------------------------------------------------------------------


def _allowed(tid: int) -> str:
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for thread {tid}")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux-only")
def test_an_engine_pins_its_team_and_gives_its_thread_back_between_steps():
    from warmcap.sampling_params import SamplingParams

    threads = min(2, len(os.sched_getaffinity(0)))
    before = os.sched_getaffinity(0)
    saved = torch.get_num_threads()
    try:
        llm = _small_engine(threads)
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        plan = llm.engine.cpu_threads.plan
        assert plan.pin and plan.threads == threads == torch.get_num_threads()
        tids = llm.engine.cpu_threads.team_tids
        assert len(tids) == threads and tids[0] == threading_native_id()
        # The pool threads stay on their cores; the engine's thread has its own cores back.
        assert [_allowed(t) for t in tids[1:]] == [str(c) for c in plan.cpus[1:]]
        assert os.sched_getaffinity(0) == before
    finally:
        torch.set_num_threads(saved)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux-only")
def test_generate_pins_once_around_its_steps_not_once_a_step(monkeypatch):
    from warmcap.sampling_params import SamplingParams

    before = os.sched_getaffinity(0)
    saved = torch.get_num_threads()
    try:
        llm = _small_engine(min(2, len(before)))
        plan = llm.engine.cpu_threads.plan
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        llm.generate([[5, 6, 7]], params)  # the team is pinned by the first step
        calls: list[object] = []
        real = os.sched_setaffinity
        steps = {"n": 0}
        real_step = llm.engine.step

        def counted_step():
            steps["n"] += 1
            # Inside generate, between steps, the thread stays on the plan's first core.
            assert os.sched_getaffinity(0) == ({plan.cpus[0]} if plan.pin else before)
            return real_step()

        monkeypatch.setattr(
            os, "sched_setaffinity", lambda pid, cpus: (calls.append(cpus), real(pid, cpus))[1]
        )
        monkeypatch.setattr(llm.engine, "step", counted_step)
        llm.generate([[5, 6, 7]], params)
        assert steps["n"] >= 12
        assert len(calls) == (2 if plan.pin else 0)  # pinned once, restored once
        assert os.sched_getaffinity(0) == before
    finally:
        torch.set_num_threads(saved)


def _small_engine(threads: int):
    from warmcap.llm import LLM

    return LLM(
        "tiny-llama", device="cpu", enforce_eager=True, max_num_seqs=2, max_model_len=64, cpu_threads=threads
    )


def threading_native_id() -> int:
    import threading

    return threading.get_native_id()


# ---- the wait policy -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("user", "expected"),
    [
        ({}, {"GOMP_SPINCOUNT": SPIN_COUNT}),
        ({"OMP_WAIT_POLICY": "active"}, {"OMP_WAIT_POLICY": "active"}),
        ({"GOMP_SPINCOUNT": "5"}, {"GOMP_SPINCOUNT": "5"}),
    ],
)
def test_importing_warmcap_first_gives_torchs_runtime_a_short_spin_unless_the_user_chose(user, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(user, PYTHONPATH=os.pathsep.join(sys.path))
    code = (
        "import os, sys\nimport warmcap\nassert 'torch' not in sys.modules\nimport torch\n"
        "print({k: os.environ[k] for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT') if k in os.environ})"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert eval(done.stdout) == expected
