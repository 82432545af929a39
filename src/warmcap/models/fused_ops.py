"""Fused decoder-layer ops on CUDA: RMSNorm (with the residual add), RoPE with the KV write,
SiLU-and-multiply and the greedy argmax, each one Triton kernel (``kernels/triton/layer_ops.py``).

One capability check (:func:`fused_ops_for`) decides: a CUDA device with Triton importable, unless
``WARMCAP_FUSED_OPS=torch``. The loader then hands a :class:`FusedOps` to every module declaring
``fused_ops`` (:func:`attach_fused_ops`), as it hands the compiled CPU layer ops to CPU models;
torch's ops stay the reference and the path for everything the kernels do not take (each method
returns None / False for tensors it refuses). Tests run the same kernels on CPU tensors under
``TRITON_INTERPRET=1`` by building ``FusedOps(torch.device("cpu"))`` themselves.

Each op is a ``torch.library`` custom op (namespace ``warmcap_fused``) with a fake
implementation: a CUDA graph records its one launch, a fake-tensor check (``graphs/proof/safety.py``)
or ``torch.compile`` sees one opaque op, and ``devtools/op_count.py`` counts it once.

Why Triton kernels and not ``torch.compile`` (inductor) inside the captured graphs: inductor would
have to compile every captured shape of every model at start-up (15-22 s cold for one CPU graph
here, ENVIRONMENT.md), against the start-up budget of issue 27, and it cannot fuse the RoPE into
the paged KV write through the slot mapping, which is an ``index_copy_`` into a cache it does not
own; these kernels compile once per dtype and head size and are shared by every shape. No GPU was
available to time the two against each other.

The KV write: :meth:`FusedOps.rope_write_kv` writes k and v where the attention backend would have
written them, at the pass's ``meta.slot_mapping`` (PAD to the sink), so the KV-write log
(``runner_v2/kv_writes.py``), which records those slot mappings, still covers every slot written
(invariant I2); the layer then tells the backend the step's K/V are in place (``kv_written``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from warmcap.config import FUSED_OPS_MODES, kernel_default
from warmcap.errors import ConfigError

#: environment switch: ``auto`` (default: the fused ops on CUDA when Triton imports) or ``torch``
ENV = "WARMCAP_FUSED_OPS"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: widest row one RMSNorm program holds
_MAX_NORM_WIDTH = 16384


def _mode(mode: str | None) -> str:
    if mode is None:
        mode = kernel_default("fused_ops")
    if mode not in FUSED_OPS_MODES:
        raise ConfigError(f"fused_ops {mode!r} is not a fused-ops mode; use auto or torch")
    return mode


def fused_ops_for(device: torch.device | str, mode: str | None = None) -> FusedOps | None:
    """The capability check: fused ops for a model on ``device``, or None (torch's ops). Only a
    CUDA device with CUDA available and Triton importable gets them, unless the config's
    ``kernel.fused_ops`` (``mode``; None: its default, ``$WARMCAP_FUSED_OPS``) is ``torch``."""
    device = torch.device(device)
    if _mode(mode) == "torch" or device.type != "cuda" or not torch.cuda.is_available():
        return None
    if importlib.util.find_spec("triton") is None:
        return None
    return FusedOps(device)


def attach_fused_ops(model: nn.Module, ops: FusedOps) -> None:
    """Give ``ops`` to every module of ``model`` whose class declares ``fused_ops``, and stack the
    linears of each such module's ``packed_groups`` (q/k/v, gate/up) into one GEMM each
    (:class:`StackedLinear`)."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(type(module), "fused_ops"):
                module.fused_ops = ops
                stacks = {}
                for names in getattr(type(module), "packed_groups", ()):
                    stack = StackedLinear.of([getattr(module, n) for n in names], ops)
                    if stack is not None:
                        stacks[names] = stack
                if stacks:
                    module.fused_stacks = stacks


def stacked_product(
    module: nn.Module, names: tuple[str, ...], x: torch.Tensor
) -> tuple[torch.Tensor, ...] | None:
    """The outputs of ``module``'s linears ``names`` for ``x`` from their one stacked GEMM, or None
    when they were not stacked (or no longer are)."""
    stacks = getattr(module, "fused_stacks", None)
    stack = None if stacks is None else stacks.get(names)
    return None if stack is None else stack(x)


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as 2-D rows over its last dimension with unit stride (a view where possible)."""
    if x.dim() == 0 or x.stride(-1) != 1:
        return None
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else None


@dataclass(frozen=True, slots=True)
class FusedOps:
    """The fused ops for tensors on ``device``; each method returns None (False) for tensors it does
    not take, and the caller then runs torch's ops."""

    device: torch.device

    def __post_init__(self) -> None:
        # NOTE: torch.device("cuda") != torch.device("cuda:0"), the device tensors report.
        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        object.__setattr__(self, "device", device)

    def accepts(self, *tensors: torch.Tensor) -> bool:
        """Every tensor is on this device in a dtype the kernels take."""
        return all(t.device == self.device and t.dtype in _DTYPES for t in tensors)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """``RMSNorm.forward``'s result in one launch."""
        if not self.accepts(x, weight) or x.dtype != weight.dtype or not _norm_shape(x, weight):
            return None
        rows = _rows(x)
        if rows is None:
            return None
        return torch.ops.warmcap_fused.rms_norm(rows, weight, eps).view(x.shape)

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(h + delta, RMSNorm(h + delta))`` in one launch."""
        if not self.accepts(h, delta, weight) or not (h.dtype == delta.dtype == weight.dtype):
            return None
        if h.shape != delta.shape or not _norm_shape(h, weight):
            return None
        rows, drows = _rows(h), _rows(delta)
        if rows is None or drows is None:
            return None
        total, normed = torch.ops.warmcap_fused.add_rms_norm(rows, drows, weight, eps)
        return total.view(h.shape), normed.view(h.shape)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` in one launch."""
        if not self.accepts(gate, up) or gate.dtype != up.dtype or gate.shape != up.shape:
            return None
        g, u = _rows(gate), _rows(up)
        if g is None or u is None:
            return None
        return torch.ops.warmcap_fused.silu_mul(g, u).view(gate.shape)

    def rope_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> bool:
        """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` in place (``models/rope.apply_rope``) and
        write k and v at ``slot_mapping[:T]`` of ``kv_cache`` ``[2, blocks, block_size, Hkv, D]``,
        PAD to the sink block, as the attention backends write them. False: nothing was done."""
        if (
            not self.accepts(q, k, v, cos, sin, kv_cache)
            or len({q.dtype, k.dtype, v.dtype, cos.dtype, sin.dtype}) != 1
        ):
            return False
        t, _, d = q.shape
        if k.dim() != 3 or v.shape != k.shape or k.shape[0] != t or k.shape[2] != d or d % 2:
            return False
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != tuple(k.shape[1:]):
            return False
        if cos.shape != (t, d) or sin.shape != (t, d) or slot_mapping.dtype != torch.int64:
            return False
        if slot_mapping.device != self.device or slot_mapping.shape[0] < t:
            return False
        if any(x.stride(-1) != 1 for x in (q, k, v, cos, sin, kv_cache)):
            return False
        torch.ops.warmcap_fused.rope_write_kv(q, k, v, cos, sin, kv_cache, slot_mapping)
        return True

    def greedy_argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[N] int64: each row's first maximum, -1 for a row with a NaN or an infinity."""
        if not self.accepts(logits) or logits.dim() != 2 or logits.stride(-1) != 1:
            return None
        return torch.ops.warmcap_fused.greedy_argmax(logits)


class StackedLinear:
    """Linears that read the same input (q/k/v, gate/up) as one GEMM: their weights (and biases)
    are stacked into one tensor once, and each linear's parameter becomes a view of its rows, so the
    model holds no second copy and the checkpoint names still reach the same memory. A call checks
    that the parameters are still those views (a later ``load_weights(assign=True)`` or ``.to()``
    rebinds them) and otherwise returns None, so the linears run one by one."""

    def __init__(self, linears: list[nn.Linear], weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.linears = linears
        self.weight = weight
        self.bias = bias
        self.sizes = [lin.out_features for lin in linears]
        self._ptrs = [lin.weight.data_ptr() for lin in linears]

    @classmethod
    def of(cls, linears: list[nn.Module], ops: FusedOps) -> StackedLinear | None:
        """Stack ``linears`` (under ``torch.no_grad``) when they are plain ``nn.Linear`` of one
        input size on ``ops``' device in one dtype, all with a bias or none; else None."""
        if len(linears) < 2 or any(type(lin) is not nn.Linear for lin in linears):
            return None
        first = linears[0]
        has_bias = first.bias is not None
        for lin in linears:
            if lin.in_features != first.in_features or (lin.bias is not None) != has_bias:
                return None
            if not ops.accepts(lin.weight) or lin.weight.dtype != first.weight.dtype:
                return None
        weight = torch.cat([lin.weight for lin in linears])
        bias = torch.cat([lin.bias for lin in linears]) if has_bias else None
        sizes = [lin.out_features for lin in linears]
        for lin, w, b in zip(
            linears, weight.split(sizes), bias.split(sizes) if has_bias else [None] * len(sizes), strict=True
        ):
            lin.weight = nn.Parameter(w, requires_grad=False)
            if b is not None:
                lin.bias = nn.Parameter(b, requires_grad=False)
        return cls(linears, weight, bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        if any(lin.weight.data_ptr() != p for lin, p in zip(self.linears, self._ptrs, strict=True)):
            return None
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def _norm_shape(x: torch.Tensor, weight: torch.Tensor) -> bool:
    n = weight.shape[0]
    return weight.dim() == 1 and x.shape[-1] == n and n <= _MAX_NORM_WIDTH and weight.stride(0) == 1


class FusedGreedyHead:
    """The greedy head of a model with fused ops: the LM head's product in the model's dtype, then
    one argmax launch over it, never the ``[N, V]`` float32 logits. The argmax of the float32 cast
    is the argmax of the product (the cast is exact), so tokens equal the full path's; a row with a
    non-finite logit makes :meth:`argmax` return None and the step take the full logits, where the
    engine's non-finite check sees it.

    The non-finite verdict stays on the device: such a row's id is negative, and the runner reads
    whether any is in the step's one token fetch (``declines_on_device``), then takes the full
    logits for the step; checking here would be a second host wait every step."""

    #: a negative id marks a row this head declines; the caller checks after its fetch
    declines_on_device = True

    def __init__(self, head: nn.Linear, ops: FusedOps) -> None:
        self.head = head
        self.ops = ops

    def argmax(self, x: torch.Tensor, *, decline: bool = False) -> torch.Tensor | None:
        """Each row's argmax, or -1 for a row with a non-finite logit; None: not this batch (or
        ``decline``: the caller wants the full logits)."""
        return None if decline else self.ops.greedy_argmax(self.head(x))


# ---- the custom ops ------------------------------------------------------------------------------
# NOTE: registered when this module is imported (by the loader, only where fused_ops_for gave ops,
# or by tests); their bodies import the Triton kernels on first call.


@torch.library.custom_op("warmcap_fused::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from warmcap.kernels.triton import layer_ops as triton_ops

    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    triton_ops.rms_norm(x, weight, eps, out, None, None)
    return out


@_rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("warmcap_fused::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from warmcap.kernels.triton import layer_ops as triton_ops

    total = torch.empty_like(h, memory_format=torch.contiguous_format)
    out = torch.empty_like(h, memory_format=torch.contiguous_format)
    triton_ops.rms_norm(h, weight, eps, out, delta, total)
    return total, out


@_add_rms_norm_op.register_fake
def _(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = {"memory_format": torch.contiguous_format}
    return torch.empty_like(h, **shape), torch.empty_like(h, **shape)


@torch.library.custom_op("warmcap_fused::silu_mul", mutates_args=())
def _silu_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from warmcap.kernels.triton import layer_ops as triton_ops

    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    triton_ops.silu_mul(gate, up, out)
    return out


@_silu_mul_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("warmcap_fused::rope_write_kv", mutates_args=("q", "k", "kv_cache"))
def _rope_write_kv_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    from warmcap.kernels.triton import layer_ops as triton_ops

    triton_ops.rope_write_kv(q, k, v, cos, sin, kv_cache, slot_mapping)


@_rope_write_kv_op.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    return None


@torch.library.custom_op("warmcap_fused::greedy_argmax", mutates_args=())
def _greedy_argmax_op(logits: torch.Tensor) -> torch.Tensor:
    from warmcap.kernels.triton import layer_ops as triton_ops

    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    triton_ops.greedy_argmax(logits, out)
    return out


@_greedy_argmax_op.register_fake
def _(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)
