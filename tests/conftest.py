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
