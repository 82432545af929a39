"""KV groups of a model (and its drafter), built the same way for serving and for planning.

``plan`` on a laptop needs the groups without the weights: :func:`kv_groups_from_config` builds the
model on the meta device (no memory, no checkpoint) and asks it for its layer specs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from warmcap.config import EngineConfig
from warmcap.core.kv_spec import KVCacheGroup, group_layers
from warmcap.errors import ConfigError


def build_kv_groups(
    model: Any, config: EngineConfig, drafter_groups: Sequence[KVCacheGroup] = ()
) -> list[KVCacheGroup]:
    """Target groups (layers with equal specs share one) followed by the drafter's own groups."""
    groups = group_layers(model.kv_layer_specs(config.cache.block_size))
    taken = {g.name for g in groups}
    clash = [g.name for g in drafter_groups if g.name in taken]
    if clash:
        raise ConfigError(f"drafter KV group names {clash} collide with the target's: prefix them with 'draft.'")
    return [*groups, *drafter_groups]


def meta_model(model_path: Path, config: EngineConfig) -> tuple[Any, Any]:
    """(model on the meta device, HF config): layer specs without loading a single weight."""
    from warmcap.models.loader import load_hf_config
    from warmcap.models.registry import model_class
    from warmcap.runner_v2.model_runner import TORCH_DTYPES

    hf_config = load_hf_config(model_path)
    cls = model_class(hf_config.architectures[0])
    with torch.device("meta"):
        model = cls(hf_config, dtype=TORCH_DTYPES[config.model.dtype])
    return model, hf_config


def model_max_len(hf_config: Any) -> int | None:
    """The context limit the checkpoint states, if any."""
    value = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    return value or None
