"""The compiled float32 GEMM (``gemm.c``) and its weight layout, for the linears of CPU models.

A weight ``[N, K]`` is packed once into column blocks, ``[ceil(N/16), K, 16]``
(:class:`BlockedWeight`), and multiplied by :meth:`Gemm.linear` (or, for a gated MLP's gate and
up, by :meth:`Gemm.silu_mul`, which applies SiLU and the product in the same pass). Each output is
one multiply-add chain over K in order, so a column's value does not depend on the batch, its
neighbours or the thread count (``gemm.c``).

Both products are operators torch sees, ``warmcap::gemm`` and ``warmcap::gemm_silu_mul``
(``torch.ops.warmcap``): fake tensors and torch.compile run their fake implementations (shapes
only), real CPU tensors the C code, called without torch's dispatcher when nothing watches
(:class:`~warmcap.kernels.cpu.policy.CpuOperator`).

``WARMCAP_CPU_GEMM`` (``auto``/``torch``/``kernel``, :mod:`.policy`) decides at model load
(:func:`load_gemm`, called by ``models/packed_linear.prepack_linears``): ``torch`` keeps oneDNN's
packed product. A call whose tensors the kernel cannot take (not float32, or a gradient to record;
:func:`~warmcap.kernels.cpu.policy.kernel_can_take`) gets None, and the caller multiplies by
:meth:`BlockedWeight.dense` instead.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from functools import cache

import torch

from warmcap.kernels.cpu.build import load_library
from warmcap.kernels.cpu.policy import CpuOperator, c_call, kernel_can_take, launch_scratch, load_by_mode

log = logging.getLogger("warmcap.models")

ENV = "WARMCAP_CPU_GEMM"
SOURCE = "gemm.c"
#: output features per column block (one 16-float vector)
BLOCK = 16

_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_GEMM_ARGS = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _i32]


def padded(n: int) -> int:
    """``n`` rounded up to whole column blocks (of output features, not KV blocks)."""
    return n + (-n) % BLOCK


def blocked_bytes(out_features: int, in_features: int) -> int:
    """Bytes of the packed copy of a float32 ``[out_features, in_features]`` weight."""
    return padded(out_features) * in_features * 4


@dataclass(eq=False, slots=True)
class BlockedWeight:
    """A float32 weight ``[N, K]`` packed for ``gemm.c``, with its bias (padded) if any."""

    #: ``[ceil(N/16), K, 16]``: block b holds output features 16b..16b+15 (zeros past N)
    blocks: torch.Tensor
    out_features: int
    #: float32 ``[ceil(N/16) * 16]`` (zeros past N), or None
    bias: torch.Tensor | None = None

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> BlockedWeight:
        """The packed copy of ``weight`` ``[N, K]`` (and ``bias`` ``[N]``); the inputs are not kept."""
        n, k = weight.shape
        rows = torch.zeros(padded(n), k, dtype=torch.float32)
        rows[:n] = weight.detach()
        blocks = rows.view(-1, BLOCK, k).transpose(1, 2).contiguous()
        padded_bias = None
        if bias is not None:
            padded_bias = torch.zeros(padded(n), dtype=torch.float32)
            padded_bias[:n] = bias.detach()
        return cls(blocks, n, padded_bias)

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight [N, K], bias [N] or None)`` unpacked (copies): for the calls the kernel
        cannot take, through ``F.linear``."""
        k = self.in_features
        weight = self.blocks.transpose(1, 2).reshape(-1, k)[: self.out_features]
        return weight, None if self.bias is None else self.bias[: self.out_features]

    def rows(self, ids: torch.Tensor) -> BlockedWeight:
        """A packed weight of output features ``ids`` only (int64 ``[n]``), in that order, no bias:
        the kernel gives each of them the same bits as in the full product."""
        k = self.in_features
        weight = self.blocks[ids // BLOCK, :, ids % BLOCK]  # [n, K]
        return BlockedWeight.pack(weight.reshape(-1, k))


@cache
def _bind(lib: ctypes.CDLL) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:  # type: ignore[name-defined]
    """``(warmcap_gemm, warmcap_gemm_silu_mul)`` of ``lib``, typed (their arguments agree)."""
    gemm, silu_mul = lib.warmcap_gemm, lib.warmcap_gemm_silu_mul
    for fn in (gemm, silu_mul):
        fn.argtypes, fn.restype = _GEMM_ARGS, None
    return gemm, silu_mul


@cache
def _entry_points() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:  # type: ignore[name-defined]
    """:func:`_bind` on the library (loaded, and built first, when no caller has yet; once per process:
    the library's key reads and hashes the sources)."""
    return _bind(load_library(SOURCE))


def built_lanes() -> int:
    """The accumulator width of the library built for this process's ``WARMCAP_CPU_ISA``: 16 for the
    AVX-512 tiling, 8 for the narrow one (builds it when no caller has yet)."""
    lib = load_library(SOURCE)
    lib.warmcap_gemm_lanes.restype = ctypes.c_int
    return int(lib.warmcap_gemm_lanes())


#: the scratch each thread transposes inputs into, kept between calls (a fresh multi-megabyte
#: buffer per call costs page faults)
_scratch = threading.local()


def _scratch_of(floats: int) -> torch.Tensor:
    # A recorded launch keeps the recording's own buffer (it replays with that address).
    recorded = launch_scratch(floats)
    if recorded is not None:
        return recorded
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < floats:
        buf = _scratch.buf = torch.empty(floats, dtype=torch.float32)
    return buf


def _check(silu: bool, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, n: int) -> None:
    """What the C GEMM assumes of its operator's tensors (raises ValueError)."""
    if (
        blocks.dim() != 3
        or blocks.shape[2] != BLOCK
        or blocks.dtype != torch.float32
        or not blocks.is_contiguous()
    ):
        raise ValueError(
            f"blocks must be contiguous float32 [N/16, K, 16] (BlockedWeight); got {tuple(blocks.shape)}"
        )
    if x.dim() == 0 or x.shape[-1] != blocks.shape[1] or x.dtype != torch.float32:
        raise ValueError(f"x must be float32 [..., {blocks.shape[1]}]; got {x.dtype} {tuple(x.shape)}")
    features = blocks.shape[0] * BLOCK
    if n < 0 or (2 * n if silu else n) > features or (silu and n % BLOCK):
        raise ValueError(f"{n} outputs do not fit {features} packed features")
    if bias is not None and (
        bias.dtype != torch.float32 or not bias.is_contiguous() or bias.numel() < features
    ):
        raise ValueError(f"bias must be contiguous float32 padded to {features}; got {tuple(bias.shape)}")


def _run(
    silu: bool, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """One entry point of the C GEMM on x ``[..., K]``, ``n`` outputs per row."""
    _check(silu, x, blocks, bias, n)
    k = blocks.shape[1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=torch.float32)
    if m and n:
        scratch = _scratch_of(padded(m) * k)  # row tiles of 16, [K, 16] each
        c_call(
            _entry_points()[1 if silu else 0],
            x2.data_ptr(),
            x2.stride(0),
            blocks.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            n,
            m,
            k,
            n,
            scratch.data_ptr(),
            torch.get_num_threads(),
        )
    return out.view(*lead, n)


def _fake(
    silu: bool, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    _check(silu, x, blocks, bias, n)
    return x.new_empty((*x.shape[:-1], n), dtype=torch.float32)


# The two products as operators: ``gemm`` is x . W^T (+ bias) for n outputs; ``gemm_silu_mul`` is
# silu(gate) * up for n = I outputs, blocks holding the gate's and up's 2I features.
_SCHEMA = "(Tensor x, Tensor blocks, Tensor? bias, int n) -> Tensor"
_GEMM = CpuOperator(
    "gemm",
    _SCHEMA,
    lambda x, blocks, bias, n: _run(False, x, blocks, bias, n),
    lambda x, blocks, bias, n: _fake(False, x, blocks, bias, n),
)
_GEMM_SILU_MUL = CpuOperator(
    "gemm_silu_mul",
    _SCHEMA,
    lambda x, blocks, bias, n: _run(True, x, blocks, bias, n),
    lambda x, blocks, bias, n: _fake(True, x, blocks, bias, n),
)


@dataclass(eq=False, slots=True)
class Gemm:
    """The compiled GEMM, loaded (:func:`load_gemm`): its products over packed weights."""

    def linear(self, x: torch.Tensor, weight: BlockedWeight) -> torch.Tensor | None:
        """``F.linear(x, W, b)`` for x ``[..., K]`` float32; None when the kernel cannot take x
        (the caller then runs ``F.linear`` on :meth:`BlockedWeight.dense`)."""
        if not self._takes(x, weight):
            return None
        return _GEMM(x, weight.blocks, weight.bias, weight.out_features)

    def linear_columns(
        self, x: torch.Tensor, weight: BlockedWeight, start: int, count: int
    ) -> torch.Tensor | None:
        """Output features ``[start, start + count)`` of :meth:`linear` alone (``start`` a whole
        number of column blocks), their bits in the whole product; None as there, or when ``start``
        is not on a block."""
        if start % BLOCK or start < 0 or count < 0 or start + count > weight.out_features:
            return None
        if not self._takes(x, weight):
            return None
        first, last = start // BLOCK, padded(start + count) // BLOCK
        bias = None if weight.bias is None else weight.bias[start:]
        return _GEMM(x, weight.blocks[first:last], bias, count)

    def silu_mul(self, x: torch.Tensor, weight: BlockedWeight) -> torch.Tensor | None:
        """``silu(gate) * up`` ``[..., I]`` where ``weight`` packs the gate and up linears as one
        (gate first, ``2I`` output features): the products stay in registers and cache instead of
        a ``[..., 2I]`` tensor and two passes. The products are :meth:`linear`'s bits; SiLU's exp
        is within 1.02 ulp (``exp_nonpositive.h``). None when the kernel cannot take x, or I is not
        a whole number of column blocks."""
        inter = weight.out_features // 2
        if weight.out_features % 2 or inter % BLOCK or not self._takes(x, weight):
            return None
        return _GEMM_SILU_MUL(x, weight.blocks, weight.bias, inter)

    @staticmethod
    def _takes(x: torch.Tensor, weight: BlockedWeight) -> bool:
        return x.dim() > 0 and x.shape[-1] == weight.in_features and kernel_can_take(x)


def load_gemm(mode: str | None = None) -> Gemm | None:
    """The GEMM, or None for oneDNN's (``torch`` mode, or ``auto`` and no working compiler: then
    one warning with the reason). ``kernel`` mode raises :class:`ConfigError` instead. ``mode``:
    the config's ``kernel.cpu_gemm`` (None: its default)."""
    lib = load_by_mode(
        "cpu_gemm", mode, SOURCE, what="the CPU GEMM", instead="oneDNN's packed product", log=log, bind=_bind
    )
    return None if lib is None else Gemm()
