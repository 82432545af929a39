"""Start-up assembly: a config, the model's HF config, the model and its drafter -> the finished
config, the KV groups and the pool size. ``LLMEngine.__init__`` (``engine.py``) and ``warmup plan``
(``cli.py``) both call :func:`assemble`, so the plan printed is the plan run.

The model may be loaded or on the meta device: nothing here reads a weight's values or where it
lives. The KV groups come from layer specs (``kv_layout.py``) and the pool from spec arithmetic
(``kv_sizing.py``) over the memory free *before* the weights load, less the weights' bytes counted
from their shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from warmcap.config import EngineConfig
from warmcap.core.kv_spec import KVCacheGroup
from warmcap.drafters import build_drafter
from warmcap.errors import ConfigError
from warmcap.kv_layout import build_kv_groups, meta_model
from warmcap.kv_sizing import free_memory_bytes, num_kv_blocks
from warmcap.models.loader import load_hf_config
from warmcap.models.packed_linear import prepacked_bytes
from warmcap.models.presets import resolve_model


@dataclass(frozen=True, slots=True)
class Assembly:
    """What start-up builds the KV cache manager, the scheduler and the runner from."""

    #: ``max_model_len`` filled from the model when the user gave none, checked against its limit
    config: EngineConfig
    #: the target's groups, then the drafter's (``draft.``-prefixed)
    kv_groups: list[KVCacheGroup]
    #: pool size in blocks, null block 0 included
    num_blocks: int
    #: the drafter the groups were built with (None without speculation); ``warmup plan`` reads
    #: the passes its model runs, to plan the drafter's graphs
    drafter: Any = field(default=None, compare=False)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when present, else CPU; any other name as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def model_max_len(hf_config: Any) -> int | None:
    """The context limit the checkpoint states (``max_position_embeddings``), if any."""
    value = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    return value or None


def finish_config(config: EngineConfig, hf_config: Any) -> EngineConfig:
    """``config`` with ``max_model_len`` resolved: the user's, checked against the model's limit,
    else the model's. A model that states no limit needs an explicit one.

    The architecture is checked first: a context limit is no use to a model warmcap cannot run."""
    from warmcap.models.registry import check_architecture

    check_architecture(hf_config.architectures[0])
    limit = model_max_len(hf_config)
    if limit is not None:
        config.validate_against(model_max_len=limit)
    if config.scheduler.max_model_len is not None:
        return config
    if limit is None:
        raise ConfigError(
            f"model {config.model.model!r} states no context limit (max_position_embeddings is "
            "missing or 0 in its config.json): set --max-model-len (LLM(..., max_model_len=N))"
        )
    return config.with_max_model_len(limit)


def resolve_async_scheduling(
    config: EngineConfig, device: torch.device, kv_groups: list[KVCacheGroup]
) -> EngineConfig:
    """``config`` with ``scheduler.async_scheduling`` decided. Auto (None): on for one CUDA device
    with no drafter, no P/D and no Mamba state (there a step's scheduling and output work hide
    behind the device's forward); off elsewhere: on CPU the forward runs on the host, so nothing
    overlaps, and a drafter proposes from a step's tokens within the step. True is refused where
    unsupported (Mamba state here; tensor parallelism and P/D by the config itself)."""
    from dataclasses import replace

    from warmcap.core.kv_spec import MambaSpec

    wanted = config.scheduler.async_scheduling
    stateful = [g.name for g in kv_groups if isinstance(g.spec, MambaSpec)]
    if wanted and stateful:
        raise ConfigError(
            f"async_scheduling is not supported for a model with Mamba state (groups {', '.join(stateful)}) "
            "yet: its state commits by each step's tokens; drop --async-scheduling"
        )
    if wanted is None:
        wanted = (
            device.type == "cuda"
            and not stateful
            and config.speculative is None
            and config.tensor_parallel_size == 1
            and config.kv_role == "none"
        )
    return replace(config, scheduler=replace(config.scheduler, async_scheduling=bool(wanted)))


def weight_bytes(*modules: nn.Module | None) -> int:
    """Bytes of every parameter and buffer of ``modules``, each tensor once (tied and shared weights,
    e.g. a drafter head reusing the target's embedding, count once). Computed from shapes and
    dtypes, so a model on the meta device counts what it will take once loaded."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        if module is None:
            continue
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def assemble(
    config: EngineConfig,
    hf_config: Any,
    model: nn.Module,
    drafter: Any,
    *,
    device: torch.device,
    free_bytes: int,
) -> Assembly:
    """The finished config, the KV groups (target then drafter) and the pool size.

    ``drafter`` is what ``drafters.build_drafter`` returned for ``model`` (``None`` without
    speculation). ``free_bytes`` is the memory ``device`` had free before any weight was loaded
    (:func:`warmcap.kv_sizing.free_memory_bytes` taken then); the weights of ``model`` and the
    drafter are subtracted here by shape, so a meta model and a loaded one get the same pool.
    """
    config = finish_config(config, hf_config)
    groups = build_kv_groups(model, config, drafter)
    after_weights = max(0, free_bytes - resident_bytes(config, device, model, *drafter_modules(drafter)))
    num_blocks = num_kv_blocks(config, groups, device, free_bytes=after_weights)
    return Assembly(config=config, kv_groups=groups, num_blocks=num_blocks, drafter=drafter)


def resident_bytes(
    config: EngineConfig, device: torch.device, model: nn.Module | None, *drafters: nn.Module | None
) -> int:
    """What the target ``model`` and the ``drafters``' modules hold in memory once loaded on
    ``device``: their weights, plus the packed copy each CPU linear keeps beside its weight
    (``models/packed_linear.py``) and the target's screened greedy head (``models/greedy_head.py``);
    left out, the KV pool would be sized into memory the process already uses."""
    present = [m for m in (model, *drafters) if m is not None]
    invariant = config.model.batch_invariant
    packed = prepacked_bytes(present, device, batch_invariant=invariant)
    head_bytes = getattr(model, "greedy_head_bytes", None)
    setting = config.kernel.exact_greedy_head
    screen = head_bytes(device, batch_invariant=invariant, setting=setting) if head_bytes is not None else 0
    return weight_bytes(*present) + packed + screen


def drafter_modules(drafter: Any) -> list[nn.Module]:
    """The modules a drafter holds (its head or its draft LM), found among its attributes so that
    every drafter kind is counted without naming its fields; none for ``None`` or ngram."""
    if drafter is None:
        return []
    return [value for value in vars(drafter).values() if isinstance(value, nn.Module)]


def assemble_for_plan(config: EngineConfig) -> Assembly:
    """What :func:`assemble` gives ``config`` when no weight is loaded: the model and its drafter
    are built on the meta device from the checkpoint's config (a preset builds only its
    ``config.json``), on the device the engine would run on, with the memory free now."""
    path = Path(config.model.model).expanduser()
    if not path.is_dir():
        path = Path(resolve_model(config.model.model, config_only=True))
    # The context limit is settled before the model is built, in the engine's order.
    config = finish_config(config, load_hf_config(path))
    meta, hf_config = meta_model(path, config)
    device = resolve_device(config.model.device)
    return assemble(
        config,
        hf_config,
        meta,
        build_drafter(config, meta),
        device=device,
        free_bytes=free_memory_bytes(device),
    )
