"""The layout (shape and dtype) of a graph's static outputs.

``static`` records nothing, so the only product of its capture is the graph's output buffers, and
every replay overwrites them before they are read: with their layouts known (an earlier identical
start's, kept in the start-up cache, :mod:`warmcap.graphs.proof.startup_cache`), a warm capture
allocates them without running a forward (:mod:`warmcap.graphs.capture.capturer`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Shape and dtype of one static graph output."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorLayout:
        return cls(tuple(t.shape), t.dtype)

    def to_json(self) -> list[Any]:
        return [list(self.shape), str(self.dtype).removeprefix("torch.")]

    @classmethod
    def from_json(cls, data: Any) -> TensorLayout:
        shape, dtype = data
        found = getattr(torch, dtype) if isinstance(dtype, str) else None
        if not isinstance(found, torch.dtype) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise TypeError(f"{data!r} is not a [shape, dtype] layout")
        return cls(tuple(shape), found)


@dataclass(frozen=True, slots=True)
class OutputLayout:
    """The layout of a graph's static outputs: the main output and its auxiliary ones, in order."""

    output: TensorLayout
    aux: tuple[TensorLayout, ...] = ()

    @classmethod
    def of(cls, output: torch.Tensor, aux: Iterable[torch.Tensor]) -> OutputLayout:
        return cls(TensorLayout.of(output), tuple(TensorLayout.of(t) for t in aux))

    def to_json(self) -> dict[str, Any]:
        return {"output": self.output.to_json(), "aux": [a.to_json() for a in self.aux]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OutputLayout:
        return cls(
            TensorLayout.from_json(data["output"]), tuple(TensorLayout.from_json(a) for a in data["aux"])
        )


def allocate(layout: OutputLayout, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Zeroed static outputs in ``layout`` on ``device``: the main output and the auxiliary ones."""

    def zeros(t: TensorLayout) -> torch.Tensor:
        return torch.zeros(t.shape, dtype=t.dtype, device=device)

    return zeros(layout.output), [zeros(a) for a in layout.aux]
