"""The compiled CPU paged-attention kernel (``paged_attention.c``): its operator and when it is used.

The kernel is the operator ``warmcap::paged_attention`` (``torch.ops.warmcap.paged_attention``): fake
tensors and torch.compile run its fake implementation, real CPU tensors its C code (called without
torch's dispatcher when nothing watches: :class:`~warmcap.kernels.cpu.policy.CpuOperator`), which takes one
struct of arguments (``paged_attention.h``, mirrored by :class:`Params` and checked at load).

``WARMCAP_CPU_ATTENTION`` picks the CPU attention path (:mod:`.policy`): ``auto`` (default) uses the
kernel when it builds and falls back to gather + SDPA with one warning when it does not; ``torch``
always uses gather + SDPA; ``kernel`` requires the kernel and fails start-up when it cannot be built.

NOTE: the library is built with ``-fopenmp`` and needs ``libgomp.so.1``. torch is imported before it
is loaded (this module imports torch), so the dynamic linker resolves that soname to the copy torch's
wheel already mapped: one OpenMP runtime, one thread pool. Two runtimes would each keep their own
spinning workers on the same cores.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import torch

from warmcap.kernels.cpu.build import KernelBuildError, load_library
from warmcap.kernels.cpu.policy import CpuOperator, c_call, load_by_mode

if TYPE_CHECKING:
    from warmcap.contracts.metadata import AttentionMetadata

log = logging.getLogger("warmcap.attention")

ENV = "WARMCAP_CPU_ATTENTION"
SOURCE = "paged_attention.c"

#: Longest query span per row the kernel serves (decode 1, spec-verify k + 1 up to k = 3). It computes
#: every query on its own, so its cost grows with the span, while SDPA's flash kernel amortises its
#: tiles over the queries: they measured even at 8 (BENCHMARKS.md, #15 "CPU paged attention").
MAX_QUERY_LEN = 4

_STATUS = {
    1: "a shape or sequence length past the block table",
    2: "a block id outside the cache",
    3: "no memory",
    4: "a KV write slot outside the cache",
}

_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


class Params(ctypes.Structure):
    """``struct warmcap_pa_params`` (``paged_attention.h``), mirrored once; :func:`_bind` checks
    this mirror against the library's own layout when it is loaded."""

    #: ``WARMCAP_PA_PARAMS_VERSION`` of the header this mirrors
    VERSION = 1

    _fields_ = [
        ("out", _ptr),
        ("q", _ptr),
        ("q_stride_t", _i64),
        ("q_stride_h", _i64),
        ("kv_cache", _ptr),
        ("block_table", _ptr),
        ("seq_lens", _ptr),
        ("qsl", _ptr),
        ("num_tokens", _i64),
        ("num_blocks", _i64),
        ("cols", _i32),
        ("num_reqs", _i32),
        ("hq", _i32),
        ("hkv", _i32),
        ("d", _i32),
        ("block_size", _i32),
        ("window", _i32),
        ("scale", ctypes.c_float),
        ("num_threads", _i32),
        ("reserved", _i32),
        ("k", _ptr),
        ("k_stride_t", _i64),
        ("k_stride_h", _i64),
        ("v", _ptr),
        ("v_stride_t", _i64),
        ("v_stride_h", _i64),
        ("slots", _ptr),
        ("num_writes", _i64),
    ]

    @classmethod
    def layout(cls) -> list[int]:
        """What ``warmcap_paged_attention_layout`` returns for a matching library: the version,
        the size, then every field's offset in order."""
        return [cls.VERSION, ctypes.sizeof(cls)] + [getattr(cls, name).offset for name, _ in cls._fields_]


@cache
def _bind(lib: ctypes.CDLL) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """The kernel's entry point in ``lib``, after checking that :class:`Params` matches the
    library's struct (a :class:`KernelBuildError` if not)."""
    want = Params.layout()
    layout_fn = lib.warmcap_paged_attention_layout
    layout_fn.argtypes, layout_fn.restype = [ctypes.POINTER(_i64), _i32], _i32
    buf = (_i64 * len(want))()
    count = layout_fn(buf, len(want))
    got = list(buf)[:count]
    if count != len(want) or got != want:
        raise KernelBuildError(
            f"paged_attention.h and its Python mirror (paged_attention.Params) disagree: the library's "
            f"layout is {got} (version, size, offsets), the mirror's {want}; update Params with the header"
        )
    fn = lib.warmcap_paged_attention
    fn.argtypes, fn.restype = [ctypes.POINTER(Params)], ctypes.c_int
    return fn


@cache
def _entry_point() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """The bound kernel (the library is loaded, and built first, when no caller has yet; once per
    process: the library's key reads and hashes the sources)."""
    return _bind(load_library(SOURCE))


# The kernel as an operator torch sees (``warmcap::paged_attention``): fake tensors (the graph-safety
# check) and torch.compile run its fake implementation, real CPU tensors the C kernel. It writes
# the cache when k, v and slots are given. Registered below, with its CPU implementation.
def _paged_attention_fake(q, kv_cache, block_table, seq_lens, query_start_loc, scale, window, k, v, slots):
    _check_shapes(q, kv_cache, block_table, seq_lens, query_start_loc, k, v, slots)
    return q.new_empty(q.shape, dtype=torch.float32)


def _paged_attention_cpu(q, kv_cache, block_table, seq_lens, query_start_loc, scale, window, k, v, slots):
    _check_shapes(q, kv_cache, block_table, seq_lens, query_start_loc, k, v, slots)
    t, hq, d = q.shape
    _, blocks, block_size, hkv, _ = kv_cache.shape
    out = torch.empty((t, hq, d), dtype=torch.float32)
    p = Params(
        out=out.data_ptr(),
        q=q.data_ptr(),
        q_stride_t=q.stride(0),
        q_stride_h=q.stride(1),
        kv_cache=kv_cache.data_ptr(),
        block_table=block_table.data_ptr(),
        seq_lens=seq_lens.data_ptr(),
        qsl=query_start_loc.data_ptr(),
        num_tokens=t,
        num_blocks=blocks,
        cols=block_table.shape[1],
        num_reqs=seq_lens.shape[0],
        hq=hq,
        hkv=hkv,
        d=d,
        block_size=block_size,
        window=window,
        scale=scale,
        num_threads=torch.get_num_threads(),
    )
    if k is not None:
        p.k, p.k_stride_t, p.k_stride_h = k.data_ptr(), k.stride(0), k.stride(1)
        p.v, p.v_stride_t, p.v_stride_h = v.data_ptr(), v.stride(0), v.stride(1)
        p.slots, p.num_writes = slots.data_ptr(), k.shape[0]
    status = c_call(_entry_point(), ctypes.byref(p))
    if status != 0:
        raise RuntimeError(f"CPU paged attention failed: {_STATUS.get(status, f'status {status}')}")
    return out


_PAGED_ATTENTION = CpuOperator(
    "paged_attention",
    "(Tensor q, Tensor(a!) kv_cache, Tensor block_table, Tensor seq_lens, Tensor query_start_loc, "
    "float scale, int window, Tensor? k, Tensor? v, Tensor? slots) -> Tensor",
    _paged_attention_cpu,
    _paged_attention_fake,
)


def _check_shapes(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    slots: torch.Tensor | None,
) -> None:
    """What the C kernel assumes of its tensors beyond what it checks itself (raises ValueError)."""
    if q.dim() != 3 or kv_cache.dim() != 5 or q.shape[2] != kv_cache.shape[4]:
        raise ValueError(
            f"q must be [T, Hq, D] and the cache [2, blocks, block_size, Hkv, D]; got "
            f"{tuple(q.shape)} and {tuple(kv_cache.shape)}"
        )
    if q.dtype != torch.float32 or kv_cache.dtype != torch.float32 or q.stride(2) != 1:
        raise ValueError(
            f"the kernel reads a float32 q with unit stride in D and a float32 cache; got "
            f"{q.dtype} (stride {q.stride()}), cache {kv_cache.dtype}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("the kernel reads a contiguous KV cache")
    for name, x in (
        ("block_table", block_table),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if x.dtype != torch.int32 or not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32 (KernelInputs.of); got {x.dtype}")
    if (
        block_table.dim() != 2
        or block_table.shape[0] != seq_lens.shape[0]
        or query_start_loc.shape[0] != seq_lens.shape[0] + 1
    ):
        raise ValueError(
            f"block_table [R, cols], seq_lens [R] and query_start_loc [R + 1] must agree; got "
            f"{tuple(block_table.shape)}, {tuple(seq_lens.shape)}, {tuple(query_start_loc.shape)}"
        )
    if k is None:
        return
    hkv, d = kv_cache.shape[3], kv_cache.shape[4]
    if v is None or slots is None:
        raise ValueError("the keys, values and slots to write come together")
    if not PagedAttentionKernel.can_write(k, v):
        raise ValueError(f"the kernel writes float32 K/V with unit stride in D; got {k.dtype}, {v.dtype}")
    if k.shape != v.shape or k.shape[0] != slots.shape[0] or tuple(k.shape[1:]) != (hkv, d):
        raise ValueError(
            f"K/V to write must be [T, {hkv}, {d}] alike with one slot per token; "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slots.shape)}"
        )
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"write slots must be contiguous int64; got {slots.dtype}")


@dataclass(frozen=True, slots=True)
class KernelInputs:
    """One step's metadata as the kernel reads it: contiguous int32, sliced to the step's rows."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor

    @classmethod
    def of(cls, meta: AttentionMetadata) -> KernelInputs:
        r = meta.num_reqs

        def i32(x: torch.Tensor) -> torch.Tensor:
            return x.to(torch.int32).contiguous()

        return cls(i32(meta.query_start_loc[: r + 1]), i32(meta.seq_lens[:r]), i32(meta.block_table[:r]))


@dataclass(frozen=True, slots=True)
class PagedAttentionKernel:
    """Decode / spec-verify attention over a float32 paged KV cache, read in place: the operator
    ``warmcap::paged_attention`` (``torch.ops.warmcap.paged_attention``) with its inputs prepared.
    Fake tensors get its fake implementation (shapes only)."""

    @staticmethod
    def can_write(k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the kernel can write these keys and values itself (float32, unit stride in D)."""
        return k.dtype == v.dtype == torch.float32 and k.stride(-1) == 1 and v.stride(-1) == 1

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        inputs: KernelInputs,
        *,
        scale: float,
        window: int | None,
        new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """[T, Hq, D] attention output for queries ``q`` [T, Hq, D]; padded tokens give zeros.

        ``kv_cache`` is ``[2, num_blocks + 1, block_size, Hkv, D]`` float32, contiguous, on CPU.
        ``new_kv`` = (k, v, slots): this step's keys and values ``[T, Hkv, D]`` (:meth:`can_write`),
        written at ``slots`` [T] (every one a slot of the cache) before any query reads the cache,
        in token order; None when they are written already.
        """
        if q.dtype != torch.float32:
            q = q.float()
        if q.stride(-1) != 1:
            q = q.contiguous()
        k = v = slots = None
        if new_kv is not None:
            k, v, slots = new_kv
            if slots.dtype != torch.int64 or not slots.is_contiguous():
                slots = slots.to(torch.int64).contiguous()
        return _PAGED_ATTENTION(
            q,
            kv_cache,
            inputs.block_table,
            inputs.seq_lens,
            inputs.query_start_loc,
            scale,
            window or 0,
            k,
            v,
            slots,
        )


def load_paged_attention(mode: str | None = None) -> PagedAttentionKernel | None:
    """The kernel, or None for gather + SDPA (``torch`` mode, or ``auto`` and no working compiler:
    then one warning with the reason). ``kernel`` mode raises :class:`ConfigError` instead.
    ``mode``: the config's ``kernel.cpu_attention`` (None: its default)."""
    lib = load_by_mode(
        "cpu_attention",
        mode,
        SOURCE,
        what="the CPU attention kernel",
        instead="gather + SDPA",
        log=log,
        bind=_bind,
    )
    return None if lib is None else PagedAttentionKernel()
