"""The compiled CPU paged-attention kernel (``paged_attention.c``): its binding and when it is used.

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
from typing import TYPE_CHECKING

import torch

from warmcap.cpu_kernels.policy import load_by_mode

if TYPE_CHECKING:
    from warmcap.contracts.metadata import AttentionMetadata

log = logging.getLogger("warmcap.attention")

ENV = "WARMCAP_CPU_ATTENTION"

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
_ARGTYPES = [
    _ptr,  # out
    _ptr,  # q
    _i64,  # q token stride
    _i64,  # q head stride
    _ptr,  # kv_cache
    _ptr,  # block_table
    _i32,  # block table columns
    _ptr,  # seq_lens
    _ptr,  # query_start_loc
    _i64,  # num_tokens
    _i32,  # num_reqs
    _i32,  # query heads
    _i32,  # kv heads
    _i32,  # head dim
    _i64,  # blocks in the cache, sink included
    _i32,  # block size
    _i32,  # window (0: none)
    ctypes.c_float,  # scale
    _i32,  # threads
    _ptr,  # k to write (NULL: written already)
    _i64,  # k token stride
    _i64,  # k head stride
    _ptr,  # v to write
    _i64,  # v token stride
    _i64,  # v head stride
    _ptr,  # write slots, int64
    _i64,  # tokens to write
]


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
    """Decode / spec-verify attention over a float32 paged KV cache, read in place."""

    fn: ctypes._CFuncPtr  # type: ignore[name-defined]

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
        t, hq, d = q.shape
        _, blocks, block_size, hkv, _ = kv_cache.shape
        out = torch.empty((t, hq, d), dtype=torch.float32)
        table = inputs.block_table
        if new_kv is None:
            write: tuple[int, ...] = (0, 0, 0, 0, 0, 0, 0, 0)
        else:
            k, v, slots = new_kv
            if not self.can_write(k, v):
                raise ValueError(
                    f"the kernel writes float32 K/V with unit stride in D; got {k.dtype}, {v.dtype}"
                )
            if k.shape != v.shape or k.shape[0] != slots.shape[0] or tuple(k.shape[1:]) != (hkv, d):
                raise ValueError(
                    f"K/V to write must be [T, {hkv}, {d}] alike with one slot per token; "
                    f"got k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slots.shape)}"
                )
            if slots.dtype != torch.int64 or not slots.is_contiguous():
                slots = slots.to(torch.int64).contiguous()
            write = (k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1))
            write += (slots.data_ptr(), k.shape[0])
        status = self.fn(
            out.data_ptr(),
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            kv_cache.data_ptr(),
            table.data_ptr(),
            table.shape[1],
            inputs.seq_lens.data_ptr(),
            inputs.query_start_loc.data_ptr(),
            t,
            inputs.seq_lens.shape[0],
            hq,
            hkv,
            d,
            blocks,
            block_size,
            window or 0,
            scale,
            torch.get_num_threads(),
            *write,
        )
        if status != 0:
            raise RuntimeError(f"CPU paged attention failed: {_STATUS.get(status, f'status {status}')}")
        return out


def load_paged_attention() -> PagedAttentionKernel | None:
    """The kernel, or None for gather + SDPA (``torch`` mode, or ``auto`` and no working compiler:
    then one warning with the reason). ``kernel`` mode raises :class:`ConfigError` instead."""
    lib = load_by_mode(
        ENV, "paged_attention.c", what="the CPU attention kernel", instead="gather + SDPA", log=log
    )
    if lib is None:
        return None
    fn = lib.warmcap_paged_attention
    fn.argtypes = _ARGTYPES
    fn.restype = ctypes.c_int
    return PagedAttentionKernel(fn)
