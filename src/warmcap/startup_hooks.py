"""Start-up hooks: what they are given and how their results are named.

A hook runs once the engine's KV cache manager, scheduler and runner exist, before the first
request. It gets a :class:`StartupContext` (never the engine, so hooks need not import it) and
returns its result, which the engine keeps under :func:`hook_name` in ``startup_results``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from warmcap.config import EngineConfig
    from warmcap.core.kv_cache_manager import KVCacheManager
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.runner_v2.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class StartupContext:
    """The parts of a started engine a start-up hook may use."""

    config: EngineConfig
    device: torch.device
    kv_groups: list[KVCacheGroup]
    num_blocks: int
    kv_cache_manager: KVCacheManager
    runner: ModelRunner


#: ``hook(context) -> result`` (None when the hook had nothing to do)
StartupHook = Callable[[StartupContext], Any]


def hook_name(hook: StartupHook) -> str:
    """The name a hook's result is kept under: its function's name without a ``_hook`` suffix
    (``warmup_hook`` -> ``warmup``); a ``functools.partial`` is named after its function."""
    func = getattr(hook, "func", hook)
    name = getattr(func, "__name__", None) or type(func).__name__
    return name.removesuffix("_hook")
