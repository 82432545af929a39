"""KV groups of a model (and its drafter), built the same way for serving and for planning.

``plan`` on a laptop needs the groups without the weights: :func:`meta_model` builds the model on
the meta device (no memory, no checkpoint) so it can be asked for its layer specs; ``assembly.py``
turns either kind of model into groups and a pool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from warmcap.config import EngineConfig
from warmcap.core.kv_spec import KVCacheGroup, KVSpec, group_layers
from warmcap.errors import ConfigError


def layer_specs(model: Any, config: EngineConfig, block_size: int | None = None) -> dict[str, KVSpec]:
    """``model.kv_layer_specs`` with the engine's settings, the same for every model family:
    ``(block_size, *, mamba_cache_mode, num_speculative_blocks, max_model_len)``.

    Attention-only models ignore the Mamba options. A hybrid gives its Mamba groups ``1 + k`` state
    slots (``num_speculative_blocks`` = k draft tokens) and, in cache mode ``none``, a block of
    ``max_model_len`` tokens (one block holds the whole state, so the rule gives ``1 + k`` blocks).
    ``block_size`` defaults to the cache config's; ``max_model_len`` is passed once resolved.
    """
    return model.kv_layer_specs(
        block_size or config.cache.block_size,
        mamba_cache_mode=config.cache.mamba_cache_mode,
        num_speculative_blocks=config.num_speculative_tokens,
        max_model_len=config.scheduler.max_model_len,
    )


def build_kv_groups(model: Any, config: EngineConfig, drafter: Any = None) -> list[KVCacheGroup]:
    """Target groups (layers with equal specs share one) followed by the drafter's own groups, so
    the pool is sized for both and the manager reserves the drafter's blocks by the same rule."""
    groups = group_layers(layer_specs(model, config))
    drafter_groups = drafter.kv_groups(config.cache.block_size) if drafter is not None else []
    taken = {g.name for g in groups}
    clash = [g.name for g in drafter_groups if g.name in taken]
    if clash:
        raise ConfigError(
            f"drafter KV group names {clash} collide with the target's: prefix them with 'draft.'"
        )
    return [*groups, *drafter_groups]


def meta_model(model_path: Path, config: EngineConfig) -> tuple[Any, Any]:
    """(model on the meta device, HF config): layer specs without loading a single weight."""
    from warmcap.models.dtypes import TORCH_DTYPES
    from warmcap.models.loader import load_hf_config
    from warmcap.models.registry import model_class

    hf_config = load_hf_config(model_path)
    cls = model_class(hf_config.architectures[0])
    with torch.device("meta"):
        model = cls(hf_config, dtype=TORCH_DTYPES[config.model.dtype])
    return model, hf_config
