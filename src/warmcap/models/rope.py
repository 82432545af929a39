"""Rotary position embeddings (rotate-half convention) for the variants HF configs name.

``rope_type`` default, linear, dynamic (NTK), llama3 and yarn are supported. The inverse frequencies
and attention scaling come from transformers' ``ROPE_INIT_FUNCTIONS`` (so every variant is computed
the way the reference computes it); the rotation itself is warmcap's. cos/sin are computed per token
from the positions in float32 and cast to the activation dtype, so any position works and no table
depends on ``max_position_embeddings`` (only ``dynamic``, and ``yarn`` without a ``factor``, read it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from warmcap.errors import ModelLoadError

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as one flat dict with ``rope_type`` and ``rope_theta``.

    Reads ``rope_parameters`` (transformers >= 5) or the older ``rope_scaling`` + ``rope_theta``.
    """
    params = dict(
        getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    )
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    # NOTE: transformers keeps "default" out of ROPE_INIT_FUNCTIONS (each model computes it); this is
    # the same arithmetic as its Llama ``compute_default_rope_parameters``.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    return 1.0 / (base**exponents)


@dataclass(slots=True)
class _RopeConfigView:
    """What transformers' rope init functions read from a config, with warmcap's rotary width.

    The functions take ``head_dim`` from the config; DeepSeek's MLA rotates only
    ``qk_rope_head_dim`` of each head, so the view carries the width the caller gives.
    """

    rope_parameters: dict[str, Any]
    head_dim: int
    max_position_embeddings: int | None
    hidden_size: int = 0
    num_attention_heads: int = 1

    def standardize_rope_params(self) -> None:
        """Already flat and standardized by :func:`rope_parameters`."""


def _usable_max_positions(hf_config: Any) -> int | None:
    value = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def _init_freqs(hf_config: Any, params: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim/2] and the attention scaling, from transformers' ROPE_INIT_FUNCTIONS."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = params["rope_type"]
    if rope_type == "default":
        return _base_inv_freq(float(params["rope_theta"]), head_dim), 1.0
    max_pos = _usable_max_positions(hf_config)
    needs_max_pos = rope_type == "dynamic" or (rope_type == "yarn" and not params.get("factor"))
    if needs_max_pos and max_pos is None:
        raise ModelLoadError(
            f"rope_type {rope_type!r} needs the config's max_position_embeddings, but it is "
            f"{getattr(hf_config, 'max_position_embeddings', None)!r}; set it in the model's config.json"
        )
    view = _RopeConfigView(dict(params), head_dim, max_pos)
    view.rope_parameters.setdefault("factor", None)  # yarn reads it with [] and derives it when None
    # NOTE: built on CPU explicitly: models are constructed under ``torch.device("meta")``, and the
    # init functions create some tensors without a device, so the CPU default is set around the call.
    with torch.device("cpu"):
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](view, torch.device("cpu"))
    return inv_freq.to(torch.float32), float(attention_factor)


@dataclass(slots=True)
class RotaryEmbedding:
    """cos/sin for a batch of positions; apply with :func:`apply_rope`.

    ``dynamic`` NTK scaling is evaluated per token with ``seq_len = max(position + 1,
    max_position_embeddings)``: identical to transformers while positions stay within
    ``max_position_embeddings`` (and for single-token decode steps beyond it), static-shape friendly.
    """

    head_dim: int
    rope_type: str
    base: float
    inv_freq: torch.Tensor
    attention_factor: float = 1.0
    dynamic_factor: float = 1.0
    max_position_embeddings: int = 0
    # NOTE: per-device copies made on first use, so a graph capture never sees a host-to-device copy.
    _on_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_config(cls, hf_config: Any, head_dim: int) -> RotaryEmbedding:
        params = rope_parameters(hf_config)
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"rope_type {rope_type!r} is not supported; use one of {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelLoadError(
                f"partial_rotary_factor {params['partial_rotary_factor']} is not supported for this model; "
                "only full-width RoPE (1.0) is implemented"
            )
        base = float(params["rope_theta"])
        inv_freq, attention_factor = _init_freqs(hf_config, params, head_dim)
        dynamic_factor = float(params["factor"]) if rope_type == "dynamic" else 1.0
        max_pos = _usable_max_positions(hf_config) or 0
        return cls(head_dim, rope_type, base, inv_freq, attention_factor, dynamic_factor, max_pos)

    def _inv_freq_for(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, D/2] (dynamic) or [D/2] inverse frequencies on the positions' device."""
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device.setdefault(positions.device, self.inv_freq.to(positions.device))
        if self.rope_type != "dynamic":
            return inv_freq
        dim, max_pos, factor = self.head_dim, self.max_position_embeddings, self.dynamic_factor
        seq_len = (positions + 1).to(torch.float32).clamp(min=max_pos)
        base = self.base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, device=positions.device).to(torch.float32) / dim
        scaled = 1.0 / (base[:, None] ** exponents[None, :])
        return torch.where((positions + 1 > max_pos)[:, None], scaled, inv_freq[None, :])

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, head_dim] in ``dtype``."""
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq_for(positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_factor
        sin = emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, D] (rotate-half pairing: i with i + D/2)."""
    half = x.shape[-1] // 2
    # rotate_half(x) is x rolled by half with its first half negated; negating in place in the
    # fresh rolled tensor and accumulating there saves two temporaries (bit for bit the same sums).
    rotated = x.roll(half, -1)
    rotated[..., :half].neg_()
    return rotated.mul_(sin[:, None, :]).add_(x * cos[:, None, :])
