"""Ranks started by a launcher (the multi-node launch), on loopback: every rank its own process,
told its rank by ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK``, as on several machines.
Each test starts its processes on 127.0.0.1 at a free port, waits a bounded time and kills what is
left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from warmcap.distributed import free_port

CLI = [sys.executable, "-c", "from warmcap.cli import main; main()"]
PROMPT = ["--prompt", "The quick brown fox", "--no-chat", "--max-tokens", "12", "-q"]
GENERATE = [*CLI, "generate", "-m", "tiny-llama", *PROMPT]
TIMEOUT_S = 240


def launch_env(rank: int, port: int, world_size: int = 2) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "HF_HUB_OFFLINE": "1",
    }
    return env


@contextmanager
def started(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """``cmd`` running with its output in ``log``; killed on the way out if still alive."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


def wait_for(proc: subprocess.Popen, log: Path, timeout_s: float = TIMEOUT_S) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{proc.args[3:6]} did not finish within {timeout_s} s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("worker", ["warmup worker", "same command"])
def test_launched_ranks_generate_what_one_device_does(tmp_path, worker):
    port = free_port()
    one_device = subprocess.run(GENERATE, capture_output=True, text=True, timeout=TIMEOUT_S, check=True)
    rank1_cmd = [*CLI, "worker"] if worker == "warmup worker" else [*GENERATE, "-tp", "2"]
    # The worker first, as on another machine: it waits for rank 0 to open the group.
    with (
        started(rank1_cmd, launch_env(1, port), tmp_path / "rank1.log") as rank1,
        started([*GENERATE, "-tp", "2"], launch_env(0, port), tmp_path / "rank0.log") as rank0,
    ):
        assert wait_for(rank0, tmp_path / "rank0.log") == 0, (tmp_path / "rank0.log").read_text()
        # Rank 0 shutting its engine down is what ends the worker, with status 0.
        assert wait_for(rank1, tmp_path / "rank1.log", 60) == 0, (tmp_path / "rank1.log").read_text()
    assert (tmp_path / "rank0.log").read_text().strip() == one_device.stdout.strip() != ""
    assert one_device.stdout.strip() not in (tmp_path / "rank1.log").read_text()


RANK0_SCRIPT = """
import sys
from warmcap import LLM, SamplingParams
llm = LLM("tiny-llama", tensor_parallel_size=2, enforce_eager=True)
print("ready", flush=True)
params = SamplingParams(max_tokens=900, ignore_eos=True)
for _ in range(10_000):
    llm.generate(["The quick brown fox"], params, use_tqdm=False)
"""


@pytest.mark.slow
def test_killing_a_launched_worker_names_its_rank_within_seconds(tmp_path):
    port = free_port()
    log0 = tmp_path / "rank0.log"
    with (
        started([*CLI, "worker", "-q"], launch_env(1, port), tmp_path / "rank1.log") as rank1,
        started([sys.executable, "-c", RANK0_SCRIPT], launch_env(0, port), log0) as rank0,
    ):
        deadline = time.monotonic() + TIMEOUT_S
        while "ready" not in log0.read_text():
            assert rank0.poll() is None, log0.read_text()
            assert time.monotonic() < deadline, "rank 0 never became ready"
            time.sleep(0.2)
        time.sleep(1.0)  # mid-generation
        rank1.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        code = wait_for(rank0, log0, 60)
        took = time.monotonic() - killed_at
    out = log0.read_text()
    assert code != 0
    assert "tensor-parallel rank 1 failed: it stopped answering" in out, out[-3000:]
    assert took < 20, f"rank 0 took {took:.1f} s to fail"


RAISING_RANK0_SCRIPT = """
from tp_ranks import fail_on_worker
from warmcap.engine import LLMEngine
from warmcap.llm import build_config
LLMEngine(build_config("tiny-llama", tensor_parallel_size=2, enforce_eager=True), startup_hooks=[fail_on_worker])
"""


@pytest.mark.slow
def test_a_launched_worker_that_raises_is_named_with_its_own_error(tmp_path):
    port = free_port()
    # Both ranks import the start-up hook that raises on rank 1 (tests/distributed/tp_ranks.py).
    here = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    log0, log1 = tmp_path / "rank0.log", tmp_path / "rank1.log"
    with (
        started([*CLI, "worker"], launch_env(1, port) | {"PYTHONPATH": path}, log1) as rank1,
        started(
            [sys.executable, "-c", RAISING_RANK0_SCRIPT], launch_env(0, port) | {"PYTHONPATH": path}, log0
        ) as rank0,
    ):
        assert wait_for(rank0, log0) != 0
        assert wait_for(rank1, log1, 60) == 1
    assert "tensor-parallel rank 1 failed: RuntimeError: deliberate failure on the worker" in log0.read_text()
    assert "deliberate failure on the worker" in log1.read_text()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "1"}, "RANK=1 is set but MASTER_ADDR, MASTER_PORT, WORLD_SIZE are not"),
        (
            {"RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "2"},
            "a rank must be in 0..WORLD_SIZE-1",
        ),
        (
            {"RANK": "x", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "2"},
            "RANK='x' is not an integer",
        ),
        ({}, "but RANK is not set"),
        ({"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "2"}, "but RANK is 0"),
    ],
)
def test_warmup_worker_refuses_a_bad_launch_environment(env, message):
    clean = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
    }
    res = subprocess.run([*CLI, "worker"], env=clean | env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr


def test_a_worker_without_rank0_gives_up_with_a_clear_error():
    env = launch_env(1, free_port())
    res = subprocess.run(
        [*CLI, "worker", "--timeout", "2"], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 1
    assert "could not join the group at 127.0.0.1" in res.stderr
    assert "Traceback" not in res.stderr and "frame #" not in res.stderr


def test_rank0_world_size_must_match_tensor_parallel_size():
    env = launch_env(0, free_port(), world_size=3)
    res = subprocess.run([*GENERATE, "-tp", "2"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "WORLD_SIZE=3 in the environment but tensor_parallel_size = 2" in res.stderr


def test_an_engine_in_a_worker_rank_is_refused(monkeypatch):
    from warmcap import LLM
    from warmcap.errors import ConfigError

    for key, value in launch_env(1, free_port()).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="RANK=1 in the environment: this process is a worker"):
        LLM("tiny-llama", tensor_parallel_size=2)
