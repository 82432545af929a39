"""The compiled per-layer ops (``layer_ops.c``): RMSNorm, RMSNorm after the residual add, RoPE in
place, and the candidate test of the screened greedy head, for float32 decoders on CPU.

``WARMCAP_CPU_LAYER_OPS`` (``auto``/``torch``/``kernel``, :mod:`.policy`) decides at model load
(:func:`load_layer_ops`); a model keeps what it was given. Each op also checks its tensors on every
call (:func:`~warmcap.cpu_kernels.policy.plain_cpu_tensors` and the layout it needs) and returns
None where torch's ops must run instead, so callers keep their torch path beside it.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from warmcap.cpu_kernels.policy import load_by_mode, plain_cpu_tensors

log = logging.getLogger("warmcap.models")

ENV = "WARMCAP_CPU_LAYER_OPS"

_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_RMS_NORM_ARGS = [_ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, ctypes.c_float, _i32]
_ROPE_ARGS = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i32]
_GREEDY_ARGS = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i32]


def _rows(x: torch.Tensor, n: int) -> bool:
    """x is ``[rows, n]`` with unit stride along n (any row stride)."""
    return x.dim() == 2 and x.shape[1] == n and x.stride(1) == 1


@dataclass(frozen=True, slots=True)
class LayerOps:
    """The library's functions, bound."""

    _rms_norm: ctypes._CFuncPtr  # type: ignore[name-defined]
    _rope: ctypes._CFuncPtr  # type: ignore[name-defined]
    _greedy: ctypes._CFuncPtr  # type: ignore[name-defined]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """``F.rms_norm(x, weight.shape, weight, eps)`` for x ``[rows, n]``; None when the kernel
        cannot take these tensors."""
        n = weight.shape[0]
        if not (_rows(x, n) and weight.is_contiguous() and plain_cpu_tensors(x, weight)):
            return None
        out = torch.empty(x.shape, dtype=torch.float32)
        self._norm(out, None, x, None, weight, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(h, rms_norm(h))`` for ``h = x + delta``, both ``[rows, n]``, in one pass; None when
        the kernel cannot take these tensors. ``h`` is exactly ``x + delta``."""
        n = weight.shape[0]
        if not (
            _rows(x, n)
            and _rows(delta, n)
            and x.shape == delta.shape
            and weight.is_contiguous()
            and plain_cpu_tensors(x, delta, weight)
        ):
            return None
        h = torch.empty(x.shape, dtype=torch.float32)
        out = torch.empty(x.shape, dtype=torch.float32)
        self._norm(out, h, x, delta, weight, eps)
        return h, out

    def _norm(
        self,
        out: torch.Tensor,
        h: torch.Tensor | None,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> None:
        """``warmcap_rms_norm`` on checked tensors: ``out`` = norm of x (+ delta, stored to h)."""
        self._rms_norm(
            out.data_ptr(),
            None if h is None else h.data_ptr(),
            x.data_ptr(),
            x.stride(0),
            None if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0),
            weight.data_ptr(),
            x.shape[0],
            weight.shape[0],
            eps,
            torch.get_num_threads(),
        )

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Rotate x ``[T, H, D]`` in place by cos/sin ``[T, D]``, bit for bit as
        :func:`~warmcap.models.rope.apply_rope`; False (x untouched) when the kernel cannot take
        these tensors."""
        if x.dim() != 3 or x.stride(2) != 1 or x.shape[2] % 2:
            return False
        t, heads, d = x.shape
        if cos.shape != (t, d) or sin.shape != (t, d) or cos.stride(1) != 1 or sin.stride() != cos.stride():
            return False
        if not plain_cpu_tensors(x, cos, sin):
            return False
        self._rope(
            x.data_ptr(),
            x.stride(0),
            x.stride(1),
            t,
            heads,
            d,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
            torch.get_num_threads(),
        )
        return True

    def greedy_candidates(
        self,
        approx: torch.Tensor,
        cx: torch.Tensor,
        absolute: torch.Tensor,
        norms: torch.Tensor,
        scratch: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The candidate test of :class:`~warmcap.models.greedy_head.GreedyHead` in one call:
        ``(ids, lo)``, the candidates' ids ascending (int64 ``[K]``) and each row's lower bound
        ``lo`` (float32 ``[M, 1]``), for the bf16 screen ``approx`` ``[M, V]`` (unit stride in V),
        ``cx`` and ``absolute`` float32 ``[M, 1]`` and the row norms ``[V]``. ``scratch`` is uint8,
        at least ``9 * V`` bytes. None when the kernel cannot take these tensors."""
        m, v = approx.shape
        if not (
            approx.dtype == torch.bfloat16
            and approx.device.type == "cpu"
            and approx.stride(1) == 1
            and cx.shape == absolute.shape == (m, 1)
            and norms.shape == (v,)
            and cx.is_contiguous()
            and absolute.is_contiguous()
            and norms.is_contiguous()
            and scratch.dtype == torch.uint8
            and scratch.numel() >= 9 * v
            and scratch.is_contiguous()
            and plain_cpu_tensors(cx, absolute, norms)
        ):
            return None
        lo = torch.empty((m, 1), dtype=torch.float32)
        ids = scratch[: 8 * v].view(torch.int64)
        k = self._greedy(
            approx.data_ptr(),
            approx.stride(0),
            cx.data_ptr(),
            absolute.data_ptr(),
            norms.data_ptr(),
            m,
            v,
            lo.data_ptr(),
            scratch[8 * v :].data_ptr(),
            ids.data_ptr(),
            torch.get_num_threads(),
        )
        return ids[:k].clone(), lo


def load_layer_ops() -> LayerOps | None:
    """The ops, or None for torch's (``torch`` mode, or ``auto`` and no working compiler: then one
    warning with the reason). ``kernel`` mode raises :class:`ConfigError` instead."""
    lib = load_by_mode(ENV, "layer_ops.c", what="the CPU layer ops", instead="torch's", log=log)
    if lib is None:
        return None
    rms_norm, rope, greedy = lib.warmcap_rms_norm, lib.warmcap_rope, lib.warmcap_greedy_candidates
    rms_norm.argtypes, rms_norm.restype = _RMS_NORM_ARGS, None
    rope.argtypes, rope.restype = _ROPE_ARGS, None
    greedy.argtypes, greedy.restype = _GREEDY_ARGS, ctypes.c_int64
    return LayerOps(rms_norm, rope, greedy)
