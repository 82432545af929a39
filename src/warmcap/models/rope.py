"""Rotary position embeddings (rotate-half convention) for the variants HF configs name.

``rope_type`` default, linear, dynamic (NTK), llama3 and yarn are supported. cos/sin are computed
per token from the positions in float32 and cast to the activation dtype, so any position works and
no table depends on ``max_position_embeddings``.
"""

from __future__ import annotations

import math
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
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by ``factor``, short ones kept, the band between blended.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, dim: int, params: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    orig = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_pos / orig
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(torch.float32) / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * freqs)) * (1 - extrapolate) + (1.0 / freqs) * extrapolate
    return inv_freq, float(attention_factor)


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
        # NOTE: built on CPU explicitly: models are constructed under ``torch.device("meta")``.
        base = float(params["rope_theta"])
        max_pos = int(hf_config.max_position_embeddings)
        inv_freq = _base_inv_freq(base, head_dim)
        attention_factor = 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(base, head_dim, params, max_pos)
        dynamic_factor = float(params["factor"]) if rope_type == "dynamic" else 1.0
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
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
