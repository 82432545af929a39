"""The thread budget of a tensor-parallel engine on CPU (``kernels/cpu/threads.py``): the ranks split
the cores, each rank's threads pinned to its own share, and the workers start with a short OpenMP
spin."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from warmcap.errors import ConfigError
from warmcap.kernels.cpu.threads import SPIN_COUNT, plan_threads, process_cpus
from warmcap.llm import LLM
from warmcap.sampling_params import SamplingParams

SMALL = {"max_model_len": 64, "max_num_seqs": 2, "enforce_eager": True, "device": "cpu"}


def _status(pid: int, tid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if b"=" in item)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux-only")
def test_tp2_ranks_run_on_their_own_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cpus = process_cpus()
    llm = LLM("tiny-llama", tensor_parallel_size=2, **SMALL)
    try:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
        rank0 = llm.engine.cpu_threads.plan
        (worker,) = llm.engine.executor.worker_pids
        rank1 = plan_threads(None, "auto", rank=1, ranks=2, cpus=cpus, current=len(cpus))
        assert rank0.threads + rank1.threads <= max(len(cpus), 2)
        main = _status(worker, worker)
        if len(cpus) >= 2:
            assert rank0.pin and not set(rank0.cpus) & set(rank1.cpus)
            # The worker's own thread (OpenMP's thread 0 of its team) stays on its first core.
            assert main["Cpus_allowed_list"] == str(rank1.cpus[0])
        else:
            assert not rank0.pin and rank0.threads == 1
        assert _environ(worker).get("GOMP_SPINCOUNT") == SPIN_COUNT
    finally:
        llm.shutdown()


def test_threads_per_rank_beyond_the_share_are_refused_before_any_worker_starts():
    cores = len(process_cpus())
    with pytest.raises(ConfigError, match=r"cpu_threads=\d+ is more than the \d+ core"):
        LLM("tiny-llama", tensor_parallel_size=2, cpu_threads=cores + 1, **SMALL)
