"""DeepSeek-V3 (MLA + MoE) and DeepSeek-V3.2 (MLA + lightning-indexer sparse attention).

Layers ``< first_k_dense_replace`` (or ``mlp_layer_types == "dense"``) use a dense gated MLP, the
rest the MoE of :mod:`warmcap.models.moe`. Checkpoint names follow transformers; MTP layers stored
past ``num_hidden_layers`` (``num_nextn_predict_layers``) are skipped here: :func:`mtp_layer_state`
reads them for the mtp drafter (``warmcap.drafters.heads.DeepseekMTPHead``).

KV layout: every layer has an MLA cache (``model.layers.N.self_attn``, :class:`MLASpec`); V3.2 adds an
indexer cache per layer (``model.layers.N.self_attn.indexer``, :class:`IndexerSpec`), its own group.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from warmcap.errors import ModelLoadError
from warmcap.models.decoder import (
    IGNORED_WEIGHT_SUFFIXES,
    DecoderForCausalLM,
    DecoderModel,
    PreNormDecoderLayer,
)
from warmcap.models.layers import GatedMLP
from warmcap.models.mla import MLAAttention
from warmcap.models.moe import DeepseekMoE, stacked_expert_target
from warmcap.models.rope import RotaryEmbedding

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def is_moe_layer(hf_config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` uses the MoE block (V3.2 configs may list ``mlp_layer_types``)."""
    kinds = getattr(hf_config, "mlp_layer_types", None)
    # MTP layers sit past the listed layers; DeepSeek's are MoE like every late layer.
    if kinds is not None and layer_idx < len(kinds):
        return kinds[layer_idx] == "sparse"
    return layer_idx >= (hf_config.first_k_dense_replace or 0)


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(self, hf_config: Any, layer_idx: int) -> None:
        hidden = hf_config.hidden_size
        attn = MLAAttention(hf_config, layer_idx)
        mlp: nn.Module
        if is_moe_layer(hf_config, layer_idx):
            mlp = DeepseekMoE(hf_config)
        else:
            mlp = GatedMLP(hidden, hf_config.intermediate_size, hf_config.hidden_act)
        super().__init__(hidden, hf_config.rms_norm_eps, attn, mlp)


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V3 causal LM whose MLA layers run through the paged latent cache, with the MLA
    (and indexer) backends the forward context gives for their KV kinds."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype = torch.float32) -> None:
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        if kv_heads != hf_config.num_attention_heads:
            raise ModelLoadError(
                f"MLA needs num_key_value_heads == num_attention_heads; got {hf_config.num_key_value_heads} "
                f"and {hf_config.num_attention_heads}: fix config.json"
            )
        layers = (DeepseekDecoderLayer(hf_config, i) for i in range(hf_config.num_hidden_layers))
        rotary = RotaryEmbedding.from_config(hf_config, hf_config.qk_rope_head_dim)
        super().__init__(hf_config, DecoderModel(hf_config, layers), rotary, dtype=dtype)
        for module in self.modules():
            if isinstance(module, DeepseekMoE):
                # Routing stays in float32 whatever the activation dtype (ties flip otherwise).
                module.gate.float()

    def weight_target(self, name: str) -> tuple[str, int | None] | None:
        """One-to-one names, except MTP layers (past the decoder layers: the mtp drafter reads them,
        :func:`mtp_layer_state`), which are skipped, and per-expert tensors, which go to a row of
        their stacked expert parameter."""
        if name.endswith(IGNORED_WEIGHT_SUFFIXES):
            return None
        layer = _LAYER_INDEX.match(name)
        if layer is not None and int(layer[1]) >= self.hf_config.num_hidden_layers:
            return None
        return stacked_expert_target(name) or (name, None)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: V3 with a lightning indexer per layer (config ``index_topk``, ``index_n_heads``,
    ``index_head_dim``) restricting MLA to the top-k context tokens of each query."""


#: MTP-layer checkpoint entries that copy target weights (the drafter shares the target's instead)
MTP_SHARED_WEIGHTS = ("embed_tokens.weight", "shared_head.head.weight")
#: MTP-layer entries that belong to its decoder layer (prefixed ``layer.`` in the drafter head)
_MTP_DECODER_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


def num_mtp_layers(hf_config: Any) -> int:
    """MTP layers the checkpoint carries after its decoder layers (``num_nextn_predict_layers``)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def mtp_layer_state(model_dir: Path, hf_config: Any) -> dict[str, torch.Tensor]:
    """The first MTP layer (``model.layers.{num_hidden_layers}.*``) of a DeepSeek checkpoint, named
    as :class:`~warmcap.drafters.heads.DeepseekMTPHead` parameters: ``enorm``, ``hnorm``,
    ``eh_proj``, ``shared_head.norm`` and ``layer.*`` (per-expert tensors stacked)."""
    from safetensors import safe_open

    from warmcap.models.loader import weight_files

    prefix = f"model.layers.{hf_config.num_hidden_layers}."
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                if not name.startswith(prefix) or name[len(prefix) :] in MTP_SHARED_WEIGHTS:
                    continue
                local = name[len(prefix) :]
                if local.startswith(_MTP_DECODER_PARTS):
                    local = "layer." + local
                stacked = stacked_expert_target(local)
                if stacked is None:
                    state[local] = handle.get_tensor(name)
                else:
                    experts.setdefault(stacked[0], {})[stacked[1]] = handle.get_tensor(name)
    if not state:
        raise ModelLoadError(
            f"{model_dir} declares num_nextn_predict_layers={num_mtp_layers(hf_config)} but holds no "
            f"{prefix}* weights: use a checkpoint with its MTP layers, or pass an mtp head directory"
        )
    for target, rows in experts.items():
        state[target] = torch.stack([rows[i] for i in sorted(rows)])
    return state
