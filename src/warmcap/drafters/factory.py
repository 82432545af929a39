"""Speculative config -> drafter, loading its weights (a head directory, a draft LM, or seeded random).

``SpeculativeConfig.model`` selects the weights:

- ``ngram``: none.
- ``draft_model``: a preset name or HF directory of a causal LM with the target's vocabulary;
  ``self`` (or nothing) drafts with the target checkpoint itself (a second copy).
- ``eagle`` / ``eagle3`` / ``mtp`` / ``dflash``: a head directory (``config.json`` optional, weights
  in safetensors) or ``random`` / nothing for deterministic random weights (seeded from the
  engine seed), shaped after the target.
- ``mtp`` on a DeepSeek checkpoint that carries MTP layers (``num_nextn_predict_layers`` > 0) and no
  head directory: the checkpoint's own first MTP layer (:class:`DeepseekMTPHead`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from warmcap.drafters.dflash import DFlashDrafter, DFlashHead
from warmcap.drafters.draft_model import DraftModelDrafter
from warmcap.drafters.heads import (
    DeepseekMTPHead,
    Eagle3Head,
    EagleHead,
    MTPHead,
    TargetTiedHead,
    eagle3_aux_layers,
)
from warmcap.drafters.hidden import HIDDEN_DRAFTERS, head_kwargs
from warmcap.drafters.ngram import NgramDrafter
from warmcap.errors import ConfigError, ModelLoadError
from warmcap.models.deepseek_v3 import DeepseekV3ForCausalLM, mtp_layer_state, num_mtp_layers
from warmcap.models.moe import DeepseekMoE

if TYPE_CHECKING:
    from torch import nn

    from warmcap.config import EngineConfig
    from warmcap.drafters.base import BaseDrafter

RANDOM = "random"
#: checkpoint entries of head directories that duplicate target weights we share instead
SHARED_WITH_TARGET = ("embed_tokens.weight", "t2d")
RANDOM_INIT_STD = 0.1
#: depth of a random DFlash head (published DFlash drafters use a few layers; EAGLE-style heads one)
RANDOM_DFLASH_LAYERS = 2
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
    method: str,
    target: nn.Module,
    spec_model: str | None,
    *,
    seed: int,
    target_path: Path | None = None,
) -> tuple[TargetTiedHead, tuple[int, ...]]:
    """The head for ``method`` and the target layers it reads (empty: the final hidden state).
    ``target_path`` is the target's checkpoint directory, where DeepSeek keeps its MTP layers."""
    path = _head_path(spec_model)
    cfg = _head_config(target, path)
    state = _read_state(path) if path is not None else None
    num_target_layers = target.hf_config.num_hidden_layers
    default_aux = eagle3_aux_layers(num_target_layers)
    aux = tuple(
        getattr(cfg, "aux_hidden_state_layer_ids", None) or getattr(cfg, "target_layer_ids", None) or ()
    )
    head: TargetTiedHead
    if method == "eagle":
        head, aux = EagleHead(cfg, target, **head_kwargs(method, state or {})), ()
    elif method == "eagle3":
        head = Eagle3Head(cfg, target, **head_kwargs(method, state or {}))
        aux = aux or default_aux
    elif method == "mtp" and isinstance(target, DeepseekV3ForCausalLM):
        head, aux = DeepseekMTPHead(cfg, target), ()
        planning = next(target.parameters()).device.type == "meta"
        if spec_model is None and num_mtp_layers(target.hf_config) and target_path and not planning:
            state = mtp_layer_state(target_path, target.hf_config)
    elif method == "mtp":
        head, aux = MTPHead(cfg, target), ()
    else:
        if path is None:
            cfg.num_hidden_layers = RANDOM_DFLASH_LAYERS
        aux = aux or default_aux
        mask = getattr(cfg, "mask_token_id", None)
        head = DFlashHead(
            cfg, target, num_target_states=len(aux), mask_token_id=int(mask if mask is not None else 0)
        )
    head.to(target.dtype)
    for module in head.modules():
        if isinstance(module, DeepseekMoE):
            # As in the target: routing stays in float32 whatever the activation dtype.
            module.gate.float()
    device = next(target.parameters()).device
    if device.type == "meta":
        # Planning without weights: only the head's shapes (its KV layer specs) matter.
        return head.to(device).eval(), aux
    if state is None:
        randomize(head, seed)
    else:
        load_head_state(head, state)
    return head.to(device).eval(), aux


def _draft_lm(config: EngineConfig, target: nn.Module, spec_model: str | None) -> nn.Module:
    from warmcap.models.loader import load_model
    from warmcap.models.presets import resolve_model

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
            path, dtype=target.dtype, device=device, batch_invariant=config.model.batch_invariant
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
    """The drafter the speculative config asks for, or None (no speculation, or a P/D producer)."""
    spec = config.speculative
    if spec is None or config.num_speculative_tokens == 0:
        return None
    if spec.method == "ngram":
        return NgramDrafter(config)
    if spec.method == "draft_model":
        return DraftModelDrafter(config, _draft_lm(config, target, spec.model))
    target_path = _target_path(config) if spec.method == "mtp" else None
    head, aux = build_head(
        spec.method, target, spec.model, seed=config.model.seed + 1, target_path=target_path
    )
    if config.model.batch_invariant:
        # The head's own linears, like the target's and a draft LM's (made so by the loader).
        from warmcap.models.batch_invariant import make_batch_invariant

        make_batch_invariant(head)
    if spec.method == "dflash":
        assert isinstance(head, DFlashHead)
        return DFlashDrafter(config, head, aux_layers=aux)
    return HIDDEN_DRAFTERS[spec.method](config, head, aux_layers=aux)
