"""Linear layers whose weights are prepacked for oneDNN's CPU GEMM.

``F.linear`` on CPU multiplies by the ``[out, in]`` weight as stored, and MKL re-blocks it on every
call; oneDNN can reorder a weight once into the blocked layout its GEMM kernel reads. For the
decode-sized batches warmcap runs (a few to a few dozen rows) that is measured 1.7x faster over the
linears of SmolLM2 on one thread (BENCHMARKS.md); a single row (MKL's matrix-vector kernel) is
unchanged. The ops are torch's own (``torch.ops.mkldnn``), the ones inductor emits when it freezes
weights, so nothing beyond torch is needed.

Results equal ``F.linear`` to float32 rounding (a different summation order; checked in
``tests/models/test_packed_linear.py``), so greedy tokens match transformers as before.

Only plain float32 ``nn.Linear`` modules on CPU are packed: tensor-parallel linears sum partial
products in their own forward, batch-invariant ones tile by design, and other dtypes or devices
have their own kernels.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


def can_prepack() -> bool:
    """Whether this torch build has oneDNN and its packed-linear ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


class PackedLinear(nn.Linear):
    """``nn.Linear`` computing with a oneDNN-packed copy of its weight (same parameters, same names).

    NOTE: the packed copy is taken once, by :func:`prepack_linears`; a weight changed in place
    afterwards is not seen by ``forward`` until the module is packed again.
    """

    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def _packable(module: nn.Module) -> bool:
    if type(module) is not nn.Linear:
        return False
    weight = module.weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def prepack_linears(model: nn.Module) -> int:
    """Turn every plain float32 CPU ``nn.Linear`` of ``model`` into a :class:`PackedLinear` in place; returns how many were packed (0 without oneDNN).

    A weight shared by several modules (a tied LM head) is packed once per module that multiplies
    by it; the parameters themselves are untouched, so embeddings and state dicts see no change.
    """
    if not can_prepack():
        return 0
    count = 0
    for module in model.modules():
        if not _packable(module):
            continue
        packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
        module.__class__ = PackedLinear
        module.packed_weight = packed
        count += 1
    return count


def unpack_linears(model: nn.Module) -> int:
    """Undo :func:`prepack_linears`: every :class:`PackedLinear` becomes a plain ``nn.Linear``
    again (its packed copy dropped); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is PackedLinear:
            del module.packed_weight
            module.__class__ = nn.Linear
            count += 1
    return count


def prepacked_bytes(modules: list[nn.Module], device: torch.device, *, batch_invariant: bool) -> int:
    """Bytes the packed copies of ``modules``' linears take (or will take once loaded on ``device``):
    each packable linear holds its weight twice, as a parameter and packed. Decided by the rule
    :func:`prepack_linears` applies, not by what is packed now, so a model built on the meta device
    and the same model loaded give the same number and the KV pool is sized the same."""
    if batch_invariant or torch.device(device).type != "cpu" or not can_prepack():
        return 0
    seen: set[int] = set()
    total = 0
    for module in modules:
        for sub in module.modules():
            if type(sub) not in (nn.Linear, PackedLinear) or sub.weight.dtype != torch.float32:
                continue
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            total += sub.weight.numel() * sub.weight.element_size()
    return total


@contextmanager
def running_unpacked(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Within the block, the :class:`PackedLinear` among ``modules`` multiply by their parameter as a
    plain ``nn.Linear`` does (their packed copies kept, nothing re-packed on exit). For passes that
    swap parameters for other tensors, e.g. fake ones (``graphs/graph_safety.py``): the packed copy
    is a oneDNN tensor outside such a swap."""
    packed = [m for m in modules if type(m) is PackedLinear]
    for module in packed:
        module.__class__ = nn.Linear
    try:
        yield
    finally:
        for module in packed:
            module.__class__ = PackedLinear
