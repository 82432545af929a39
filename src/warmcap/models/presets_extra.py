"""Tiny random presets for the MLA and Mamba-hybrid families: DeepSeek-V3, DeepSeek-V3.2, Bamba.

Each builder writes a transformers checkpoint (seeded weights, config) plus the shared offline BPE
tokenizer of :mod:`warmcap.models.tiny`. Parameters HF initialises to constants (router correction
bias, Mamba ``A_log``/``D``/``dt_bias``) are re-drawn from the seed so parity tests exercise them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from warmcap.models.tiny import VOCAB_SIZE, write_tokenizer

SEED = 4321

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    # Larger than HF's 0.02 so logits are peaked and greedy choices are not near-ties.
    "initializer_range": 0.1,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}

_DEEPSEEK: dict[str, Any] = {
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 24,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}

_BAMBA: dict[str, Any] = {
    "num_hidden_layers": 4,
    "attn_layer_indices": [1, 3],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 8,
}


def _save(model: Any, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    write_tokenizer(out_dir)


def _redraw_routers(model: Any) -> None:
    import torch

    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn_like(buf) * 0.1)


def _mtp_layer(config: Any) -> dict[str, Any]:
    """Seeded weights of one DeepSeek MTP layer, named as in DeepSeek-V3 checkpoints
    (``model.layers.{num_hidden_layers}.*``): a decoder layer (MLA + MoE) drawn like the model's
    own layers, ``enorm``/``hnorm``/``shared_head.norm`` around 1, ``eh_proj`` random, and copies of
    the embedding and LM head (``embed_tokens``, ``shared_head.head``), as real checkpoints store."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    deeper = config.__class__(**{**config.to_dict(), "num_hidden_layers": config.num_hidden_layers + 1})
    torch.manual_seed(SEED + 1)
    donor = DeepseekV3ForCausalLM(deeper)
    with torch.no_grad():
        _redraw_routers(donor)
    n, hidden = config.num_hidden_layers, config.hidden_size
    prefix = f"model.layers.{n}."
    state: dict[str, Any] = {}
    for name, tensor in donor.model.layers[n].state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            # transformers fuses experts in memory; checkpoints name each expert's projections.
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                state[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate.clone()
                state[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up.clone()
        elif name == "mlp.experts.down_proj":
            for e, down in enumerate(tensor):
                state[f"{prefix}mlp.experts.{e}.down_proj.weight"] = down.clone()
        else:
            state[prefix + name] = tensor
    gen = torch.Generator().manual_seed(SEED + 2)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        state[f"{prefix}{norm}.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    state[f"{prefix}eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
    return state


def make_tiny_deepseek_v3(out_dir: Path) -> None:
    """DeepSeek-V3: 3 layers (1 dense + 2 MoE, 8 experts in 4 groups), MLA with q/kv LoRA, and one
    MTP layer (``num_nextn_predict_layers=1``) stored after them, as DeepSeek checkpoints do."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**{**_COMMON, **_DEEPSEEK}, num_nextn_predict_layers=1)
    config.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        _redraw_routers(model)
    _save(model, out_dir)
    weights = out_dir / "model.safetensors"
    state = load_file(str(weights))
    mtp = _mtp_layer(config)
    prefix = f"model.layers.{config.num_hidden_layers}."
    mtp[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    mtp[prefix + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(
        {**state, **{k: v.contiguous() for k, v in mtp.items()}}, str(weights), metadata={"format": "pt"}
    )


def make_tiny_deepseek_v32(out_dir: Path, *, index_topk: int = 8) -> None:
    """DeepSeek-V3.2: the V3 preset plus a lightning indexer per layer keeping ``index_topk`` tokens."""
    import torch
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    fields = {k: v for k, v in _DEEPSEEK.items() if k != "num_nextn_predict_layers"}
    config = DeepseekV32Config(**_COMMON, **fields, index_topk=index_topk, index_n_heads=8, index_head_dim=32)
    config.architectures = ["DeepseekV32ForCausalLM"]
    torch.manual_seed(SEED)
    model = DeepseekV32ForCausalLM(config)
    with torch.no_grad():
        _redraw_routers(model)
    _save(model, out_dir)


def make_tiny_hybrid(out_dir: Path) -> None:
    """Bamba: 4 layers (Mamba2, attention, Mamba2, attention), 8 SSM heads in 2 groups, conv width 4."""
    import torch
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(**{**_COMMON, **_BAMBA})
    config.architectures = ["BambaForCausalLM"]
    torch.manual_seed(SEED)
    model = BambaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.rand_like(param) * 7 + 1))
            elif name.endswith(".D"):
                param.copy_(torch.rand_like(param) + 0.5)
            elif name.endswith("dt_bias"):
                param.copy_(torch.randn_like(param) * 0.5 - 1.0)
    _save(model, out_dir)


#: content version per preset, part of its cache folder name (bumped when a builder changes)
EXTRA_PRESET_VERSIONS: dict[str, int] = {"tiny-deepseek-v3": 2}

#: preset name -> builder writing the checkpoint into a directory
EXTRA_PRESETS: dict[str, Callable[[Path], None]] = {
    "tiny-deepseek-v3": make_tiny_deepseek_v3,
    "tiny-deepseek-v32": make_tiny_deepseek_v32,
    "tiny-hybrid": make_tiny_hybrid,
}
