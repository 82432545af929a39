"""An exact greedy LM head: screen the vocabulary with a bf16 product, re-score a few in float32.

A greedy step needs only each row's argmax, not the ``[N, V]`` float32 logits. The bf16 product
with a oneDNN-packed bf16 copy of the head reads half the bytes and runs ~1.8x faster on a CPU with
AVX512_BF16 (BENCHMARKS.md); its error is bounded, so it can rule out every token that cannot be
the float32 argmax, and the few left are re-scored in float32.

The bound. Let x be a hidden row, w_v a vocabulary row, n the hidden size, u = 2^-8 (bf16
round-to-nearest), e = 2^-24 (float32), g_n = n e / (1 - n e), S_v = sum_i |x_i w_vi|.
- The float32 logit z_v (any summation order, the full GEMM) is within g_n S_v of the exact dot
  product.
- The screen rounds x and w_v to bf16 (relative error u each), multiplies exactly (8-bit by 8-bit
  significands fit float32), sums in float32 (g_n times (1+u)^2 S_v) and rounds the sum to bf16
  (u times (1+g_n)(1+u)^2 S_v): z^_v is within (2u + u^2 + g_n (1+u)^2 + u (1+g_n)(1+u)^2) S_v of
  the exact product.
- So |z^_v - z_v| <= c S_v <= c ||x|| ||w_v|| (Cauchy-Schwarz), with
  c = 2u + u^2 + 2 g_n (1+u)^2 + u (1+g_n)(1+u)^2, taken 2^-6 larger here to cover the float32
  rounding of the norms and of the test below. AVX512_BF16 treats bf16 denormal inputs as zero and
  flushes denormal results; each flush moves a sum by under 2^-126, which the absolute term
  a = 2^-123 (2n + 1 + sqrt(n) (||x|| + max ||w||)) covers with room.
- With b_v = c ||x|| ||w_v|| + a: z_u <= z^_u + b_u for all u, and z_v >= z^_v - b_v, so the
  float32 argmax v* satisfies z^_v* + b_v* >= z_v* >= max_u z_u >= max_u (z^_u - b_u): v* lies in
  C = {v : z^_v + b_v >= max_u (z^_u - b_u)}.

On CPU the loader's compiled layer ops (``kernels/cpu/layer_ops.c``) run the test above in one
call: two passes over the bf16 screen instead of a float32 copy and six torch passes over it
(~1 ms a step on SmolLM2 at 16 rows). It evaluates the same float32 expressions, so it finds the
same candidates; without the ops, torch's passes run.

The candidates of all rows are re-scored in float32 by the same kernel the full head runs (their
rows gathered and packed, one small product), and each row takes its first maximum among its own
candidates; ids are ascending, so ties go to the lowest id as ``torch.argmax`` and
``runner_v2/sampler.py``'s ``row_argmax`` break them.

NOTE: exactness against the full float32 logits rests on the re-score rounding each dot product
as the full GEMM does. The compiled GEMM (``kernels/cpu/gemm.c``, the loader's layout where it
builds) guarantees it: each output is one multiply-add chain over the hidden size, whatever the
columns beside it (tested). oneDNN's packed product of the gathered rows has been bit-equal to the
full product's columns in every check (``tests/models/test_greedy_head.py`` asserts it on
SmolLM2); were a kernel to sum in another order, the two could disagree only between tokens whose
float32 logits lie within 2 g_n S_v of each other (both are float32 roundings of the same real dot
product), and the token chosen would still be one of them.

Memory: the head keeps a bf16 copy of the weight (2 bytes per weight; 56.6 MB for SmolLM2's
49152 x 576), float32 row norms and a scratch: 2 x 16 float32 rows for torch's passes (6.3 MB
there; :func:`screen_bytes` counts this, the larger), 9 bytes per id for the compiled test; the float32
weight used to re-score is the LM head's own parameter (shared with the tied embedding, never
copied).

``WARMCAP_EXACT_GREEDY_HEAD=0`` turns the screen off (every step computes the full logits). The
screen needs oneDNN's bf16 GEMM (AVX512-BF16 or AMX CPUs); elsewhere no head is built, unless
``WARMCAP_EXACT_GREEDY_HEAD=portable``: the same screen with float32 products of the bf16-rounded
values (exact as products of 8-bit mantissas, summed in float32 and rounded to bf16: the bound's
premises), 4 bytes a weight. It is exact but no faster than the full head: it exists so that the
head's logic is tested on every CPU (the tests set it where oneDNN has no bf16).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from warmcap.config import kernel_default
from warmcap.contracts.parallel import all_gather_last_dim
from warmcap.kernels.cpu.gemm import BlockedWeight
from warmcap.kernels.cpu.layer_ops import LayerOps
from warmcap.models.packed_linear import PackedLinear, can_prepack

#: environment switch: "0" computes the full logits on every step (the A/B peer)
ENV_SWITCH = "WARMCAP_EXACT_GREEDY_HEAD"

_U = 2.0**-8
_E = 2.0**-24
_SAFETY = 1.0 + 2.0**-6
# Hidden rows whose norm falls outside this range take the full logits: below it the bound's float32
# arithmetic would underflow, above it the logits could overflow (the engine's non-finite check then
# sees them, as without the screen).
_MIN_NORM = 2.0**-60
_MAX_BOUND = 2.0**100
#: :attr:`GreedyHead.max_candidates` never goes below this (small vocabularies re-score whole)
_MIN_CANDIDATE_LIMIT = 512
#: rows screened per pass over the vocabulary (bounds the scratch to 2 x _CHUNK x V float32)
_CHUNK = 16


def screen_bytes(vocab_size: int, hidden_size: int, *, portable: bool = False) -> int:
    """What a :class:`GreedyHead` over a ``[vocab_size, hidden_size]`` head holds beside it: the bf16
    copy (float32-held when ``portable``), the float32 row norms and the ``[2, _CHUNK, V]`` scratch."""
    return vocab_size * hidden_size * (4 if portable else 2) + vocab_size * 4 * (1 + 2 * _CHUNK)


def can_screen() -> bool:
    """Whether this torch build packs bf16 weights for oneDNN's GEMM on this CPU."""
    return can_prepack() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _setting(setting: str | None) -> str:
    """The config's ``kernel.exact_greedy_head`` (None: its default, ``WARMCAP_EXACT_GREEDY_HEAD``)."""
    if setting is None:
        return kernel_default("exact_greedy_head")
    return setting


def enabled(setting: str | None = None) -> bool:
    """Whether the config's ``exact_greedy_head`` leaves the screened head on (it is unless "off")."""
    return _setting(setting) != "off"


def screen_mode(setting: str | None = None) -> str | None:
    """How a head would be screened here: ``"onednn"`` (bf16 GEMM), ``"portable"`` (forced by
    ``exact_greedy_head="portable"``) or None (no screen on this CPU)."""
    if _setting(setting) == "portable":
        return "portable" if can_prepack() else None
    return "onednn" if can_screen() else None


def bound_coefficient(hidden_size: int) -> float:
    """c of the module docstring for hidden size n, with the safety factor applied."""
    n = hidden_size
    g = n * _E / (1 - n * _E)
    c = 2 * _U + _U * _U + 2 * g * (1 + _U) ** 2 + _U * (1 + g) * (1 + _U) ** 2
    return c * _SAFETY


def _linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _full_precision_matmul() -> bool:
    # NOTE: a float32 GEMM allowed to run in bf16 breaks the bound's premise.
    return torch.backends.mkldnn.matmul.fp32_precision in ("none", "ieee")


@contextmanager
def _serial() -> Iterator[None]:
    """Run the block's ops on the calling thread only. The screen's passes after the GEMM are
    memory-light and many: each parallel region is a barrier, and with the cores shared (or
    oversubscribed) a barrier waits for a descheduled thread (measured 2.5x slower at 2 threads
    under load, BENCHMARKS.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True, slots=True)
class Screen:
    """The candidates of a batch of rows: ``ids`` ascending (the union over rows) and ``member``
    ``[M, K]``, whether ``ids[k]`` is a candidate of row m."""

    ids: torch.Tensor
    member: torch.Tensor

    @property
    def per_row(self) -> torch.Tensor:
        """How many candidates each row has, int64 ``[M]``."""
        return self.member.sum(dim=1)


@dataclass(eq=False, slots=True)
class GreedyHead:
    """The argmax of ``lm_head(x)`` per row, exactly, from a bf16 screen and a float32 re-score.

    Built by :meth:`build` over a float32 :class:`~warmcap.models.packed_linear.PackedLinear` head;
    :meth:`argmax` gives None whenever the full logits must be computed instead (see there).
    """

    head: nn.Module
    #: oneDNN-packed bf16 copy of the head's weight
    screen_weight: torch.Tensor
    #: float32 ``[V]``: ||w_v||, rounded up
    row_norms: torch.Tensor
    max_norm: float
    coefficient: float
    hidden_size: int
    #: the compiled candidate test (``kernels/cpu/layer_ops.c``); None: torch's ops
    ops: LayerOps | None = None
    #: scratch of :meth:`screen`, made on first use: float32 ``[2, _CHUNK, V]`` for torch's ops,
    #: ``9 V`` bytes for the compiled test
    work: torch.Tensor | None = None
    #: ``screen_weight`` is the bf16-rounded weight held in float32 (the portable screen)
    portable: bool = False

    @classmethod
    def build(
        cls, head: nn.Module, ops: LayerOps | None = None, setting: str | None = None
    ) -> GreedyHead | None:
        """The screened head of ``head``, or None where it cannot be exact or fast: not a packed
        float32 CPU linear without bias, no oneDNN bf16, or a weight with NaN/Inf. ``ops``: the
        compiled CPU layer ops, whose candidate test replaces torch's passes when given.
        ``setting``: the config's ``kernel.exact_greedy_head`` (None: its default)."""
        if (
            type(head) is not PackedLinear
            or not (head.is_plain or is_vocab_shard(head))
            or head.group is not None
            or head.bias is not None
        ):
            return None
        weight = head.weight.detach()
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        mode = screen_mode(setting)
        if mode is None:
            return None
        # float64 norms never under- or overflow for float32 rows; rounded up so b_v only grows.
        norms = weight.double().norm(dim=1).mul_(1 + 2.0**-20).float()
        max_norm = float(norms.max()) if norms.numel() else 0.0
        if not math.isfinite(max_norm):
            return None
        portable = mode == "portable"
        screen_weight = (
            weight.bfloat16().float()
            if portable
            else torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16(), None)
        )
        return cls(
            head=head,
            screen_weight=screen_weight,
            row_norms=norms,
            max_norm=max_norm,
            coefficient=bound_coefficient(weight.shape[1]),
            hidden_size=weight.shape[1],
            ops=ops,
            portable=portable,
        )

    @property
    def weight(self) -> torch.Tensor:
        """The float32 ``[V, H]`` weight re-scored against: the head's own parameter."""
        return self.head.weight.detach()

    @property
    def nbytes(self) -> int:
        """Memory the screen adds beside the head: the bf16 copy, the norms and the scratch."""
        return screen_bytes(*self.weight.shape, portable=self.portable)

    @property
    def max_candidates(self) -> int:
        """Past this many candidates (over all rows) :meth:`argmax` leaves the step to the full
        logits: re-scoring an eighth of a large vocabulary costs what the screen saves."""
        return max(self.row_norms.numel() // 8, _MIN_CANDIDATE_LIMIT)

    def usable(self) -> bool:
        """Whether the head still computes as when this was built (a packed float32 linear with
        full-precision GEMMs); the benchmark's peers unpack linears after load."""
        head = self.head
        return (
            type(head) is PackedLinear
            and (head.is_plain or is_vocab_shard(head))
            and head.group is None
            and _full_precision_matmul()
        )

    def screen(self, x: torch.Tensor) -> Screen | None:
        """The candidate set C of each row of ``x`` ``[M, H]`` float32; None when a row is
        non-finite or its norm is out of the bound's range."""
        norms = x.double().norm(dim=1)
        lowest, highest = (float(v) for v in norms.aminmax())
        if not (lowest >= _MIN_NORM and highest * self.max_norm <= _MAX_BOUND):
            return None
        n = self.hidden_size
        scale = (norms * (1 + 2.0**-20)).float()
        cx = (scale * self.coefficient).unsqueeze(1)
        absolute = (2.0**-123 * (2 * n + 1 + math.sqrt(n) * (scale + self.max_norm))).unsqueeze(1)
        approx = self.approximate(x)
        if self.ops is not None:
            found = self.ops.greedy_candidates(
                approx, cx, absolute, self.row_norms, self._workspace(9, torch.uint8)
            )
            if found is not None:
                ids, lo = found
                member = torch.addcmul(approx[:, ids].float(), cx, self.row_norms[ids]) >= lo
                return Screen(ids=ids, member=member)
        with _serial():
            lo = torch.empty_like(cx)
            slack = torch.full_like(self.row_norms, float("-inf"))
            for start in range(0, x.shape[0], _CHUNK):
                rows = slice(start, start + _CHUNK)
                self._chunk_bounds(approx[rows], cx[rows], absolute[rows], lo[rows], slack)
            ids = (slack >= 0).nonzero().squeeze(1)
            member = torch.addcmul(approx[:, ids].float(), cx, self.row_norms[ids]) >= lo
        return Screen(ids=ids, member=member)

    def approximate(self, x: torch.Tensor) -> torch.Tensor:
        """The screen's logits z^ of ``x`` ``[M, H]``, bf16 ``[M, V]``: bf16 inputs and weights,
        float32 sums (oneDNN's bf16 GEMM, or the portable product)."""
        if self.portable:
            return F.linear(x.bfloat16().float(), self.screen_weight).bfloat16()
        return _linear(x.bfloat16(), self.screen_weight)

    def _chunk_bounds(
        self,
        approx: torch.Tensor,
        cx: torch.Tensor,
        absolute: torch.Tensor,
        lo: torch.Tensor,
        slack: torch.Tensor,
    ) -> None:
        """For rows ``approx`` (bf16 ``[m, V]``, m <= _CHUNK): ``lo`` = max_u (z^_u - b_u) less
        both absolute terms, and ``slack`` raised to max over the rows of z^_v + c||x|| ||w_v|| - lo;
        v is a candidate of a row iff its own slack is >= 0."""
        m = approx.shape[0]
        work = self._workspace(2 * _CHUNK, torch.float32).view(2, _CHUNK, -1)
        z, tmp = work[0, :m], work[1, :m]
        # NOTE: into preallocated buffers: a fresh [m, V] float32 result each step costs more in
        # page faults than the arithmetic (measured ~1 ms per 3 MB on one thread).
        z.copy_(approx)
        torch.addcmul(z, cx, self.row_norms, value=-1.0, out=tmp)
        torch.amax(tmp, dim=1, keepdim=True, out=lo)
        lo -= 2 * absolute
        torch.addcmul(z, cx, self.row_norms, out=tmp).sub_(lo)
        torch.maximum(slack, tmp.amax(dim=0), out=slack)

    def _workspace(self, per_id: int, dtype: torch.dtype) -> torch.Tensor:
        """``per_id`` elements of ``dtype`` per vocabulary id, flat (kept between steps)."""
        size = per_id * self.row_norms.numel()
        if self.work is None or self.work.dtype != dtype or self.work.numel() != size:
            self.work = torch.empty(size, dtype=dtype)
        return self.work

    def rescore(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[M, K]`` of the vocabulary rows ``ids``, by the kernel the full head
        runs (its rows gathered and packed)."""
        packed, gemm = self.head.packed_weight, self.head.gemm
        if isinstance(packed, BlockedWeight) and gemm is not None:
            logits = gemm.linear(x, packed.rows(ids))
            if logits is not None:
                return logits
        rows = self.weight.index_select(0, ids)
        return _linear(x, torch.ops.mkldnn._reorder_linear_weight(rows, None))

    def argmax(self, x: torch.Tensor, *, decline: bool = False) -> torch.Tensor | None:
        """``row_argmax(lm_head(x))`` int64 ``[M]`` without the full logits; None when the full
        logits must be computed: the head changed (:meth:`usable`), a row is non-finite or out
        of range, or the candidates are too many for the screen to pay. ``decline``: the caller
        wants the full logits anyway (a sharded head still takes part in its ranks' exchange)."""
        found = None if decline else self.argmax_and_logit(x)
        return None if found is None else found[0]

    def argmax_and_logit(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each row's argmax (int64 ``[M]``, ids of this head's rows) and its float32 logit, the
        full head's bits; None as :meth:`argmax`."""
        if not self.usable():
            return None
        screen = self.screen(x)
        if screen is None or not 0 < screen.ids.numel() <= self.max_candidates:
            return None
        with _serial():
            logits = self.rescore(x, screen.ids).masked_fill_(~screen.member, float("-inf"))
            best, index = logits.max(dim=1)
            return screen.ids[index], best


def is_vocab_shard(head: nn.Module) -> bool:
    """Whether ``head`` (packed) is one rank's slice of a vocabulary-parallel LM head
    (``models/layers.py`` ``ParallelLMHead``: its class declares ``vocab_shard``)."""
    return type(head) is PackedLinear and bool(getattr(head.unpacked_class, "vocab_shard", False))


@dataclass(eq=False, slots=True)
class ShardedGreedyHead:
    """The exact greedy head of a vocabulary-parallel LM head: each rank screens and re-scores its
    own slice of the vocabulary (a :class:`GreedyHead` over the shard), then the ranks exchange one
    ``(logit, id)`` pair a row instead of gathering ``[M, V]`` logits.

    Exact: the gathered full logits are the ranks' slices side by side, each computed by the shard's
    own GEMM, and the re-score reproduces that GEMM's bits for the rows it scores; so the full
    argmax is the largest of the slices' maxima, ties to the lowest rank, whose ids are the lowest
    (``row_argmax`` takes the first maximum). Each slice's maximum is its first maximum (the
    candidates are ascending ids).

    Every rank must call :meth:`argmax` on the same steps: the exchange is a collective. A rank
    that cannot screen (no screen built here, the head changed, a non-finite row, too many
    candidates) or whose caller wants the full logits (``decline``) sends id -1; then every rank
    returns None and computes the full logits, so the ranks never part ways. The caller decides to
    call it from the step alone (every rank holds the same step): what only one rank knows goes in
    ``decline``.
    """

    #: this rank's screen; None: this rank cannot screen (no bf16 GEMM here, say)
    local: GreedyHead | None
    #: the first vocabulary id of this rank's slice
    vocab_start: int
    #: set on every rank at once when some rank has no screen (it said so in an exchange): the
    #: ranks then compute the full logits without asking again
    off: bool = False

    @property
    def nbytes(self) -> int:
        return 0 if self.local is None else self.local.nbytes

    def argmax(self, x: torch.Tensor, *, decline: bool = False) -> torch.Tensor | None:
        if self.off:
            return None
        m = x.shape[0]
        # float64 holds every float32 logit and every id below 2^53 exactly; id -1: declined this
        # step, -2: this rank never screens
        mine = torch.full((m, 2), -1.0 if self.local is not None else -2.0, dtype=torch.float64)
        found = None if decline or self.local is None else self.local.argmax_and_logit(x)
        if found is not None:
            ids, logits = found
            mine[:, 0] = logits
            mine[:, 1] = ids + self.vocab_start
        pairs = all_gather_last_dim(mine).view(m, -1, 2)
        if bool((pairs[..., 1] < 0).any()):
            self.off = bool((pairs[..., 1] == -2).any())
            return None
        # first maximum: the lowest rank among equal logits, hence the lowest id
        rank = pairs[..., 0].argmax(dim=1)
        return pairs[torch.arange(m), rank, 1].long()
