"""Backends by KV kind: the registry checks what it is given, and model layers run through the
backend the runner registered for their kind (never one of their own)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from warmcap.contracts import (
    AttentionBackend,
    BackendRegistry,
    IndexerBackend,
    MambaBackend,
    MambaMetadata,
    MambaWeights,
    MLABackend,
)
from warmcap.engine import LLMEngine
from warmcap.errors import ConfigError
from warmcap.runner_v2.attention.indexer import TorchIndexerBackend
from warmcap.runner_v2.attention.mamba2 import TorchMambaBackend
from warmcap.runner_v2.attention.mla import TorchMLABackend
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention
from warmcap.sampling_params import SamplingParams


def test_a_backend_must_implement_its_kinds_interface() -> None:
    registry = BackendRegistry()
    with pytest.raises(ConfigError, match="'mla' must implement MLABackend; got TorchPagedAttention"):
        registry.register("mla", TorchPagedAttention())
    with pytest.raises(ConfigError, match="'mamba' must implement MambaBackend; got TorchMLABackend"):
        registry.register("mamba", TorchMLABackend())
    with pytest.raises(ConfigError, match="KV kind 'base' takes no backend"):
        registry.register("base", TorchPagedAttention())


def test_a_kind_without_a_backend_is_named() -> None:
    registry = BackendRegistry({"full": TorchPagedAttention()})
    with pytest.raises(
        ConfigError, match=r"no backend registered for KV kind 'mla' \(registered: \['full'\]\)"
    ):
        registry.get("mla", MLABackend)
    with pytest.raises(TypeError, match="not the MLABackend the layer calls"):
        registry.get("full", MLABackend)
    assert isinstance(registry.get("full", AttentionBackend), TorchPagedAttention)


class RecordingMLA(TorchMLABackend):
    """The torch MLA backend, noting which cache (so which layer) each call serves."""

    def __init__(self) -> None:
        super().__init__()
        self.caches: list[int] = []

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        kv_cache: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        self.caches.append(id(kv_cache))
        return super().forward(q_nope, q_pe, latent, kv_cache, *args, **kwargs)


class RecordingIndexer(TorchIndexerBackend):
    def __init__(self) -> None:
        self.caches: list[int] = []

    def select(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        self.caches.append(id(kv_cache))
        return super().select(q, k, weights, kv_cache, *args, **kwargs)


class RecordingMamba(TorchMambaBackend):
    def __init__(self) -> None:
        self.caches: list[int] = []

    def forward(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        state: torch.Tensor,
        meta: MambaMetadata,
        weights: MambaWeights,
    ) -> torch.Tensor:
        self.caches.append(id(state))
        return super().forward(xbc, dt, state, meta, weights)


def _engine(model: str = "tiny-deepseek-v32") -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=model, dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=32),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64),
    )
    return LLMEngine(config, startup_hooks=[])


def _generate(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = engine.generate(
        [[5, 9, 2, 7, 1, 3, 8, 4, 6, 11, 13, 12, 10, 14, 15, 16, 17, 18], [4, 4, 2]], [params] * 2
    )
    return [o.token_ids for o in outs]


def test_mla_and_indexer_layers_use_the_backends_the_runner_registered() -> None:
    engine = _engine()
    want = _generate(engine)
    engine = _engine()
    runner = engine.runner
    mla, indexer = RecordingMLA(), RecordingIndexer()
    runner.backends.register("mla", mla)
    runner.backends.register("indexer", indexer)
    got = _generate(engine)
    assert got == want
    kinds = {g.name: g.spec.kind for g in runner.kv_groups}
    layers_of = {
        kind: {
            id(runner.kv_caches.tensors[layer])
            for g in runner.kv_groups
            if kinds[g.name] == kind
            for layer in g.layer_names
        }
        for kind in ("mla", "indexer")
    }
    assert layers_of["mla"] and layers_of["indexer"]
    # Every MLA (indexer) layer ran through the registered backend, at every forward, and nothing else did.
    assert set(mla.caches) == layers_of["mla"]
    assert set(indexer.caches) == layers_of["indexer"]
    forwards = len(mla.caches) // len(layers_of["mla"])
    assert forwards >= 4 and len(mla.caches) == forwards * len(layers_of["mla"])
    assert len(indexer.caches) == forwards * len(layers_of["indexer"])
    assert isinstance(runner.backends.get("indexer", IndexerBackend), RecordingIndexer)


def test_mamba_layers_use_the_backend_the_runner_registered() -> None:
    want = _generate(_engine("tiny-hybrid"))
    engine = _engine("tiny-hybrid")
    runner = engine.runner
    mamba = RecordingMamba()
    runner.backends.register("mamba", mamba)
    got = _generate(engine)
    assert got == want
    layers = {
        id(runner.kv_caches.tensors[layer])
        for g in runner.kv_groups
        if g.spec.kind == "mamba"
        for layer in g.layer_names
    }
    assert layers
    # Every Mamba layer ran through the registered backend at every forward, and nothing else did.
    assert set(mamba.caches) == layers
    forwards = len(mamba.caches) // len(layers)
    assert forwards >= 4 and len(mamba.caches) == forwards * len(layers)
    assert isinstance(runner.backends.get("mamba", MambaBackend), RecordingMamba)
