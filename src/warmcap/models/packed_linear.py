"""Linear layers whose weights are prepacked once for a CPU GEMM.

``F.linear`` on CPU multiplies by the ``[out, in]`` weight as stored, and MKL re-blocks it on every
call. A prepacked copy is laid out once for the kernel that reads it:
- the compiled GEMM's column blocks (``kernels/cpu/gemm.c``, :class:`~warmcap.kernels.cpu.gemm.BlockedWeight`),
  where the system compiler builds it and ``$WARMCAP_CPU_GEMM`` allows it: the loader's default;
- oneDNN's blocked layout otherwise (``torch.ops.mkldnn``, the ops inductor emits when it freezes
  weights): measured 1.7x faster than ``F.linear`` over the linears of SmolLM2 at decode sizes.
The compiled GEMM measured 1.19x faster than oneDNN's over whole runs of the throughput workload
(BENCHMARKS.md): no per-call primitive cost, and cold weights streamed better.

Sibling linears that read the same input (q/k/v, gate/up; a module lists them in
``packed_groups``) are packed as one weight and run as one GEMM (:class:`PackedGroup`): fewer,
larger calls, the same values bit for bit.

Results equal ``F.linear`` to float32 rounding (a different summation order; checked in
``tests/models/test_packed_linear.py``), so greedy tokens match transformers as before.

Float32 ``nn.Linear`` modules on CPU are packed, and the subclasses that declare a ``finish``
class attribute: the tensor-parallel linears of ``models/layers.py``. ``finish`` None (a
column-parallel shard) means the product is the layer's output, as for a plain linear; a method
(row-parallel: all-reduce, then the bias; the LM head: all-gather) is handed the packed product
*without* the bias and returns the layer's output. So a rank's shard runs the same compiled GEMM
(and the same q/k/v and gate/up groups) as an unsharded model. Batch-invariant linears tile by
design and other dtypes or devices have their own kernels: they stay as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from warmcap.kernels.cpu.gemm import BLOCK, BlockedWeight, Gemm, blocked_bytes, load_gemm


def can_prepack() -> bool:
    """Whether this torch build has oneDNN and its packed-linear ops (the fallback layout; without
    them nothing is packed)."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


#: a packed weight: oneDNN's (a tensor) or the compiled GEMM's (which holds its bias)
Packed = torch.Tensor | BlockedWeight


def _linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None, gemm: Gemm | None) -> torch.Tensor:
    if isinstance(packed, BlockedWeight):
        assert gemm is not None
        out = gemm.linear(x, packed)
        if out is None:
            # fake tensors, tracing or gradients: the same product through torch
            weight, b = packed.dense()
            out = F.linear(x, weight, b)
        return out
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack_weight(weight: torch.Tensor, bias: torch.Tensor | None, gemm: Gemm | None) -> Packed:
    if gemm is not None:
        return BlockedWeight.pack(weight, bias)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


@dataclass(eq=False, slots=True)
class PackedGroup:
    """One packed weight for sibling linears that read the same input (q/k/v, gate/up): one
    GEMM over their concatenated output features instead of one per linear.

    Measured 1.4x faster than the separate packed products at 16 rows (BENCHMARKS.md) and equal
    to them bit for bit: each output feature's dot product is summed the same way.
    """

    weight: Packed
    bias: torch.Tensor | None
    #: output features of each member, in order
    sizes: tuple[int, ...]
    #: the compiled GEMM when ``weight`` is its layout; None: oneDNN's
    gemm: Gemm | None = None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The members' outputs side by side along the last dim, in order."""
        return _linear(x, self.weight, self.bias, self.gemm)

    def columns(self, x: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Output features ``[start, start + count)`` of :meth:`product` (the same bits): a GEMM of
        those columns alone where the compiled GEMM holds the weight and ``start`` is on a column
        block, else a slice of the whole product."""
        if self.gemm is not None:
            assert isinstance(self.weight, BlockedWeight)
            out = self.gemm.linear_columns(x, self.weight, start, count)
            if out is not None:
                return out
        return self.product(x)[..., start : start + count]

    def runs_columns(self, start: int) -> bool:
        """Whether :meth:`columns` from ``start`` computes only those columns (a compiled GEMM
        over whole column blocks) rather than slicing the whole product."""
        return self.gemm is not None and isinstance(self.weight, BlockedWeight) and start % BLOCK == 0

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every member's output, in order (views of one product)."""
        return self.product(x).split(self.sizes, dim=-1)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(a(x)) * b(x)`` for a group of two, (gate, up), in the GEMM's own pass; None where
        only the product can run (oneDNN's layout, other sizes, inputs the kernel cannot take)."""
        if self.gemm is None or len(self.sizes) != 2 or self.sizes[0] != self.sizes[1]:
            return None
        assert isinstance(self.weight, BlockedWeight)
        return self.gemm.silu_mul(x, self.weight)


class PackedLinear(nn.Linear):
    """``nn.Linear`` computing with a packed copy of its weight (same parameters, same names).

    A member of a :class:`PackedGroup` holds no copy of its own (``packed_weight`` is None): its
    owner calls the group through :func:`packed_group`; called alone it still gives its own output,
    by running the whole group.

    NOTE: the packed copy is taken once, by :func:`prepack_linears`; a weight changed in place
    afterwards is not seen by ``forward`` until the module is packed again.
    """

    packed_weight: Packed | None
    group: PackedGroup | None
    group_index: int
    #: the compiled GEMM when ``packed_weight`` is its layout; None: oneDNN's
    gemm: Gemm | None
    #: the class the module had before packing (``nn.Linear`` or a tensor-parallel linear), which
    #: unpacking restores and whose ``finish`` completes the product
    unpacked_class: type[nn.Linear]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            return self.group(x)[self.group_index]
        assert self.packed_weight is not None
        finish = _finish_of(self.unpacked_class)
        if finish is None:
            return _linear(x, self.packed_weight, self.bias, self.gemm)
        return finish(self, _linear(x, self.packed_weight, None, self.gemm))

    @property
    def is_plain(self) -> bool:
        """Whether the product is the whole output (a plain linear, not a tensor-parallel shard
        whose outputs are summed or gathered over the ranks)."""
        return self.unpacked_class is nn.Linear


def packed_group(*linears: nn.Module) -> PackedGroup | None:
    """The group ``linears`` were packed into together, in this order; None when they were not (no
    oneDNN, packing off, or a pass running them unpacked: :func:`running_unpacked`)."""
    first = linears[0]
    if type(first) is not PackedLinear or first.group is None:
        return None
    group = first.group
    for i, linear in enumerate(linears):
        if type(linear) is not PackedLinear or linear.group is not group or linear.group_index != i:
            return None
    return group


def _finish_of(cls: type) -> Any:
    """``cls.finish``: None for a plain linear or a column-parallel shard (see the module docstring)."""
    return getattr(cls, "finish", None)


def _packable_class(cls: type) -> bool:
    """A plain ``nn.Linear``, or a subclass declaring ``finish`` (the tensor-parallel linears)."""
    return cls is nn.Linear or (
        issubclass(cls, nn.Linear) and cls is not PackedLinear and hasattr(cls, "finish")
    )


def _packable(module: nn.Module) -> bool:
    if not _packable_class(type(module)):
        return False
    weight = module.weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def _pack(
    module: nn.Module, packed: Packed | None, group: PackedGroup | None, index: int, gemm: Gemm | None
) -> None:
    module.unpacked_class = type(module)
    module.__class__ = PackedLinear
    module.packed_weight = packed
    module.group = group
    module.group_index = index
    module.gemm = gemm


def _pack_group(owner: nn.Module, names: tuple[str, ...], gemm: Gemm | None) -> list[nn.Module]:
    """Pack ``owner``'s children ``names`` as one :class:`PackedGroup`; returns them, or [] when they
    cannot share one GEMM (not all packable, other inputs, bias on some only)."""
    members = [getattr(owner, name, None) for name in names]
    if not all(m is not None and _packable(m) and _finish_of(type(m)) is None for m in members):
        return []
    if len({m.in_features for m in members}) != 1 or len({m.bias is None for m in members}) != 1:
        return []
    weight = torch.cat([m.weight.detach() for m in members])
    bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
    sizes = tuple(m.out_features for m in members)
    group = PackedGroup(_pack_weight(weight, bias, gemm), bias, sizes, gemm)
    for i, member in enumerate(members):
        _pack(member, None, group, i, gemm)
    return members


def prepack_linears(
    model: nn.Module, *, groups: bool = True, gemm: Gemm | bool | None = True, gemm_mode: str | None = None
) -> int:
    """Turn every plain float32 CPU ``nn.Linear`` of ``model`` into a :class:`PackedLinear` in place;
    returns how many were packed (0 without oneDNN).

    A module that lists sibling linears in ``packed_groups`` (tuples of child names reading the same
    input) gets each tuple packed as one :class:`PackedGroup`, for its forward to call through
    :func:`packed_group` (``groups=False``: each packed alone, the benchmark's peer).

    ``gemm``: the layout. True (the loader's) packs for the compiled GEMM when
    the config's ``kernel.cpu_gemm`` (``gemm_mode``; None: its default) allows it and it builds
    (:func:`~warmcap.kernels.cpu.gemm.load_gemm`),
    else for oneDNN; a :class:`~warmcap.kernels.cpu.gemm.Gemm` packs for that one; False or None
    for oneDNN. A weight shared by several modules (a tied LM head) is packed once per
    module that multiplies by it; the parameters themselves are untouched, so embeddings and state
    dicts see no change.
    """
    if not can_prepack():
        return 0
    if gemm is True:
        gemm = load_gemm(gemm_mode) if any(_packable(m) for m in model.modules()) else None
    elif gemm is False:
        gemm = None
    count = 0
    for module in list(model.modules()) if groups else ():
        for names in getattr(module, "packed_groups", ()):
            count += len(_pack_group(module, names, gemm))
    for module in model.modules():
        if not _packable(module):
            continue
        # A linear with a finish adds its bias there, after the ranks' partial products are summed.
        bias = module.bias if _finish_of(type(module)) is None else None
        _pack(module, _pack_weight(module.weight, bias, gemm), None, 0, gemm)
        count += 1
    return count


def unpack_linears(model: nn.Module) -> int:
    """Undo :func:`prepack_linears`: every :class:`PackedLinear` gets its class back (``nn.Linear``
    or its tensor-parallel linear; its packed copy dropped); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is PackedLinear:
            cls = module.unpacked_class
            del module.packed_weight, module.group, module.group_index, module.gemm, module.unpacked_class
            module.__class__ = cls
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
            if not _packable_class(type(sub)) and type(sub) is not PackedLinear:
                continue
            if sub.weight.dtype != torch.float32:
                continue
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            # the larger of the two layouts: the GEMM's pads the output features to whole blocks
            total += blocked_bytes(*sub.weight.shape)
    return total


@contextmanager
def running_unpacked(modules: Iterable[nn.Module], *, keep_compiled: bool = False) -> Iterator[None]:
    """Within the block, the :class:`PackedLinear` among ``modules`` multiply by their parameter as a
    plain ``nn.Linear`` does, through the class they had before packing (their packed copies kept,
    nothing re-packed on exit). For passes that
    swap parameters for other tensors, e.g. fake ones (``graphs/proof/safety.py``): the packed copy
    is a oneDNN tensor outside such a swap.

    ``keep_compiled``: linears packed for the compiled GEMM stay packed (its operators have fake
    implementations; a fake-tensor pass that allows real inputs runs them on the packed copy's
    shapes), so the pass sees the GEMM calls, and the grouped RoPE, that a real step makes."""
    packed = [
        m
        for m in modules
        if type(m) is PackedLinear
        and not (
            keep_compiled
            and isinstance(m.packed_weight if m.group is None else m.group.weight, BlockedWeight)
        )
    ]
    for module in packed:
        module.__class__ = module.unpacked_class
    try:
        yield
    finally:
        for module in packed:
            module.__class__ = PackedLinear
