from __future__ import annotations

import os

import pytest

# NOTE: both must be set before triton kernels or transformers are imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _private_startup_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """`warmup run` keeps a start-up cache by default: each test gets its own, empty one, so no
    test reads verdicts another wrote, nor writes into the user's cache."""
    monkeypatch.setenv("WARMCAP_STARTUP_CACHE", str(tmp_path_factory.mktemp("startup-cache")))


@pytest.fixture(scope="module")
def screen_on_every_cpu():
    """The screened greedy head (``models/greedy_head.py``) needs oneDNN's bf16 GEMM, which AVX2
    CPUs (many AMD ones among them) lack: there no head is built. Tests of the head's logic run it
    as the portable screen on such CPUs (``WARMCAP_EXACT_GREEDY_HEAD=portable``), so every CPU
    tests the same candidate test, re-score and runner path. Yields the mode in force."""
    from warmcap.models.greedy_head import ENV_SWITCH, can_screen

    if can_screen():
        yield "onednn"
        return
    before = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "portable"
    try:
        yield "portable"
    finally:
        if before is None:
            os.environ.pop(ENV_SWITCH, None)
        else:
            os.environ[ENV_SWITCH] = before


@pytest.fixture(scope="session")
def cpu_gemm():
    """The compiled CPU GEMM (``kernels/cpu/gemm.c``), built now: a test that asks for it fails,
    rather than silently testing oneDNN's product, where it cannot be built."""
    from warmcap.kernels.cpu.gemm import ENV, load_gemm

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, "kernel")
        loaded = load_gemm()
    assert loaded is not None
    return loaded


@pytest.fixture(scope="session")
def cpu_layer_ops():
    """The compiled CPU layer ops (``kernels/cpu/layer_ops.c``), built now: a test that asks for them
    fails, rather than silently testing torch's ops, where they cannot be built."""
    from warmcap.kernels.cpu.layer_ops import ENV, load_layer_ops

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, "kernel")
        loaded = load_layer_ops()
    assert loaded is not None
    return loaded
