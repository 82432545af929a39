"""The compiled per-layer ops (``layer_ops.c``): RMSNorm, RMSNorm after the residual add, RoPE in
place, and the candidate test of the screened greedy head, for float32 decoders on CPU.

Each is an operator torch sees (``torch.ops.warmcap``: ``rms_norm``, ``add_rms_norm``, ``rope_``,
``greedy_candidates``): fake tensors and torch.compile run its fake implementation, real CPU tensors
the C code, called without torch's dispatcher when nothing watches
(:class:`~warmcap.kernels.cpu.policy.CpuOperator`).

``WARMCAP_CPU_LAYER_OPS`` (``auto``/``torch``/``kernel``, :mod:`.policy`) decides at model load
(:func:`load_layer_ops`); a model keeps what it was given. Each op also checks its tensors on every
call (:func:`~warmcap.kernels.cpu.policy.kernel_can_take` and the layout it needs) and returns
None where torch's ops must run instead, so callers keep their torch path beside it.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import cache

import torch

from warmcap.kernels.cpu.build import load_library
from warmcap.kernels.cpu.policy import CpuOperator, c_call, kernel_can_take, load_by_mode

log = logging.getLogger("warmcap.models")

ENV = "WARMCAP_CPU_LAYER_OPS"
SOURCE = "layer_ops.c"

_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_RMS_NORM_ARGS = [_ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, ctypes.c_float, _i32]
_ROPE_ARGS = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i32]
_GREEDY_ARGS = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i32]


@dataclass(frozen=True, slots=True)
class _Functions:
    rms_norm: ctypes._CFuncPtr  # type: ignore[name-defined]
    rope: ctypes._CFuncPtr  # type: ignore[name-defined]
    greedy: ctypes._CFuncPtr  # type: ignore[name-defined]


@cache
def _bind(lib: ctypes.CDLL) -> _Functions:
    """The library's functions, typed."""
    rms_norm, rope, greedy = lib.warmcap_rms_norm, lib.warmcap_rope, lib.warmcap_greedy_candidates
    rms_norm.argtypes, rms_norm.restype = _RMS_NORM_ARGS, None
    rope.argtypes, rope.restype = _ROPE_ARGS, None
    greedy.argtypes, greedy.restype = _GREEDY_ARGS, ctypes.c_int64
    return _Functions(rms_norm, rope, greedy)


@cache
def _c() -> _Functions:
    """:func:`_bind` on the library (loaded, and built first, when no caller has yet; once per process)."""
    return _bind(load_library(SOURCE))


def _norm(
    out: torch.Tensor,
    h: torch.Tensor | None,
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> None:
    """``warmcap_rms_norm`` on checked tensors: ``out`` = norm of x (+ delta, stored to h)."""
    c_call(
        _c().rms_norm,
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


def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)


def _refuse(op: str, why: str) -> None:
    raise ValueError(f"warmcap::{op}: {why} (LayerOps checks this before calling)")


def _norm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return _rows(x, weight.shape[0]) and weight.is_contiguous()


def _rope_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if x.dim() != 3 or x.stride(2) != 1 or x.shape[2] % 2:
        return False
    t, _, d = x.shape
    return cos.shape == (t, d) and sin.shape == (t, d) and cos.stride(1) == 1 and sin.stride() == cos.stride()


def _greedy_takes(
    approx: torch.Tensor, cx: torch.Tensor, absolute: torch.Tensor, norms: torch.Tensor, scratch: torch.Tensor
) -> bool:
    if approx.dim() != 2:
        return False
    m, v = approx.shape
    return (
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
    )


def _rms_norm_cpu(x, weight, eps):
    if not (_norm_takes(x, weight) and kernel_can_take(x, weight)):
        _refuse("rms_norm", "x must be float32 [rows, n] with unit stride in n, weight [n] contiguous")
    out = torch.empty(x.shape, dtype=torch.float32)
    _norm(out, None, x, None, weight, eps)
    return out


def _add_rms_norm_fake(x, delta, weight, eps):
    return _rms_norm_fake(x, weight, eps), _rms_norm_fake(x, weight, eps)


def _add_rms_norm_cpu(x, delta, weight, eps):
    if not (_norm_takes(x, weight) and _norm_takes(delta, weight) and x.shape == delta.shape):
        _refuse("add_rms_norm", "x and delta must be [rows, n] alike with unit stride in n")
    if not kernel_can_take(x, delta, weight):
        _refuse("add_rms_norm", "float32 CPU tensors only")
    h = torch.empty(x.shape, dtype=torch.float32)
    out = torch.empty(x.shape, dtype=torch.float32)
    _norm(out, h, x, delta, weight, eps)
    return h, out


def _rope_fake(x, cos, sin):
    return None


def _rope_cpu(x, cos, sin):
    if not (_rope_takes(x, cos, sin) and kernel_can_take(x, cos, sin)):
        _refuse("rope_", "x must be float32 [T, H, D] (D even, unit stride) and cos/sin [T, D] alike")
    t, heads, d = x.shape
    c_call(
        _c().rope,
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


def _greedy_fake(approx, cx, absolute, norms, scratch):
    found = torch.library.get_ctx().new_dynamic_size()
    return cx.new_empty((found,), dtype=torch.int64), cx.new_empty((approx.shape[0], 1), dtype=torch.float32)


def _greedy_cpu(approx, cx, absolute, norms, scratch):
    if not (_greedy_takes(approx, cx, absolute, norms, scratch) and kernel_can_take(cx, absolute, norms)):
        _refuse("greedy_candidates", "see LayerOps.greedy_candidates for the tensors it takes")
    m, v = approx.shape
    lo = torch.empty((m, 1), dtype=torch.float32)
    ids = scratch[: 8 * v].view(torch.int64)
    k = c_call(
        _c().greedy,
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


def _rows(x: torch.Tensor, n: int) -> bool:
    """x is ``[rows, n]`` with unit stride along n (any row stride)."""
    return x.dim() == 2 and x.shape[1] == n and x.stride(1) == 1


_RMS_NORM = CpuOperator(
    "rms_norm", "(Tensor x, Tensor weight, float eps) -> Tensor", _rms_norm_cpu, _rms_norm_fake
)
_ADD_RMS_NORM = CpuOperator(
    "add_rms_norm",
    "(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)",
    _add_rms_norm_cpu,
    _add_rms_norm_fake,
)
_ROPE = CpuOperator("rope_", "(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", _rope_cpu, _rope_fake)
_GREEDY_CANDIDATES = CpuOperator(
    "greedy_candidates",
    "(Tensor approx, Tensor cx, Tensor absolute, Tensor norms, Tensor(a!) scratch) -> (Tensor, Tensor)",
    _greedy_cpu,
    _greedy_fake,
)


@dataclass(frozen=True, slots=True)
class LayerOps:
    """The compiled layer ops, loaded (:func:`load_layer_ops`): each checks its tensors and runs
    its operator, or returns None (False for :meth:`rope_`) for torch's ops to run instead."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """``F.rms_norm(x, weight.shape, weight, eps)`` for x ``[rows, n]``; None when the kernel
        cannot take these tensors."""
        if not (_norm_takes(x, weight) and kernel_can_take(x, weight)):
            return None
        return _RMS_NORM(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(h, rms_norm(h))`` for ``h = x + delta``, both ``[rows, n]``, in one pass; None when
        the kernel cannot take these tensors. ``h`` is exactly ``x + delta``."""
        if not (
            _norm_takes(x, weight)
            and _norm_takes(delta, weight)
            and x.shape == delta.shape
            and kernel_can_take(x, delta, weight)
        ):
            return None
        return _ADD_RMS_NORM(x, delta, weight, eps)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Rotate x ``[T, H, D]`` in place by cos/sin ``[T, D]``, bit for bit as
        :func:`~warmcap.models.rope.apply_rope`; False (x untouched) when the kernel cannot take
        these tensors."""
        if not (_rope_takes(x, cos, sin) and kernel_can_take(x, cos, sin)):
            return False
        _ROPE(x, cos, sin)
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
        if not (_greedy_takes(approx, cx, absolute, norms, scratch) and kernel_can_take(cx, absolute, norms)):
            return None
        return _GREEDY_CANDIDATES(approx, cx, absolute, norms, scratch)


def load_layer_ops(mode: str | None = None) -> LayerOps | None:
    """The ops, or None for torch's (``torch`` mode, or ``auto`` and no working compiler: then one
    warning with the reason). ``kernel`` mode raises :class:`ConfigError` instead. ``mode``: the
    config's ``kernel.cpu_layer_ops`` (None: its default)."""
    lib = load_by_mode(
        "cpu_layer_ops", mode, SOURCE, what="the CPU layer ops", instead="torch's", log=log, bind=_bind
    )
    return None if lib is None else LayerOps()
