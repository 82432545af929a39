"""Batch-invariant linear layers: a token's output does not depend on how many tokens share its batch.

A BLAS GEMM picks kernels and blockings by shape, so row ``i`` of ``x[:m] @ W.T`` can differ from row
``i`` of ``x[:n] @ W.T`` in the last bits (MKL on this machine: whenever ``m`` is 1-3, 5-7, 9-11).
Padding a batch for a graph changes ``m``, so without invariance a graph's real rows agree with the
unpadded eager batch only to float32 rounding, and through 30 layers that grows to ~1e-6 relative:
enough to flip a near-tied greedy token between a graph and an eager step.

With ``ModelConfig.batch_invariant`` every ``nn.Linear`` multiplies fixed tiles of :data:`ROW_TILE`
tokens (the last tile zero-padded). Every call then has the same shape, so a row's result depends
only on its own values and its index, which are the same in a padded and an unpadded batch: real
rows of a graph replay equal the unpadded eager batch bit for bit. The price is the padding of the
last tile and one GEMM call per tile (measured in BENCHMARKS.md).

Only models whose token-mixing contractions all go through ``nn.Linear`` qualify; MoE experts,
MLA's absorbed einsums and the Mamba scan contract over tokens in their own code, so
:func:`make_batch_invariant` refuses those models instead of claiming an invariance it cannot give.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warmcap.errors import ConfigError

#: rows per GEMM call; any fixed value works, 16 keeps decode padding small
ROW_TILE = 16


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` computed in fixed tiles of :data:`ROW_TILE` rows over the flattened leading dims."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    pad = -m % ROW_TILE
    if pad:
        rows = torch.cat((rows, rows.new_zeros(pad, k)))
    out = torch.cat([F.linear(tile, weight, bias) for tile in rows.split(ROW_TILE)])
    return out[:m].reshape(*lead, weight.shape[0])


class BatchInvariantLinear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`tiled_linear` (same parameters, same names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_linear(x, self.weight, self.bias)


def _untiled_modules() -> tuple[type[nn.Module], ...]:
    from warmcap.models.mamba2 import Mamba2Mixer
    from warmcap.models.mla import MLAAttention
    from warmcap.models.moe import RoutedExperts

    return (RoutedExperts, MLAAttention, Mamba2Mixer)


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Turn every ``nn.Linear`` of ``model`` into :class:`BatchInvariantLinear` in place.

    Raises :class:`ConfigError` for models with token contractions outside ``nn.Linear``.
    """
    untiled = _untiled_modules()
    for name, module in model.named_modules():
        if isinstance(module, untiled):
            raise ConfigError(
                f"batch_invariant is not supported for {type(model).__name__}: {name} "
                f"({type(module).__name__}) contracts over tokens outside nn.Linear; "
                "run this model without --batch-invariant"
            )
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = BatchInvariantLinear
    return model


def is_batch_invariant(model: nn.Module) -> bool:
    """Whether :func:`make_batch_invariant` was applied to ``model``."""
    return any(isinstance(m, BatchInvariantLinear) for m in model.modules())
