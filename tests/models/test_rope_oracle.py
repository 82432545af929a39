"""warmcap's RoPE cos/sin against transformers' rotary embeddings, one config per rope type."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from warmcap.errors import ModelLoadError
from warmcap.models.rope import RotaryEmbedding, apply_rope

MAX_POS = 64
POSITIONS = torch.tensor([0, 1, 7, 31, 63])


def llama_config(rope_parameters: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=1,
        vocab_size=128,
        max_position_embeddings=MAX_POS,
        rope_parameters={"rope_theta": 10000.0, **rope_parameters},
    )


def hf_cos_sin(rotary: torch.nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, positions.numel(), 4, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(x, positions[None, :])
    return cos[0], sin[0]


LLAMA_ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_apply_rope_is_transformers_rotation_bit_for_bit(rotary_dim: int) -> None:
    """The rotation itself equals transformers' ``apply_rotary_pos_emb`` exactly, on a full head and
    on the leading slice a partial-rotary layer passes (not contiguous)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 5, 64, generator=gen), torch.randn(7, 2, 64, generator=gen)
    ours = RotaryEmbedding.from_config(llama_config({"rope_type": "default"}), rotary_dim)
    cos, sin = ours.cos_sin(torch.arange(3, 10), torch.float32)
    q_part, k_part = q[..., :rotary_dim], k[..., :rotary_dim]
    ref_q, ref_k = apply_rotary_pos_emb(q_part, k_part, cos, sin, unsqueeze_dim=1)
    assert torch.equal(apply_rope(q_part, cos, sin), ref_q)
    assert torch.equal(apply_rope(k_part, cos, sin), ref_k)


@pytest.mark.parametrize("name", sorted(LLAMA_ROPES))
def test_llama_rope_types_match_transformers(name: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama_config(LLAMA_ROPES[name])
    ours = RotaryEmbedding.from_config(config, config.hidden_size // config.num_attention_heads)
    cos, sin = ours.cos_sin(POSITIONS, torch.float32)
    ref_cos, ref_sin = hf_cos_sin(LlamaRotaryEmbedding(config), POSITIONS)
    torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0)


def test_dynamic_beyond_max_positions_matches_transformers_decode() -> None:
    """A single decode position past max_position_embeddings grows the base as transformers does."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama_config(LLAMA_ROPES["dynamic"])
    ours = RotaryEmbedding.from_config(config, 16)
    position = torch.tensor([3 * MAX_POS])
    cos, sin = ours.cos_sin(position, torch.float32)
    ref_cos, ref_sin = hf_cos_sin(LlamaRotaryEmbedding(config), position)
    torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0)


def test_deepseek_yarn_with_mscale_matches_transformers() -> None:
    """DeepSeek rotates qk_rope_head_dim dims with yarn and the mscale attention factor."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    config = DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=1,
        vocab_size=128,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        kv_lora_rank=16,
        q_lora_rank=None,
        max_position_embeddings=MAX_POS,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    ours = RotaryEmbedding.from_config(config, config.qk_rope_head_dim)
    reference = DeepseekV3RotaryEmbedding(config)
    assert ours.attention_factor == pytest.approx(reference.attention_scaling)
    cos, sin = ours.cos_sin(POSITIONS, torch.float32)
    ref_cos, ref_sin = hf_cos_sin(reference, POSITIONS)
    torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0)


def without_max_positions(config: Any) -> Any:
    """The config's fields with max_position_embeddings left out (a model config that lacks it)."""
    fields = {k: v for k, v in config.to_dict().items() if k != "max_position_embeddings"}
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn"])
def test_rope_without_max_position_embeddings_builds(name: str) -> None:
    """A config with no max_position_embeddings still builds when the rope type does not read it."""
    config = without_max_positions(llama_config(LLAMA_ROPES[name]))
    ours = RotaryEmbedding.from_config(config, 16)
    reference = RotaryEmbedding.from_config(llama_config(LLAMA_ROPES[name]), 16)
    torch.testing.assert_close(
        ours.cos_sin(POSITIONS, torch.float32), reference.cos_sin(POSITIONS, torch.float32)
    )


def test_dynamic_without_max_position_embeddings_is_a_clear_error() -> None:
    config = without_max_positions(llama_config(LLAMA_ROPES["dynamic"]))
    with pytest.raises(ModelLoadError, match=r"max_position_embeddings.*None"):
        RotaryEmbedding.from_config(config, 16)
