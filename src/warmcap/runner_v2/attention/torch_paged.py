"""Pure-torch paged attention: the reference backend on CPU and the fallback on GPU.

One step's metadata is turned once into a :class:`StepPlan` (gather indices, query padding, masks);
every layer of that step reuses it. Plans are cached by metadata object and re-derived when any of
its tensors was replaced or written in place (tensor identity + version counter), so the runner need
not call anything per step; it may call :meth:`TorchPagedAttention.plan` to build plans up front.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from warmcap.contracts.backends import AttentionBackend
from warmcap.contracts.metadata import AttentionMetadata
from warmcap.kernels.cpu.paged_attention import (
    MAX_QUERY_LEN,
    KernelInputs,
    PagedAttentionKernel,
    load_paged_attention,
)
from warmcap.kernels.cpu.policy import kernel_can_take

_MAX_CACHED_PLANS = 8

#: tokens per fixed-shape tile of the batch-invariant path (fewer for models with many heads)
INVARIANT_TOKEN_TILE = 16
#: keys per fixed-shape chunk of the batch-invariant path, at absolute positions ``c * 64 ..``
INVARIANT_KEY_TILE = 64


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] through ``slot_mapping`` [T]; PAD (-1) goes to the sink block.

    NOTE: ``kv_cache`` is ``[2, num_blocks + 1, block_size, Hkv, D]``; the last block is the sink.
    """
    write_kv_slots(kv_cache, k, v, sink_slots(slot_mapping[: k.shape[0]], kv_cache))


def sink_slots(slot_mapping: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """``slot_mapping`` with PAD (-1) redirected to the first slot of ``kv_cache``'s sink block.

    ``torch.where`` instead of boolean indexing keeps the write static-shape (graph-safe).
    """
    _, blocks, block_size, _, _ = kv_cache.shape
    sink = (blocks - 1) * block_size
    return torch.where(slot_mapping >= 0, slot_mapping, torch.full_like(slot_mapping, sink))


def write_kv_slots(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] at ``slots`` [T], which :func:`sink_slots` made non-negative."""
    heads, dim = kv_cache.shape[3], kv_cache.shape[4]
    kv_cache[0].view(-1, heads, dim).index_copy_(0, slots, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, heads, dim).index_copy_(0, slots, v.to(kv_cache.dtype))


def token_rows(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: (row, index within the row's query span, valid).

    A token is valid when it belongs to a row and its position ``seq_len - query_len + index`` is
    not negative; padded tokens (rows with ``seq_len`` 0) are not.
    """
    r = meta.num_reqs
    qsl = meta.query_start_loc[: r + 1].long()
    seq = meta.seq_lens[:r].long()
    t = torch.arange(num_tokens, device=qsl.device)
    row = torch.searchsorted(qsl[1:], t, right=True).clamp(max=max(r - 1, 0))
    index = t - qsl[row]
    qlen = qsl[1:] - qsl[:-1]
    position = seq[row] - qlen[row] + index
    valid = (position >= 0) & (t < qsl[r])
    return row, index, valid


def _kernel_can_read(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The compiled CPU kernel may run on these tensors: a contiguous float32 CPU cache, a CPU query
    and no gradient to record (:func:`~warmcap.kernels.cpu.policy.kernel_can_take`; fake tensors run
    the kernel operator's fake implementation)."""
    grad = q.requires_grad and torch.is_grad_enabled()
    return q.device.type == "cpu" and not grad and kv_cache.is_contiguous() and kernel_can_take(kv_cache)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass(slots=True)
class MetaStamp:
    """Recognises metadata that is unchanged since a plan was derived from it.

    Same tensor objects and scalars, and not written since: by version counter when the tensors track
    one; inference-mode tensors do not, so their contents are compared instead (a host sync on GPU,
    which is why a graph capture trusts the plans it derived itself).
    """

    scalars: tuple[int, ...]
    ids: tuple[int, ...]
    versions: tuple[int, ...] | None
    contents: tuple[torch.Tensor, ...] | None

    @staticmethod
    def _parts(meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        return (meta.query_start_loc, meta.seq_lens, meta.block_table, meta.slot_mapping)

    @staticmethod
    def _scalars(meta: AttentionMetadata) -> tuple[int, ...]:
        return (
            meta.num_tokens,
            meta.num_reqs,
            meta.max_query_len,
            meta.max_seq_len,
            meta.block_size,
            meta.graph_bounds,
        )

    @classmethod
    def of(cls, meta: AttentionMetadata) -> MetaStamp:
        parts = cls._parts(meta)
        ids = tuple(id(x) for x in parts)
        if any(x.is_inference() for x in parts):
            return cls(cls._scalars(meta), ids, None, tuple(x.clone() for x in parts))
        return cls(cls._scalars(meta), ids, tuple(x._version for x in parts), None)

    def matches(self, meta: AttentionMetadata) -> bool:
        # NOTE: called by every layer of a step, so the common case (same tensors, unwritten)
        # returns after the cheapest checks. Same ids mean the same live tensors (``meta`` holds
        # them), so whether they track versions is as when the stamp was taken.
        parts = self._parts(meta)
        if tuple(id(x) for x in parts) != self.ids or self._scalars(meta) != self.scalars:
            return False
        if self.versions is not None and tuple(x._version for x in parts) == self.versions:
            return True
        if _capturing():
            return True
        if self.contents is None:
            return False
        return all(torch.equal(a, b) for a, b in zip(self.contents, parts, strict=True))


@dataclass(slots=True)
class GatherPlan:
    """What the gather + SDPA and batch-invariant paths derive from a step's metadata (the compiled
    kernel reads the metadata itself and needs none of it): built on first use, once per step."""

    #: [R * Q] token feeding each padded query slot (clamped; invalid slots masked out)
    query_index: torch.Tensor
    #: [T] padded query slot of each token
    out_index: torch.Tensor
    #: [T, 1, 1] the token's output is padding (zeroed)
    token_invalid: torch.Tensor
    #: [R, Q, 1] position of each padded query slot, -1 for slots past the row's query length
    query_pos: torch.Tensor
    key_pos: torch.Tensor
    #: [R, 1, 1] each row's sequence length and its first query's position
    seq_len: torch.Tensor
    first_query_pos: torch.Tensor
    #: [T] each token's row, index in the row's query span and whether it is real (from
    #: :func:`token_rows`, kept for the batch-invariant path)
    token_row: torch.Tensor
    token_index: torch.Tensor
    token_valid: torch.Tensor


@dataclass(slots=True)
class StepPlan:
    """Metadata-derived tensors shared by every layer of one step (one KV group), each derived on
    first use: a decode step on the compiled kernel derives only the kernel's inputs and the write
    slots."""

    meta: AttentionMetadata
    stamp: MetaStamp
    max_query_len: int
    num_tokens: int
    masks: dict[tuple[int | None, int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    slots: dict[int | None, torch.Tensor] = field(default_factory=dict)
    #: the step's slot mapping with PAD sent to the sink, by the sink's first slot
    sinked: dict[int, torch.Tensor] = field(default_factory=dict)
    kernel: KernelInputs | None = None
    _gather: GatherPlan | None = None
    _split: RowSplit | None = None
    _split_derived: bool = False

    @property
    def gather(self) -> GatherPlan:
        """The gather paths' tensors (:class:`GatherPlan`), derived once per step."""
        if self._gather is None:
            self._gather = _gather_plan(self.meta, self.num_tokens, self.max_query_len)
        return self._gather

    def row_split(self) -> RowSplit | None:
        """The step's leading rows of short query spans apart from the rest (:func:`split_rows`),
        derived once per step."""
        if not self._split_derived:
            self._split = split_rows(self.meta, self.num_tokens)
            self._split_derived = True
        return self._split

    def kernel_inputs(self) -> KernelInputs:
        """The metadata as the CPU kernel reads it, converted once per step."""
        if self.kernel is None:
            self.kernel = KernelInputs.of(self.meta)
        return self.kernel

    def write_slots(self, kv_cache: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[T] where the step's tokens are written in ``kv_cache`` (:func:`sink_slots`), derived
        once per step instead of once per layer (every layer of a group has the same sink)."""
        _, blocks, block_size, _, _ = kv_cache.shape
        cached = self.sinked.get(blocks * block_size)
        if cached is None:
            cached = self.sinked[blocks * block_size] = sink_slots(
                self.meta.slot_mapping[:num_tokens], kv_cache
            )
        return cached

    def key_slots(self, window: int | None) -> torch.Tensor:
        """[R * K] the cache slot each row's key position ``0 .. K - 1`` is gathered from.

        NOTE: a position no query of the row sees (past its length, or before every query's
        window) reads the row's last token instead, which this step has written: the mask gives it
        weight 0, and ``0 * finite`` is 0, whereas the page itself may hold anything there (NaN from
        ``serve/poison.py``, a released window column's null block), and ``0 * NaN`` is NaN. Gathering
        a finite slot costs nothing over gathering the page; zeroing the gathered keys would cost a
        pass over them.
        """
        cached = self.slots.get(window)
        if cached is not None:
            return cached
        bs = self.meta.block_size
        g = self.gather
        key_pos = g.key_pos.view(1, -1)
        unread = key_pos >= g.seq_len.view(-1, 1)
        if window is not None:
            unread |= key_pos <= g.first_query_pos.view(-1, 1) - window
        last = (g.seq_len.view(-1, 1) - 1).clamp(min=0)
        pos = torch.where(unread, last, key_pos)
        table = self.meta.block_table[: g.seq_len.shape[0]].long()
        slots = table.gather(1, pos // bs) * bs + pos % bs
        cached = self.slots[window] = slots.reshape(-1)
        return cached

    def mask(self, window: int | None, group: int, dtype: torch.dtype) -> torch.Tensor:
        """[R, 1, G*Q, K] additive mask (0 or -inf): causal, inside the window, at least one 0 per row.

        Additive rather than bool: SDPA would otherwise convert a bool mask in every layer.
        """
        cached = self.masks.get((window, group, dtype))
        if cached is not None:
            return cached
        g = self.gather
        allowed = g.key_pos <= g.query_pos
        if window is not None:
            allowed = allowed & (g.key_pos > g.query_pos - window)
        # NOTE: a query with no visible key (padding) would give NaN from softmax; let it see key 0
        # instead and drop its output later (padded slots are never scattered, padded tokens zeroed).
        empty = ~allowed.any(dim=-1, keepdim=True)
        allowed = allowed | (empty & (g.key_pos == 0))
        r, q, k = allowed.shape
        allowed = allowed[:, None].expand(r, group, q, k).reshape(r, 1, group * q, k)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask.masked_fill_(~allowed, float("-inf"))
        self.masks[(window, group, dtype)] = mask
        return mask


@dataclass(frozen=True, slots=True)
class RowSplit:
    """A mixed step cut in two at a row: ``short`` (rows ``0 .. n - 1``, tokens ``0 .. tokens - 1``)
    has query spans of at most ``MAX_QUERY_LEN``, ``rest`` the rows and tokens after."""

    tokens: int
    short: AttentionMetadata
    rest: AttentionMetadata


def split_rows(meta: AttentionMetadata, num_tokens: int) -> RowSplit | None:
    """Where a step mixing short rows (decodes, spec verifies) with long ones (prefill chunks) is cut,
    or None when it does not mix them, its first row is long, its host copies are missing, or it
    runs under a graph's static bounds.

    Why: the gather + SDPA path pads every row to the step's longest query span, so in a step of 16
    decodes and 16 prompt chunks of 128 each decode row became 128 query rows of padding: SDPA's work
    and the gathers doubled (0.49 s of attention in a 2048-token step instead of 0.22 s, SmolLM2 on
    2 cores). The scheduler puts running requests first, so decodes lead and one cut at the first
    long row takes them out; a short row after a long one stays in the rest (padded, as before).
    Host copies only: no device sync.
    """
    qsl = meta.query_start_loc_cpu
    if meta.graph_bounds or qsl is None or meta.max_query_len <= MAX_QUERY_LEN:
        return None
    r = meta.num_reqs
    qlen = qsl[1 : r + 1] - qsl[:r]
    long_rows = (qlen > MAX_QUERY_LEN).nonzero()
    if long_rows.numel() == 0 or int(long_rows[0]) == 0:
        return None
    n = int(long_rows[0])
    tokens = int(qsl[n])
    seq_cpu = meta.seq_lens_cpu
    short = replace(
        meta,
        num_tokens=tokens,
        num_reqs=n,
        query_start_loc=meta.query_start_loc[: n + 1],
        seq_lens=meta.seq_lens[:n],
        block_table=meta.block_table[:n],
        slot_mapping=meta.slot_mapping[:tokens],
        max_query_len=int(qlen[:n].max()),
        max_seq_len=meta.max_seq_len if seq_cpu is None else max(int(seq_cpu[:n].max()), 1),
        query_start_loc_cpu=qsl[: n + 1],
        seq_lens_cpu=None if seq_cpu is None else seq_cpu[:n],
    )
    rest = replace(
        meta,
        num_tokens=num_tokens - tokens,
        num_reqs=r - n,
        query_start_loc=meta.query_start_loc[n : r + 1] - tokens,
        seq_lens=meta.seq_lens[n:r],
        block_table=meta.block_table[n:r],
        slot_mapping=meta.slot_mapping[tokens:num_tokens],
        query_start_loc_cpu=qsl[n : r + 1] - tokens,
        seq_lens_cpu=None if seq_cpu is None else seq_cpu[n:r],
    )
    return RowSplit(tokens, short, rest)


def build_plan(meta: AttentionMetadata, num_tokens: int) -> StepPlan:
    """A step's plan: its metadata stamped; what the paths derive from it comes on first use."""
    return StepPlan(
        meta=meta, stamp=MetaStamp.of(meta), max_query_len=max(meta.max_query_len, 1), num_tokens=num_tokens
    )


def _gather_plan(meta: AttentionMetadata, num_tokens: int, q: int) -> GatherPlan:
    """Derive the step's gather indices and positions from ``meta`` with tensor ops only."""
    r, bs = meta.num_reqs, meta.block_size
    # Columns up to the one holding the last position any row can have (position -> column).
    cols = min(meta.block_table.shape[1], (max(meta.max_seq_len, 1) - 1) // bs + 1)
    device = meta.block_table.device
    qsl = meta.query_start_loc[: r + 1].long()
    seq = meta.seq_lens[:r].long()
    qlen = qsl[1:] - qsl[:-1]
    i = torch.arange(q, device=device)
    in_span = i[None, :] < qlen[:, None]
    query_pos = torch.where(in_span, seq[:, None] - qlen[:, None] + i[None, :], -1)
    query_index = (qsl[:-1, None] + i[None, :]).clamp(max=max(num_tokens - 1, 0)).reshape(-1)
    row, index, valid = token_rows(meta, num_tokens)
    out_index = (row * q + index.clamp(min=0, max=q - 1)).reshape(-1)
    return GatherPlan(
        query_index=query_index,
        out_index=out_index,
        token_invalid=~valid[:, None, None],
        query_pos=query_pos[:, :, None],
        key_pos=torch.arange(cols * bs, device=device)[None, None, :],
        seq_len=seq[:, None, None],
        first_query_pos=(seq - qlen)[:, None, None],
        token_row=row,
        token_index=index,
        token_valid=valid,
    )


def invariant_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, plan: StepPlan, *, scale: float, window: int | None
) -> torch.Tensor:
    """Attention whose result for a token depends only on that token's query, position and keys,
    never on the batch around it (``--batch-invariant``).

    Gather + SDPA is not that: SDPA's CPU kernel multiplies a row's whole query span in one GEMM, and
    a BLAS GEMM's rounding follows its shapes (measured on an AMD EPYC with MKL: one decode query and
    the same query as the last of a three-token prefill differ by 1e-7 in layer 0, 5e-5 after
    SmolLM2's 30 layers; a batched matmul's rounding even follows an item's index in the batch).
    So no BLAS call here: dot products are exact elementwise products summed by torch's reductions,
    whose order for one output depends only on the reduced length, and every tensor has one shape per
    model: tokens go in tiles (each token its own query over its own gathered keys), keys in chunks
    of :data:`INVARIANT_KEY_TILE` at absolute positions, merged by an online softmax in position
    order. A chunk a token cannot see leaves its state bit for bit as it was (``exp(-inf) = 0``,
    ``alpha = 1``), so how many chunks the batch's longest row needs does not matter; the value
    rows carry a trailing 1, so one reduction gives the weighted values and the softmax sum. A tile
    holds at most 32768 scores (torch's grain): ``exp`` then runs on one thread over whole vectors,
    never its scalar tail, whose rounding differs.
    """
    t, hq, d = q.shape
    meta = plan.meta
    hkv, bs = kv_cache.shape[3], meta.block_size
    group = hq // hkv
    chunk = INVARIANT_KEY_TILE
    tile = max(1, min(INVARIANT_TOKEN_TILE, 32768 // (hq * chunk)))
    padded = t + (-t) % tile
    queries = q.new_zeros(padded, hkv, group, d, dtype=kv_cache.dtype)
    queries[:t] = q.view(t, hkv, group, d)
    g = plan.gather
    pos = g.token_row.new_full((padded,), -1)
    first = g.first_query_pos.view(-1)
    pos[:t] = torch.where(g.token_valid, first[g.token_row] + g.token_index, -1)
    rows = g.token_row.new_zeros(padded)
    rows[:t] = g.token_row
    table = meta.block_table.long()
    keys_all, values_all = kv_cache[0].view(-1, hkv, d), kv_cache[1].view(-1, hkv, d)
    offsets = torch.arange(chunk, device=q.device)
    out = torch.empty(padded, hkv, group, d, dtype=kv_cache.dtype, device=q.device)
    for start in range(0, padded, tile):
        qt, pt, rt = queries[start : start + tile], pos[start : start + tile], rows[start : start + tile]
        m = qt.new_full((tile, hkv, group, 1), float("-inf"))
        acc = qt.new_zeros(tile, hkv, group, d + 1)
        for first in range(0, max(meta.max_seq_len, 1), chunk):
            kpos = first + offsets
            visible = kpos[None, :] <= pt[:, None]
            if window is not None:
                visible &= kpos[None, :] > pt[:, None] - window
            # An unseen position reads the token's own slot (written this step, so finite).
            gpos = torch.where(visible, kpos[None, :], pt.clamp(min=0)[:, None])
            cols = (gpos // bs).clamp(max=table.shape[1] - 1)
            slots = (table[rt[:, None], cols] * bs + gpos % bs).reshape(-1)
            k = keys_all.index_select(0, slots).view(tile, chunk, hkv, d).transpose(1, 2)
            v = values_all.index_select(0, slots).view(tile, chunk, hkv, d).transpose(1, 2)
            v = torch.cat((v, v.new_ones(tile, hkv, chunk, 1)), dim=-1)
            s = (qt[:, :, :, None, :] * k[:, :, None]).sum(dim=-1) * scale
            s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            weights = torch.exp(s - base)
            acc = acc * torch.exp(m - base) + (weights[..., None] * v[:, :, None]).sum(dim=-2)
            m = m_new
        total = acc[..., d:]
        out[start : start + tile] = torch.where(total > 0, acc[..., :d] / total.clamp(min=1e-30), 0.0)
    return out[:t].reshape(t, hq, d)


class TorchPagedAttention(AttentionBackend):
    """Paged attention vectorised over requests: gather each row's pages, one masked SDPA call.

    Handles mixed prefill / decode / spec-verify rows, GQA and sliding windows. Padded rows
    (``seq_len`` 0) give zeros and never influence real rows. On a CPU float32 cache, steps of at
    most ``MAX_QUERY_LEN`` queries per row go to the compiled kernel of
    :mod:`warmcap.kernels.cpu.paged_attention` instead, which reads the pages
    in place (same results; the config's ``kernel.cpu_attention`` chooses). So do graph steps
    (``meta.graph_bounds``) at any query span: their ``max_seq_len`` is ``max_model_len``, and the
    gather would read and score every column up to it, where the kernel reads each row's own
    ``seq_len`` from the static buffers (verify queries of ``1 + k``, draft passes, mixed prefill).
    """

    name = "torch"
    supports_full_graph = True
    accepts_written_kv = True

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        batch_invariant: bool = False,
        cpu_attention: str | None = None,
    ) -> None:
        """``device``: a CPU device builds the kernel now (engine start-up) rather than on the
        first CPU step. ``batch_invariant``: never use the kernel (which path a step takes depends
        on its longest query span, so a row's numbers would depend on the batch around it), nor SDPA
        (whose GEMMs round by the query count): :func:`invariant_attention` on every step
        (``models/batch_invariant.py``). ``cpu_attention``: the config's ``kernel.cpu_attention``
        (None: its default)."""
        self._plans: OrderedDict[int, StepPlan] = OrderedDict()
        self._cpu_attention = cpu_attention
        self._kernel: PagedAttentionKernel | None = None
        self._kernel_loaded = batch_invariant
        self._batch_invariant = batch_invariant
        if device is not None and torch.device(device).type == "cpu":
            self._cpu_kernel()

    def _cpu_kernel(self) -> PagedAttentionKernel | None:
        if not self._kernel_loaded:
            self._kernel = load_paged_attention(self._cpu_attention)
            self._kernel_loaded = True
        return self._kernel

    def plan(self, metas: dict[str, AttentionMetadata]) -> None:
        """Optionally derive every group's plan up front (forward does it lazily otherwise)."""
        for meta in metas.values():
            self._plan_for(meta, meta.num_tokens)

    def prepare_for_capture(self, metas: dict[str, AttentionMetadata]) -> None:
        # Plans must be derived inside the recorded region so replays recompute them from the
        # refilled static buffers.
        self._plans.clear()

    def prepare_for_replay(self, metas: dict[str, AttentionMetadata]) -> None:
        self._plans.clear()

    def _plan_for(self, meta: AttentionMetadata, num_tokens: int) -> StepPlan:
        plan = self._plans.get(id(meta))
        if plan is not None and plan.meta is meta and plan.stamp.matches(meta):
            return plan
        plan = build_plan(meta, num_tokens)
        self._plans[id(meta)] = plan
        self._plans.move_to_end(id(meta))
        while len(self._plans) > _MAX_CACHED_PLANS:
            self._plans.popitem(last=False)
        return plan

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
        t, hq, d = q.shape
        if t == 0 or meta.num_reqs == 0:
            if not kv_written:
                write_kv(kv_cache, k, v, meta.slot_mapping)
            return torch.zeros_like(q)
        plan = self._plan_for(meta, t)
        # Already written by the layer (``kv_written``): no sink slots to derive.
        slots = None if kv_written else plan.write_slots(kv_cache, t)
        r, qmax = meta.num_reqs, plan.max_query_len
        if (qmax <= MAX_QUERY_LEN or meta.graph_bounds) and _kernel_can_read(q, kv_cache):
            kernel = self._cpu_kernel()
            if kernel is not None:
                # The kernel writes this step's K/V itself when it can (one call instead of three).
                new_kv = (k, v, slots) if slots is not None and kernel.can_write(k, v) else None
                if new_kv is None and slots is not None:
                    write_kv_slots(kv_cache, k, v, slots)
                out = kernel(
                    q, kv_cache, plan.kernel_inputs(), scale=scale, window=sliding_window, new_kv=new_kv
                )
                return out if out.dtype == q.dtype else out.to(q.dtype)
        if slots is not None:
            write_kv_slots(kv_cache, k, v, slots)
        split = None if self._batch_invariant else plan.row_split()
        if split is not None:
            # Decodes apart from prompt chunks (split_rows): the kernel takes them, as in a step
            # of decodes only; the prompt chunks go through the gather + SDPA path on their own.
            n = split.tokens
            kw = {"scale": scale, "sliding_window": sliding_window, "kv_written": True}
            short = self.forward(q[:n], k[:n], v[:n], kv_cache, split.short, **kw)  # type: ignore[arg-type]
            rest = self.forward(q[n:], k[n:], v[n:], kv_cache, split.rest, **kw)  # type: ignore[arg-type]
            return torch.cat([short, rest])
        if self._batch_invariant:
            out = invariant_attention(q, kv_cache, plan, scale=scale, window=sliding_window)
            return out if out.dtype == q.dtype else out.to(q.dtype)
        hkv = kv_cache.shape[3]
        group = hq // hkv
        # [R, Hkv, K, D]: each row's keys laid end to end, read slot by slot (see ``key_slots``).
        slots = plan.key_slots(sliding_window)
        keys = kv_cache[0].view(-1, hkv, d).index_select(0, slots).view(r, -1, hkv, d).transpose(1, 2)
        values = kv_cache[1].view(-1, hkv, d).index_select(0, slots).view(r, -1, hkv, d).transpose(1, 2)
        # Pure decode (one token per row, no padded tokens): token i is row i's only query, so the
        # query gather and the output scatter are identities and plain views replace them.
        decode = qmax == 1 and t == r
        # [R, Hkv, G*Q, D]: the G query heads sharing a KV head become extra query rows.
        if decode:
            queries = q.reshape(r, hkv, group, d)
        else:
            queries = q.index_select(0, plan.gather.query_index).view(r, qmax, hkv, group, d)
            queries = queries.permute(0, 2, 3, 1, 4).reshape(r, hkv, group * qmax, d)
        out = F.scaled_dot_product_attention(
            queries if queries.dtype == keys.dtype else queries.to(keys.dtype),
            keys,
            values,
            attn_mask=plan.mask(sliding_window, group, keys.dtype),
            scale=scale,
        )
        if decode:
            out = out.reshape(r, hq, d)
        else:
            out = out.view(r, hkv, group, qmax, d).permute(0, 3, 1, 2, 4).reshape(r * qmax, hq, d)
            out = out.index_select(0, plan.gather.out_index)
        # SDPA's output is fresh: padded tokens are zeroed in place.
        out.masked_fill_(plan.gather.token_invalid, 0.0)
        return out if out.dtype == q.dtype else out.to(q.dtype)
