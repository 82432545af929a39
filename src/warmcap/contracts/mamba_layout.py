"""How one Mamba layer's state tensor is split into its per-request state parts."""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import torch


def state_views(state: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Split a layer's ``[num_blocks + 1, total]`` state tensor into ``[num_blocks + 1, *shape]`` views."""
    views, offset = [], 0
    for shape in shapes:
        size = prod(shape)
        views.append(state[:, offset : offset + size].view(state.shape[0], *shape))
        offset += size
    return views
