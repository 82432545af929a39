"""Triton kernels of the fused decoder-layer ops (CUDA; CPU tensors under ``TRITON_INTERPRET=1``).

Each kernel replaces a run of torch ops with one launch and keeps their numbers: the same
operations in the same dtype, rounded where torch rounds (products and sums of low-precision
activations are rounded to the activation dtype after each op, as torch's elementwise ops do).
Reductions (RMSNorm's sum of squares) add in another order than torch, so results may differ from
torch's in the last bit; ``tests/models/test_fused_ops.py`` bounds the difference.

Only :mod:`warmcap.models.fused_ops` imports this module (lazily, behind its capability check), and
it launches these kernels from ``torch.library`` custom ops. Launchers take 2-D row views whose
last dimension has unit stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    x_stride,
    delta_stride,
    out_stride,
    sum_stride,
    n,
    eps,
    HAS_DELTA: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * delta_stride + offs, mask=mask, other=0.0)
        # The residual sum in the activation dtype, as ``h + delta`` gives it.
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * sum_stride + offs, x, mask=mask)
    v = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ROUND:  # noqa: SIM108 - a constexpr branch, compiled away
        # weight * rms_norm(x.float()).to(dtype): the normed row is rounded before the scale.
        y = (v * rstd).to(x.dtype).to(tl.float32) * w
    else:
        y = v * rstd * w
    tl.store(out_ptr + row * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    delta: torch.Tensor | None,
    total: torch.Tensor | None,
) -> None:
    """``out`` = RMSNorm of the rows of ``x`` (+ ``delta``, the sum stored in ``total``)."""
    rows, n = x.shape
    if rows == 0:
        return
    has_delta = delta is not None and total is not None
    _rms_norm_kernel[(rows,)](
        x,
        delta if has_delta else x,
        weight,
        out,
        total if has_delta else out,
        x.stride(0),
        delta.stride(0) if has_delta else 0,
        out.stride(0),
        total.stride(0) if has_delta else 0,
        n,
        eps,
        HAS_DELTA=has_delta,
        ROUND=x.dtype != torch.float32,
        BLOCK=triton.next_power_of_2(n),
    )


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, gate_stride, up_stride, out_stride, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + row * gate_stride + offs, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * up_stride + offs, mask=mask, other=0.0)
    a = g.to(tl.float32)
    # silu(gate) in the activation dtype, then the product rounded again: torch's two ops.
    s = (a / (1.0 + tl.exp(-a))).to(g.dtype)
    y = s.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = ``silu(gate) * up`` over rows."""
    rows, n = gate.shape
    if rows == 0:
        return
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), n, BLOCK=block
    )


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    cache_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    cos_stride,
    sin_stride,
    cache_stride_kv,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    num_q_heads,
    block_size,
    sink_slot,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    c1 = tl.load(cos_ptr + t * cos_stride + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * cos_stride + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * sin_stride + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * sin_stride + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if head < num_q_heads:
        ptr = q_ptr + t * q_stride_t + head * q_stride_h
    else:
        ptr = k_ptr + t * k_stride_t + (head - num_q_heads) * k_stride_h
    x1 = tl.load(ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF + offs, mask=mask, other=0.0)
    dt = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # rotate_half(x) * sin + x * cos, each product and the sum rounded to the activation dtype as
    # models/rope.apply_rope's three ops round them.
    lo = ((-a2 * s1).to(dt).to(tl.float32) + (a1 * c1).to(dt).to(tl.float32)).to(dt)
    hi = ((a1 * s2).to(dt).to(tl.float32) + (a2 * c2).to(dt).to(tl.float32)).to(dt)
    tl.store(ptr + offs, lo, mask=mask)
    tl.store(ptr + HALF + offs, hi, mask=mask)
    if head >= num_q_heads:
        kv_head = head - num_q_heads
        slot = tl.load(slot_ptr + t).to(tl.int64)
        # PAD (-1) goes to the sink block, as runner_v2/attention/torch_paged.sink_slots sends it.
        slot = tl.where(slot >= 0, slot, sink_slot)
        dst = cache_ptr + (slot // block_size) * cache_stride_block + (slot % block_size) * cache_stride_slot
        dst += kv_head * cache_stride_head
        ty = cache_ptr.dtype.element_ty
        tl.store(dst + offs, lo.to(ty), mask=mask)
        tl.store(dst + HALF + offs, hi.to(ty), mask=mask)
        vp = v_ptr + t * v_stride_t + kv_head * v_stride_h
        v1 = tl.load(vp + offs, mask=mask, other=0.0)
        v2 = tl.load(vp + HALF + offs, mask=mask, other=0.0)
        tl.store(dst + cache_stride_kv + offs, v1.to(ty), mask=mask)
        tl.store(dst + cache_stride_kv + HALF + offs, v2.to(ty), mask=mask)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` in place and write k and v ``[T, Hkv, D]`` at
    ``slot_mapping[:T]`` of ``kv_cache`` ``[2, blocks, block_size, Hkv, D]`` (PAD to the sink, the
    first slot of the last block)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if t == 0:
        return
    _, blocks, block_size, _, _ = kv_cache.shape
    half = d // 2
    _rope_write_kv_kernel[(t, hq + hkv)](
        q,
        k,
        v,
        cos,
        sin,
        slot_mapping,
        kv_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        hq,
        block_size,
        (blocks - 1) * block_size,
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
    )


@triton.jit
def _greedy_argmax_kernel(x_ptr, out_ptr, x_stride, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_at = tl.full((BLOCK,), 2**31 - 1, tl.int32)
    bad = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, n, BLOCK):
        idx = start + offs
        mask = idx < n
        x = tl.load(x_ptr + row * x_stride + idx, mask=mask, other=float("-inf")).to(tl.float32)
        # NaN fails x == x, and +-inf fails the bound: such a row is flagged, never answered.
        finite = (x == x) & (tl.abs(x) < float("inf"))
        bad |= (mask & ~finite).to(tl.int32)
        # Strictly greater: each lane keeps its first maximum; lanes tie-break by lowest index below.
        take = x > best
        best_at = tl.where(take, idx, best_at)
        best = tl.where(take, x, best)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_at, 2**31 - 1), axis=0)
    flagged = tl.max(bad, axis=0)
    tl.store(out_ptr + row, tl.where(flagged > 0, -1, first).to(tl.int64))


def greedy_argmax(logits: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i]`` = the first maximum's column of row i of ``logits``, or -1 when the row holds a
    NaN or an infinity."""
    rows, n = logits.shape
    if rows == 0:
        return
    _greedy_argmax_kernel[(rows,)](
        logits, out, logits.stride(0), n, BLOCK=min(2048, triton.next_power_of_2(n))
    )
