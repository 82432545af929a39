"""A server on CPU leaves one core to its HTTP side unless told otherwise (BENCHMARKS.md: on two
cores a second model thread made serving slower, not faster)."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from warmcap.cli import app
from warmcap.errors import ConfigError
from warmcap.serve.server import serving_model_threads


def test_cpu_server_leaves_one_core_to_http(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert serving_model_threads("cpu", None) == max(1, cores - 1)


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
