"""A server on CPU runs a model thread on every core it may use unless told otherwise (BENCHMARKS.md,
"vLLM as the peer again on AVX2": on two cores, two model threads serve more than one at 1, 8 and 32
clients), an explicit ``--model-threads`` or ``OMP_NUM_THREADS`` wins."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from warmcap.cli import app
from warmcap.errors import ConfigError
from warmcap.serve.server import serving_model_threads


def test_cpu_server_runs_a_model_thread_on_every_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert serving_model_threads("cpu", None) == len(os.sched_getaffinity(0))
    # the cores this process may use, not the machine's: a server confined to one core runs one
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert serving_model_threads("cpu", None) == 1
    finally:
        os.sched_setaffinity(0, before)


def test_an_explicit_choice_wins_and_the_environment_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert serving_model_threads("cpu", 3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert serving_model_threads("cpu", None) is None  # torch already follows OMP_NUM_THREADS
    assert serving_model_threads("cuda", None) is None


def test_zero_model_threads_is_refused_on_one_line() -> None:
    with pytest.raises(ConfigError, match="--model-threads 0"):
        serving_model_threads("cpu", 0)
    res = CliRunner().invoke(app, ["serve", "--model", "tiny-llama", "--model-threads", "0", "--port", "1"])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "--model-threads 0" in res.output
