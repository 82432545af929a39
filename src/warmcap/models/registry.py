"""HF ``architectures`` names -> warmcap model classes.

Entries are ``"module:Class"`` strings imported on first use, so looking up one architecture never
imports every model. To add a family, add its line to :data:`MODEL_REGISTRY` (or call
:func:`register_model` from a plugin).
"""

from __future__ import annotations

import importlib

from torch import nn

from warmcap.errors import ModelLoadError

MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "warmcap.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "warmcap.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "warmcap.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "warmcap.models.llama:Qwen3ForCausalLM",
    "DeepseekV3ForCausalLM": "warmcap.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM": "warmcap.models.deepseek_v3:DeepseekV32ForCausalLM",
    "BambaForCausalLM": "warmcap.models.hybrid:BambaForCausalLM",
}


def register_model(architecture: str, target: str) -> None:
    """Map an HF architecture name to ``"package.module:ClassName"``."""
    MODEL_REGISTRY[architecture] = target


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def check_architecture(architecture: str) -> None:
    """ModelLoadError naming ``architecture`` and the supported ones unless it is registered (no
    import: start-up and ``warmup plan`` check it before anything that depends on the model)."""
    if architecture not in MODEL_REGISTRY:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
            ": use a checkpoint of one of these"
        )


def model_class(architecture: str) -> type[nn.Module]:
    """The implementation class for ``architecture``; ModelLoadError listing the supported ones."""
    check_architecture(architecture)
    target = MODEL_REGISTRY[architecture]
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
