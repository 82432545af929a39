"""The compiled float32 GEMM (``gemm.c``) and its weight layout, for the linears of CPU models.

A weight ``[N, K]`` is packed once into column blocks, ``[ceil(N/16), K, 16]``
(:class:`BlockedWeight`), and multiplied by :meth:`Gemm.linear` (or, for a gated MLP's gate and
up, by :meth:`Gemm.silu_mul`, which applies SiLU and the product in the same pass). Each output is
one multiply-add chain over K in order, so a column's value does not depend on the batch, its
neighbours or the thread count (``gemm.c``).

``WARMCAP_CPU_GEMM`` (``auto``/``torch``/``kernel``, :mod:`.policy`) decides at model load
(:func:`load_gemm`, called by ``models/packed_linear.prepack_linears``): ``torch`` keeps oneDNN's
packed product. A call whose tensors the kernel cannot take (fake tensors, tracing, gradients;
:func:`~warmcap.cpu_kernels.policy.plain_cpu_tensors`) gets None, and the caller multiplies by
:meth:`BlockedWeight.dense` instead.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field

import torch

from warmcap.cpu_kernels.policy import load_by_mode, plain_cpu_tensors

log = logging.getLogger("warmcap.models")

ENV = "WARMCAP_CPU_GEMM"
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


@dataclass(eq=False, slots=True)
class Gemm:
    """The library's GEMM, bound, with the scratch it transposes inputs into (kept between calls:
    a fresh multi-megabyte buffer per call costs page faults)."""

    _gemm: ctypes._CFuncPtr  # type: ignore[name-defined]
    _silu_mul: ctypes._CFuncPtr  # type: ignore[name-defined]
    _scratch: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def linear(self, x: torch.Tensor, weight: BlockedWeight) -> torch.Tensor | None:
        """``F.linear(x, W, b)`` for x ``[..., K]`` float32; None when the kernel cannot take x
        (the caller then runs ``F.linear`` on :meth:`BlockedWeight.dense`)."""
        return self._call(self._gemm, x, weight, weight.out_features)

    def silu_mul(self, x: torch.Tensor, weight: BlockedWeight) -> torch.Tensor | None:
        """``silu(gate) * up`` ``[..., I]`` where ``weight`` packs the gate and up linears as one
        (gate first, ``2I`` output features): the products stay in registers and cache instead of
        a ``[..., 2I]`` tensor and two passes. The products are :meth:`linear`'s bits; SiLU's exp
        is within 1.02 ulp (``exp_nonpositive.h``). None when the kernel cannot take x, or I is not
        a whole number of column blocks."""
        inter = weight.out_features // 2
        if weight.out_features % 2 or inter % BLOCK:
            return None
        return self._call(self._silu_mul, x, weight, inter)

    def _call(
        self,
        fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
        x: torch.Tensor,
        weight: BlockedWeight,
        n: int,
    ) -> torch.Tensor | None:
        """``fn`` (either entry point; their arguments agree) on x ``[..., K]``, for ``n`` outputs
        per row."""
        k = weight.in_features
        if x.dim() == 0 or x.shape[-1] != k or not plain_cpu_tensors(x):
            return None
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        out = torch.empty((m, n), dtype=torch.float32)
        if m and n:
            need = padded(m) * k  # row tiles of 16, [K, 16] each
            if self._scratch.numel() < need:
                self._scratch = torch.empty(need, dtype=torch.float32)
            bias = weight.bias
            fn(
                x2.data_ptr(),
                x2.stride(0),
                weight.blocks.data_ptr(),
                None if bias is None else bias.data_ptr(),
                out.data_ptr(),
                n,
                m,
                k,
                n,
                self._scratch.data_ptr(),
                torch.get_num_threads(),
            )
        return out.view(*lead, n)


def load_gemm() -> Gemm | None:
    """The GEMM, or None for oneDNN's (``torch`` mode, or ``auto`` and no working compiler: then
    one warning with the reason). ``kernel`` mode raises :class:`ConfigError` instead."""
    lib = load_by_mode(ENV, "gemm.c", what="the CPU GEMM", instead="oneDNN's packed product", log=log)
    if lib is None:
        return None
    gemm, silu_mul = lib.warmcap_gemm, lib.warmcap_gemm_silu_mul
    for fn in (gemm, silu_mul):
        fn.argtypes, fn.restype = _GEMM_ARGS, None
    return Gemm(gemm, silu_mul)
