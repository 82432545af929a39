"""Paged attention in Triton: reads each row's pages in place, below its length (CUDA; on CPU tensors
under ``TRITON_INTERPRET=1``, set before this module is imported).

One program serves one (row, tile of the row's queries, KV head, split of the keys): the queries of a
tile and the query heads sharing the KV head form the ``M`` side of the score tile, so decode (one
query), the ``1 + k`` verify query, draft passes and prefill chunks run the same kernel. Keys are
walked through the block table ``BLOCK_N`` positions at a time from the tile's window start to its
last query's position; with ``splits > 1`` (flash-decoding) each split walks its own slice of that
span and a second kernel merges the partial results by their log-sum-exp. Positions at or past a
row's ``seq_len``, before a query's window, or in another row's pages are never loaded (masked loads),
so a page's unread tail may hold NaN or anything else without changing a result.

Graph-safe: every length is read from the metadata tensors inside the kernel; the grid and the
constexprs come from host-static sizes only (rows, ``max_query_len``, the block table's width), so a
graph captured over a :class:`~warmcap.contracts.AttentionMetadata` with ``graph_bounds`` replays for
any batch its buffers hold.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from warmcap import env
from warmcap.contracts.backends import AttentionBackend
from warmcap.contracts.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
_INTERPRETED = env.read("TRITON_INTERPRET") == "1"
#: keys per program step (and the smallest tile ``tl.dot`` takes on each side)
BLOCK_N = 64
#: rows of the score tile: a tile's queries times the query heads of one KV head
_MAX_BLOCK_M = 64
#: most splits of one tile's keys, and the fewest keys worth a split of their own
MAX_SPLITS = 16
KEYS_PER_SPLIT = 256


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    k_cache_ptr,
    v_cache_ptr,
    cache_stride_slot,
    slot_ptr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Token ``program_id(0)``'s K/V into its slot; PAD (-1) writes nothing."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < HEAD_DIM) & (slot >= 0)
    k = tl.load(k_ptr + t * k_stride_t + offs_h[:, None] * k_stride_h + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + offs_h[:, None] * v_stride_h + offs_d[None, :], mask=mask)
    dst = slot * cache_stride_slot + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    q_stride_t,
    q_stride_h,
    k_cache_ptr,
    v_cache_ptr,
    cache_stride_block,
    cache_stride_slot,
    table_ptr,
    table_stride,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    num_reqs,
    num_tokens,
    scale_log2,
    window,
    NUM_HQ: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    r = tl.program_id(0)
    qt = tl.program_id(1)
    h = tl.program_id(2) // SPLITS
    s = tl.program_id(2) % SPLITS
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    g = offs_m % GROUP
    head = h * GROUP + g
    if r == num_reqs:
        # The extra row: zeros for the tokens past the last row's span (padding), once per KV head.
        if qt == 0 and s == 0:
            tail = tl.load(qsl_ptr + num_reqs)
            for t0 in range(tail, num_tokens, BLOCK_Q):
                tok = t0 + offs_m // GROUP
                mask = (offs_m < BLOCK_Q * GROUP) & (tok < num_tokens)
                ptrs = out_ptr + tok.to(tl.int64)[:, None] * (NUM_HQ * HEAD_DIM) + head[:, None] * HEAD_DIM
                zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty)
                tl.store(ptrs + offs_d[None, :], zeros, mask=mask[:, None] & d_mask[None, :])
    else:
        start_q = tl.load(qsl_ptr + r)
        qlen = tl.load(qsl_ptr + r + 1) - start_q
        seq = tl.load(seq_lens_ptr + r)
        qi = qt * BLOCK_Q + offs_m // GROUP
        m_valid = (offs_m < BLOCK_Q * GROUP) & (qi < qlen)
        pos = seq - qlen + qi
        sees = m_valid & (pos >= 0)
        tok = (start_q + qi).to(tl.int64)
        q = tl.load(
            q_ptr + tok[:, None] * q_stride_t + head[:, None] * q_stride_h + offs_d[None, :],
            mask=m_valid[:, None] & d_mask[None, :],
            other=0.0,
        )
        # The tile's keys: from its first query's window start to its last query's position.
        first = seq - qlen + qt * BLOCK_Q
        hi = seq - qlen + tl.minimum(qt * BLOCK_Q + BLOCK_Q, qlen)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(first - window + 1, 0)
        span = tl.maximum(hi - lo, 0)
        chunk = tl.cdiv(tl.cdiv(span, SPLITS), BLOCK_N) * BLOCK_N
        k_start = lo + s * chunk
        k_end = tl.minimum(k_start + chunk, hi)
        offs_n = tl.arange(0, BLOCK_N)
        row_table = table_ptr + r.to(tl.int64) * table_stride
        head_off = h * HEAD_DIM
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(k_start, k_end, BLOCK_N):
            p = n0 + offs_n
            p_valid = p < k_end
            block = tl.load(row_table + p // PAGE, mask=p_valid, other=0).to(tl.int64)
            slot = block * cache_stride_block + (p % PAGE) * cache_stride_slot + head_off
            kv_mask = p_valid[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if DOT_F32:
                scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
            else:
                scores = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION)
            scores = scores * scale_log2
            visible = sees[:, None] & p_valid[None, :] & (p[None, :] <= pos[:, None])
            if HAS_WINDOW:
                visible = visible & (p[None, :] > pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            weights = tl.exp2(scores - m_use[:, None])
            l_i = l_i * alpha + tl.sum(weights, 1)
            v = tl.load(v_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if DOT_F32:
                pv = tl.dot(weights, v.to(tl.float32), input_precision=PRECISION)
            else:
                pv = tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        store_mask = m_valid[:, None] & d_mask[None, :]
        if SPLITS == 1:
            out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
            ptrs = out_ptr + tok[:, None] * (NUM_HQ * HEAD_DIM) + head[:, None] * HEAD_DIM + offs_d[None, :]
            tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)
        else:
            part = (tok * NUM_HQ + head) * SPLITS + s
            tl.store(part_o_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=store_mask)
            tl.store(part_ml_ptr + part * 2, m_i, mask=m_valid)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=m_valid)


@triton.jit
def _merge_splits_kernel(
    qsl_ptr,
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    NUM_HQ: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """The splits of one (row, query tile, KV head), weighted by their maxima and sums."""
    r = tl.program_id(0)
    qt = tl.program_id(1)
    h = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    start_q = tl.load(qsl_ptr + r)
    qlen = tl.load(qsl_ptr + r + 1) - start_q
    qi = qt * BLOCK_Q + offs_m // GROUP
    m_valid = (offs_m < BLOCK_Q * GROUP) & (qi < qlen)
    tok = (start_q + qi).to(tl.int64)
    head = h * GROUP + offs_m % GROUP
    base = (tok * NUM_HQ + head) * SPLITS
    m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        m_all = tl.maximum(m_all, tl.load(part_ml_ptr + (base + s) * 2, mask=m_valid, other=float("-inf")))
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    mask = m_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    for s in tl.static_range(SPLITS):
        m_s = tl.load(part_ml_ptr + (base + s) * 2, mask=m_valid, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=m_valid, other=0.0)
        w = tl.exp2(m_s - m_use)
        total += l_s * w
        o_s = tl.load(part_o_ptr + (base + s)[:, None] * BLOCK_D + offs_d[None, :], mask=mask, other=0.0)
        acc += o_s * w[:, None]
    out = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    ptrs = out_ptr + tok[:, None] * (NUM_HQ * HEAD_DIM) + head[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _check_cache(kv_cache: torch.Tensor) -> None:
    """The kernels address a token's heads as ``slot * stride + head * D + x``."""
    d = kv_cache.shape[4]
    if kv_cache.stride(4) != 1 or kv_cache.stride(3) != d:
        raise ValueError(
            f"the KV cache must be contiguous in its heads and head dim; strides {kv_cache.stride()}"
        )


def write_kv_triton(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k/v ``[T, Hkv, D]`` at ``slot_mapping[:T]`` in one kernel; PAD (-1) slots are skipped
    (the torch path sends them to the sink block, which nothing reads)."""
    t = k.shape[0]
    if t == 0:
        return
    _check_cache(kv_cache)
    _, _, _, hkv, d = kv_cache.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _write_kv_kernel[(t,)](
        k,
        v,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache[0],
        kv_cache[1],
        kv_cache.stride(2),
        slot_mapping,
        HKV=hkv,
        HEAD_DIM=d,
        BLOCK_H=_pow2_at_least(hkv),
        BLOCK_D=max(16, _pow2_at_least(d)),
    )


def launch_shape(
    *, rows: int, max_query_len: int, group: int, kv_heads: int, width: int, programs: int
) -> tuple[int, int, int, int]:
    """(BLOCK_Q, BLOCK_M, query tiles, splits) from host-static sizes only: ``width`` is the key span
    the block table can hold, ``programs`` how many programs fill the device (0: no split unless the
    width needs it for memory reasons - never, so 1)."""
    block_q = max(1, min(_pow2_at_least(max_query_len), 2 ** int(math.log2(max(1, _MAX_BLOCK_M // group)))))
    block_m = max(16, _pow2_at_least(block_q * group))
    tiles = max(1, triton.cdiv(max(max_query_len, 1), block_q))
    base = max(1, rows * tiles * kv_heads)
    splits = max(1, min(MAX_SPLITS, triton.cdiv(width, KEYS_PER_SPLIT), triton.cdiv(programs, base)))
    return block_q, block_m, tiles, splits


def paged_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    splits: int | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """[T, Hq, D] attention of ``q`` over ``kv_cache`` ``[2, blocks + 1, block_size, Hkv, D]`` (this
    step's K/V already written), with zeros for padded tokens. ``splits`` forces the number of key
    splits; else it comes from ``programs`` (default: twice the device's multiprocessors)."""
    t, hq, d = q.shape
    _, _, block_size, hkv, _ = kv_cache.shape
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    group = hq // hkv
    _check_cache(kv_cache)
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    r = meta.num_reqs
    if t == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if programs is None:
        programs = 2 * torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
    width = meta.block_table.shape[1] * block_size
    block_q, block_m, tiles, auto_splits = launch_shape(
        rows=r, max_query_len=meta.max_query_len, group=group, kv_heads=hkv, width=width, programs=programs
    )
    n_splits = auto_splits if splits is None else splits
    block_d = max(16, _pow2_at_least(d))
    if n_splits > 1:
        part_o = torch.empty((t, hq, n_splits, block_d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((t, hq, n_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # unused
    table = meta.block_table
    if table.stride(1) != 1:
        table = table.contiguous()
    precision = "ieee" if kv_cache.dtype == torch.float32 else "tf32"
    # NOTE: Triton's interpreter multiplies 16-bit floats in tl.dot as raw integers (numpy has no
    # bfloat16), so interpreted runs widen both operands to float32 first; compiled ones do not.
    dot_f32 = kv_cache.dtype == torch.float32 or _INTERPRETED
    constexprs = dict(NUM_HQ=hq, GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_Q=block_q, BLOCK_M=block_m)
    _paged_attention_kernel[(r + 1, tiles, hkv * n_splits)](
        q,
        q.stride(0),
        q.stride(1),
        kv_cache[0],
        kv_cache[1],
        kv_cache.stride(1),
        kv_cache.stride(2),
        table,
        table.stride(0),
        meta.seq_lens,
        meta.query_start_loc,
        out,
        part_o,
        part_ml,
        r,
        t,
        scale * _LOG2E,
        sliding_window or 0,
        BLOCK_N=BLOCK_N,
        PAGE=block_size,
        SPLITS=n_splits,
        HAS_WINDOW=sliding_window is not None,
        PRECISION=precision,
        DOT_F32=dot_f32,
        **constexprs,
    )
    if n_splits > 1 and r > 0:
        _merge_splits_kernel[(r, tiles, hkv)](
            meta.query_start_loc, out, part_o, part_ml, SPLITS=n_splits, **constexprs
        )
    return out


class TritonPagedAttention(AttentionBackend):
    """Paged attention through the Triton kernels above: one kernel writes the step's K/V, one (two
    with key splits) reads the pages in place. Stateless per step, so graphs need no hooks."""

    name = "triton"
    supports_full_graph = True
    accepts_written_kv = True

    def __init__(self, *, splits: int | None = None) -> None:
        """``splits``: force the number of key splits (tests); default from the device's size."""
        self._splits = splits

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        kv_written: bool = False,
    ) -> torch.Tensor:
        if not kv_written:
            write_kv_triton(kv_cache, k, v, meta.slot_mapping)
        return paged_attention_triton(
            q, kv_cache, meta, scale=scale, sliding_window=sliding_window, splits=self._splits
        )
