"""The ``auto``/``torch``/``kernel`` switch of the kernel families loaded at model load (the layer
ops and the GEMM): ``torch`` never builds, an unknown value is a clear error, ``auto`` without a
compiler warns once and falls back, ``kernel`` without one fails start-up."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from warmcap.errors import ConfigError
from warmcap.kernels.cpu import gemm, layer_ops


@pytest.mark.parametrize(
    ("env", "load"),
    [(layer_ops.ENV, layer_ops.load_layer_ops), (gemm.ENV, gemm.load_gemm)],
    ids=["layer_ops", "gemm"],
)
def test_the_switch(env: str, load: Callable[..., object], monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv(env, "torch")
    assert load() is None
    monkeypatch.setenv(env, "quick")
    with pytest.raises(ConfigError, match=rf"'quick' \(from \${env}\) is not one of auto, torch, kernel"):
        load()
    with pytest.raises(ConfigError, match="'quick' is not a CPU kernel mode; use one of auto, torch, kernel"):
        load("quick")
    monkeypatch.setenv("WARMCAP_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv(env, "auto")
    with caplog.at_level(logging.WARNING, logger="warmcap.models"):
        assert load() is None
    flag = "--cpu-layer-ops" if load is layer_ops.load_layer_ops else "--cpu-gemm"
    assert "/nonexistent/cc" in caplog.text and f"{flag} torch" in caplog.text
    monkeypatch.setenv(env, "kernel")
    with pytest.raises(ConfigError, match="cannot be built"):
        load()
