"""Building blocks shared by the decoder models: RMSNorm, gated MLP, activations."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from warmcap.errors import ModelLoadError

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function a config's ``hidden_act`` names."""
    if name not in _ACTIVATIONS:
        raise ModelLoadError(f"hidden_act {name!r} is not supported; use one of {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight in the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel instead of six elementwise ops. In float32 the weight can go into the
        # kernel; otherwise it scales the result after the cast back, as transformers does.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.to(torch.float32), self.weight.shape, eps=self.eps).to(x.dtype)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with HF's ``gate_proj``/``up_proj``/``down_proj`` names."""

    def __init__(self, hidden: int, intermediate: int, act: str, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
