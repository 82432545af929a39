"""Speculative config -> drafter: the class registered for the method (``drafters/registry.py``),
given the weights its entry in ``spec_methods.METHODS`` says it drafts with.

``SpeculativeConfig.model`` selects those weights:

- none (``ngram``): nothing to load.
- a draft model (``draft_model``): a preset name or HF directory of a causal LM with the target's
  vocabulary; ``self`` (or nothing) drafts with the target checkpoint itself (a second copy).
- a head (``eagle`` / ``eagle3`` / ``mtp`` / ``dflash``): a head directory (``config.json``
  optional, weights in safetensors) or ``random`` / nothing for deterministic random weights (seeded
  from the engine seed), shaped after the target; the drafter class makes the head. With nothing
  given, weights the target's checkpoint carries for the head come first (a DeepSeek checkpoint's
  own first MTP layer, see ``DeepseekMTPHead.checkpoint_state``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

# The drafter modules register their classes (drafters/registry.py) when imported.
from warmcap.drafters import dflash, draft_model, hidden, ngram  # noqa: F401
from warmcap.drafters.hidden import HeadDrafter
from warmcap.drafters.registry import drafter_class
from warmcap.errors import ConfigError, ModelLoadError
from warmcap.models.moe import DeepseekMoE

if TYPE_CHECKING:
    from torch import nn

    from warmcap.config import EngineConfig
    from warmcap.drafters.base import BaseDrafter
    from warmcap.drafters.heads import TargetTiedHead

RANDOM = "random"
#: checkpoint entries of head directories that duplicate target weights we share instead
SHARED_WITH_TARGET = ("embed_tokens.weight", "t2d")
RANDOM_INIT_STD = 0.1
#: ``config.json`` fields of a head directory that override the target's
HEAD_CONFIG_KEYS = frozenset(
    {
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "rms_norm_eps",
        "hidden_act",
        "num_hidden_layers",
        "rope_theta",
        "rope_scaling",
        "mask_token_id",
        "target_layer_ids",
        "aux_hidden_state_layer_ids",
    }
)


def _head_config(target: nn.Module, path: Path | None) -> Any:
    """The target's config with the head's own ``config.json`` fields on top; one layer unless the
    head says otherwise (DFlash heads state their depth)."""
    cfg = copy.deepcopy(target.hf_config)
    cfg.num_hidden_layers = 1
    if path is not None and (path / "config.json").is_file():
        for key, value in json.loads((path / "config.json").read_text()).items():
            if key in HEAD_CONFIG_KEYS:
                setattr(cfg, key, value)
    return cfg


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"head directory {str(path)!r} has no *.safetensors file: convert the checkpoint"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    # Some exports nest the head under ``model.``; the public layouts name it from the root.
    return {(name[len("model.") :] if name.startswith("model.") else name): t for name, t in state.items()}


def load_head_state(head: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a head checkpoint (names as in the public layouts); copies of target weights are skipped."""
    cleaned = {name: t for name, t in state.items() if name not in SHARED_WITH_TARGET}
    own = head.state_dict()
    unexpected = sorted(set(cleaned) - set(own))
    missing = sorted(set(own) - set(cleaned))
    if unexpected or missing:
        raise ModelLoadError(
            f"{type(head).__name__} checkpoint mismatch: unexpected {unexpected[:5]}, missing {missing[:5]}; "
            "check that the head directory matches the speculative method"
        )
    for name, tensor in cleaned.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ModelLoadError(
                f"head weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}: "
                "the head was trained for another target"
            )
    head.load_state_dict(cleaned, strict=True)


def randomize(module: nn.Module, seed: int) -> None:
    """Deterministic weights: matrices ~ N(0, 0.1), biases 0, norms 1 (independent of global RNG)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * RANDOM_INIT_STD)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)


def _head_path(spec_model: str | None) -> Path | None:
    if spec_model in (None, RANDOM):
        return None
    path = Path(spec_model).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"drafter head {spec_model!r} is not a directory: pass a head directory or 'random'"
        )
    return path


def build_head(
    drafter: type[HeadDrafter], config: EngineConfig, target: nn.Module
) -> tuple[TargetTiedHead, tuple[int, ...]]:
    """The head of ``drafter``'s method and the target layers it reads (empty: the final hidden
    state), with weights from the head directory, the target's checkpoint or seeded random."""
    spec = config.speculative
    assert spec is not None  # build_drafter builds heads for speculative configs only
    path = _head_path(spec.model)
    cfg = _head_config(target, path)
    state = _read_state(path) if path is not None else None
    configured = getattr(cfg, "aux_hidden_state_layer_ids", None) or getattr(cfg, "target_layer_ids", None)
    aux = spec.entry.aux_layers(target.hf_config.num_hidden_layers, tuple(configured or ()))
    head = drafter.make_head(cfg, target, state, aux)
    head.to(target.dtype)
    for module in head.modules():
        if isinstance(module, DeepseekMoE):
            # As in the target: routing stays in float32 whatever the activation dtype.
            module.gate.float()
    device = next(target.parameters()).device
    if device.type == "meta":
        # Planning without weights: only the head's shapes (its KV layer specs) matter.
        return head.to(device).eval(), aux
    if state is None and spec.model is None:
        state = head.checkpoint_state(lambda: _target_path(config))
    if state is None:
        randomize(head, config.model.seed + 1)
    else:
        load_head_state(head, state)
    return head.to(device).eval(), aux


def _draft_lm(config: EngineConfig, target: nn.Module, spec_model: str | None) -> nn.Module:
    from warmcap.models.loader import load_model
    from warmcap.models.presets import resolve_model

    if spec_model in (None, "self") and config.tensor_parallel_size == 1:
        # The target drafts for itself: its module is already loaded and packed, and the drafter
        # runs it over its own draft.-prefixed KV groups, so a second copy would only cost a load.
        # (Under tensor parallelism the target is a shard and the drafter must be whole.)
        return target
    name = spec_model if spec_model not in (None, "self") else config.model.model
    device = next(target.parameters()).device
    planning = device.type == "meta"
    path = Path(name).expanduser()
    if not path.is_dir():
        path = Path(resolve_model(name, config_only=planning))
    if planning:
        from warmcap.kv_layout import meta_model

        model = meta_model(path, config)[0]
    else:
        model = load_model(
            path,
            dtype=target.dtype,
            device=device,
            batch_invariant=config.model.batch_invariant,
            kernels=config.kernel,
        )
    if model.hf_config.vocab_size != target.hf_config.vocab_size:
        raise ConfigError(
            f"draft model {name!r} has vocabulary {model.hf_config.vocab_size} but the target has "
            f"{target.hf_config.vocab_size}: use a draft model with the target's tokenizer"
        )
    return model


def _target_path(config: EngineConfig) -> Path:
    """The target's checkpoint directory (a preset is already built by the time drafters are)."""
    from warmcap.models.presets import resolve_model

    path = Path(config.model.model).expanduser()
    return path if path.is_dir() else Path(resolve_model(config.model.model))


def build_drafter(config: EngineConfig, target: nn.Module) -> BaseDrafter | None:
    """The drafter the speculative config asks for, or None (no speculation, or a P/D producer
    with ngram): the class registered for the method, given the weights its table entry says it
    drafts with. A producer's drafter writes its prompt KV and proposes nothing."""
    spec = config.speculative
    if spec is None or not config.runs_drafter:
        return None
    cls = drafter_class(spec.method)
    if spec.entry.needs_draft_model:
        return cls(config, _draft_lm(config, target, spec.model))
    if not spec.entry.needs_head:
        return cls(config)
    if not issubclass(cls, HeadDrafter):
        raise TypeError(f"{cls.__name__} drafts {spec.method} with a head but is not a HeadDrafter")
    head, aux = build_head(cls, config, target)
    if config.model.batch_invariant:
        # The head's own linears, like the target's and a draft LM's (made so by the loader).
        from warmcap.models.batch_invariant import make_batch_invariant

        make_batch_invariant(head)
    return cls(config, head, aux_layers=aux)
