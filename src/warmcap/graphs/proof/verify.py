"""Invariant I4: every captured graph, replayed on a real padded batch, equals eager.

For each graph, target or drafter, a real batch with fewer requests / tokens than the graph holds
(so there is padding) is laid out on blocks taken from the KV cache manager, each row with a context
(the batch's vocabulary: :mod:`warmcap.graphs.proof.verify_batch`; each subject's passes:
:data:`PASS_BUILDERS`), then

1. the unpadded batch runs eagerly (the reference for real rows; for target graphs a full
   recompute of each row from position 0, which writes the contexts too: :mod:`.verify_target`),
2. the batch is padded into the graph's buffers and replayed,
3. the same padded inputs run eagerly over the graph's metadata;

replay vs 3 must agree everywhere (bit-equal on CPU); replay vs 1 within the real-row tolerance on
the real rows' outputs (target graphs: auxiliary hidden states too) *and* on what the real rows
wrote into the cache, with the same greedy tokens. Every number of a check is reduced on the
device and read back in one transfer: one host sync per graph (:func:`_numbers`).

What the real rows wrote depends on the group's spec: attention and latent (MLA, indexer) groups
hold one entry per token, compared at the real tokens' slots; Mamba groups hold one whole state per
block, compared at the blocks the reference's ``write_blocks`` name for real tokens (never the PAD
sink). Before 2 and 3 those locations are put back as they were before 1, so a replay that writes
nothing there, or writes elsewhere, cannot pass on what the reference left behind, and every run
reads the same state (a Mamba row may write the very block it reads).

Verification rows belong to no running request: their Mamba plans are probes
(:func:`~warmcap.runner_v2.mamba_state.probe_plan`). With Mamba state, odd rows start from zero, so
a graph's checks cover a row that reads a context's state and writes one computed from it, and a
row that starts from the zero state. Afterwards the blocks are freed (tail first, which restores
the free queue) and zeroed, so verification leaves no trace in the pool or the KV tensors.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from warmcap.core.kv_spec import MambaSpec
from warmcap.graphs.capture.planning import DRAFTER, TARGET
from warmcap.graphs.proof.verify_batch import Passes, PoolTooSmallError, layout_for, scratch_tables
from warmcap.graphs.proof.verify_draft import draft_passes
from warmcap.graphs.proof.verify_target import target_passes
from warmcap.models.batch_invariant import is_batch_invariant
from warmcap.runner_v2.kv_cache import KV_LAYOUTS
from warmcap.runner_v2.mamba_state import MambaMetadata

if TYPE_CHECKING:
    from warmcap.contracts import AttentionMetadata
    from warmcap.core.kv_cache_manager import KVCacheManager
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.graphs.capture.capturer import CapturedGraph, GraphCapturer

#: how a subject's graphs are checked: the passes of one check over a real batch, by subject name
#: (:mod:`warmcap.graphs.capture.subjects`; capture knows nothing of its proof)
PASS_BUILDERS: dict[str, Callable[..., Passes]] = {TARGET: target_passes, DRAFTER: draft_passes}


@dataclass(frozen=True, slots=True)
class Tolerance:
    """Max |diff| allowed: replay vs eager on the same padded inputs (absolute), and real rows vs
    the unpadded batch: absolute, or (``relative``) scaled by the reference's largest magnitude when
    that exceeds 1 (a real model's hidden states reach the hundreds, where 1e-5 absolute is a few
    float32 ulps)."""

    replay_vs_eager: float
    real_rows: float
    relative: bool = True

    def real_rows_limit(self, peak: float) -> float:
        """The real-row bound for a comparison against a reference whose :func:`magnitude` is
        ``peak``."""
        return self.real_rows * peak if self.relative else self.real_rows


def default_tolerance(
    device: torch.device, dtype: torch.dtype, backend: str = "static", *, batch_invariant: bool = False
) -> Tolerance:
    """Replay vs padded eager: bit-equal on CPU (1e-5 for ``compile``, which fuses kernels its own
    way); more on GPU, where kernels may pick other tilings per shape.

    Real rows vs the unpadded batch on CPU: 1e-5 absolute for a batch-invariant model
    (:mod:`warmcap.models.batch_invariant`: its GEMMs are bit-invariant, and so is its attention,
    ``runner_v2/attention/torch_paged.invariant_attention``: measured 0 on SmolLM2 on Intel and AMD),
    else 1e-4 relative to the reference's magnitude.

    NOTE: without batch invariance the unpadded batch runs every GEMM with fewer rows than the
    graph, and on oneDNN/MKL a row's result depends on the row count (measured: any count of 1-3,
    5-7, 9-11 rows differs from larger ones in the last bits; the compiled CPU GEMM,
    ``kernels/cpu/gemm.c``, does not, which leaves attention's query padding). Through SmolLM2-135M's 30 layers that
    becomes ~2e-6 relative (4e-4 on hidden states of magnitude 40); tiny models stay under 1e-5
    absolute. Padding that leaked into real rows would be off by O(1), and greedy tokens must match
    as well."""
    if device.type == "cpu":
        replay = 1e-5 if backend == "compile" else 0.0
        return Tolerance(replay, 1e-5, relative=False) if batch_invariant else Tolerance(replay, 1e-4)
    if dtype == torch.float32:
        return Tolerance(1e-5, 1e-3)
    return Tolerance(1e-2, 5e-2)


@dataclass(frozen=True, slots=True)
class GraphCheck:
    """Outcome of verifying one graph."""

    label: str
    num_real_tokens: int
    num_real_reqs: int
    max_abs_diff: float
    real_rows_max_abs_diff: float
    greedy_match: bool
    verified: bool
    reason: str = ""

    @classmethod
    def unverified(cls, label: str, reason: str) -> GraphCheck:
        """A graph that could not be checked, and why."""
        return cls(label, 0, 0, float("nan"), float("nan"), False, False, reason)


def vocab_size(model: torch.nn.Module) -> int:
    return next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings


def graph_rng(seed: int, label: str) -> np.random.Generator:
    """The inputs' generator of one graph's check: seeded by the graph, not by the graphs checked
    before it, so a check gives the same numbers alone as in a full pass (the start-up cache's
    spot check, :mod:`warmcap.graphs.proof.startup_cache`, relies on it)."""
    return np.random.default_rng([seed, zlib.crc32(label.encode())])


def verify_graphs(
    capturer: GraphCapturer,
    graphs: list[CapturedGraph],
    kv_cache_manager: KVCacheManager,
    *,
    tolerance: Tolerance | None = None,
    seed: int = 0,
    on_check: Callable[[int, int, GraphCheck], None] | None = None,
) -> list[GraphCheck]:
    """Verify every graph, target and drafter (see the module docstring); one :class:`GraphCheck`
    per graph, each a function of its graph alone (:func:`graph_rng`). ``on_check(done, total, check)`` is called after each (start-up progress)."""
    runner = capturer.runner
    tol = tolerance or default_tolerance(
        runner.device, runner.dtype, capturer.backend, batch_invariant=is_batch_invariant(runner.model)
    )
    vocab = vocab_size(runner.model)
    checks: list[GraphCheck] = []
    with torch.inference_mode():
        for graph in graphs:
            rng = graph_rng(seed, graph.spec.label)
            checks.append(_verify_one(capturer, graph, kv_cache_manager, tol, rng, vocab))
            if on_check is not None:
                on_check(len(checks), len(graphs), checks[-1])
    return checks


def _verify_one(
    capturer: GraphCapturer,
    graph: CapturedGraph,
    manager: KVCacheManager,
    tol: Tolerance,
    rng: np.random.Generator,
    vocab: int,
) -> GraphCheck:
    runner = capturer.runner
    spec = graph.spec
    subject = capturer.subject(spec)
    groups = subject.groups()
    stateful = any(isinstance(g.spec, MambaSpec) for g in groups)
    layout = layout_for(spec, runner.max_model_len, from_zero=stateful)
    if layout is None:
        return GraphCheck.unverified(spec.label, "graph exceeds max_model_len")
    sizes = [c + n for c, n in zip(layout.contexts, layout.query_lens, strict=True)]
    try:
        with scratch_tables(runner, manager, spec.label, sizes) as (tables, num_blocks):
            passes = PASS_BUILDERS[spec.subject](subject, graph, layout, tables, num_blocks, rng, vocab)
            t, caches = sum(layout.query_lens), runner.kv_caches.tensors
            written = [w for g in groups for w in _group_written(g, passes.metas[g.name], caches, t)]
            return _check(spec.label, passes, written, tol)
    except PoolTooSmallError:
        return GraphCheck.unverified(spec.label, "KV pool too small")


def _check(label: str, passes: Passes, written: list[Written], tol: Tolerance) -> GraphCheck:
    """Run ``passes`` with ``written`` put back before the replay and the padded eager pass."""
    before = [w.view[w.index] for w in written]
    reference = [o.clone() for o in passes.reference()]
    kv_reference = [w.view[w.index] for w in written]
    _restore(written, before)
    replayed = [o.clone() for o in passes.replay()]
    kv_replayed = [w.view[w.index] for w in written]
    _restore(written, before)
    eager_padded = passes.padded_eager()

    t = reference[0].shape[0]
    real_replayed = [o[:t] for o in replayed]
    if passes.logits is not None:
        greedy_agree = tokens_agree(passes.logits(reference[0]), passes.logits(replayed[0][:t]), tol)
    else:
        greedy_ref, greedy_graph = passes.greedy(reference[0]), passes.greedy(replayed[0][:t])
        greedy_agree = same_tokens(greedy_ref, greedy_graph, reference[0].device)
    diff, real_diff, peak, finite, greedy_same = _numbers(
        max_abs_all(replayed, eager_padded),
        max_abs_all(real_replayed + kv_replayed, reference + kv_reference),
        magnitude(reference + kv_reference),
        # NOTE: NaN in replay and eager alike compares equal (padded rows may be NaN): real rows
        # that are not finite must fail on their own, or a model with NaN weights would verify.
        all_finite(real_replayed + reference),
        greedy_agree,
    )
    greedy = bool(greedy_same)
    real_tol = tol.real_rows_limit(peak)
    unwritten = sorted({w.group for w in written if w.is_state and w.index.numel() == 0})
    nonfinite = not finite
    reasons = failed_bounds(diff, real_diff, real_tol, greedy, tol)
    if unwritten:
        reasons.append(f"real rows wrote no state in {', '.join(unwritten)}")
    if nonfinite:
        reasons = ["real rows are not finite (NaN/Inf) in replay or eager output: check the model's weights"]
    return GraphCheck(label, t, passes.num_reqs, diff, real_diff, greedy, not reasons, "; ".join(reasons))


def failed_bounds(diff: float, real_diff: float, real_tol: float, greedy: bool, tol: Tolerance) -> list[str]:
    """Why the numbers of a check fail it, one phrase per bound broken (none: they pass). A graph is
    never reported unverified without its reason."""
    reasons = []
    if not diff <= tol.replay_vs_eager:
        reasons.append(
            f"replay differs from eager on the same padded inputs by {diff:.3g} (bound {tol.replay_vs_eager:g})"
        )
    if not real_diff <= real_tol:
        reasons.append(
            f"real rows differ from the unpadded batch by {real_diff:.3g} (bound {real_tol:.3g}): "
            "padding or the batch's size reached a real row's numbers"
        )
    if not greedy:
        reasons.append("greedy tokens of the real rows differ between replay and the unpadded batch")
    return reasons


@dataclass(frozen=True, slots=True)
class Written:
    """Entries ``index`` of ``view``, a view of one layer's cache (so assigning them writes the
    cache), that the real rows of a pass write; ``is_state``: whole Mamba states."""

    group: str
    is_state: bool
    view: torch.Tensor
    index: torch.Tensor


def _group_written(
    group: KVCacheGroup, meta: AttentionMetadata, caches: dict[str, torch.Tensor], t: int
) -> list[Written]:
    """What the first ``t`` (real) tokens of a pass over ``meta`` write into each layer's cache of
    ``group`` (the layers of a group share their slots: worked out once)."""
    first = caches[group.layer_names[0]]
    index = _written_index(group, meta, first, t)
    if isinstance(group.spec, MambaSpec):
        return [Written(group.name, True, caches[x], index) for x in group.layer_names]
    dim = KV_LAYOUTS[group.spec.kind].block_dim
    return [
        Written(group.name, False, caches[x].flatten(dim, dim + 1).movedim(dim, 0), index)
        for x in group.layer_names
    ]


def _written_index(group: KVCacheGroup, meta: AttentionMetadata, cache: torch.Tensor, t: int) -> torch.Tensor:
    """The entries of ``cache`` (one layer of ``group``) the first ``t`` tokens write: whole states'
    blocks, or token slots."""
    if isinstance(group.spec, MambaSpec):
        # ``[num_blocks + 1, state]``: one state per block; the last row is the PAD sink.
        if not isinstance(meta, MambaMetadata) or meta.write_blocks is None:
            raise TypeError(
                f"group {group.name} keeps Mamba state but the pass's metadata names no state blocks: "
                "its owner (runner.state_metadata, the drafter's state_metadata) must plan them"
            )
        blocks = meta.write_blocks[:t].to(torch.int64)
        sink = cache.shape[0] - 1
        return torch.unique(blocks[(blocks >= 0) & (blocks != sink)])
    # One entry per token (attention K and V, a latent): slot s is (block, offset) flattened.
    return meta.slot_mapping[:t].to(torch.int64).clone()


def _restore(written: list[Written], values: list[torch.Tensor]) -> None:
    for w, v in zip(written, values, strict=True):
        w.view[w.index] = v


def _numbers(*scalars: torch.Tensor) -> list[float]:
    """0-dim device tensors as floats, in one device-to-host transfer."""
    device = scalars[0].device
    return torch.stack([x.to(device, torch.float32) for x in scalars]).tolist()


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every element of ``tensors`` as one float32 vector (one reduction instead of one a tensor)."""
    return torch.cat([t.reshape(-1).float() for t in tensors]) if tensors else torch.zeros(0)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Largest |a - b| (0-dim, on the device); positions NaN in both count as equal (padded rows
    with no keys may be NaN in replay and eager alike), a NaN on one side only as infinite."""
    if a.numel() == 0:
        return torch.zeros((), device=a.device)
    a, b = a.float(), b.float()
    both = torch.isnan(a) & torch.isnan(b)
    diff = torch.where(both, torch.zeros_like(a), (a - b).abs())
    return torch.nan_to_num(diff, nan=float("inf")).max()


def max_abs_all(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """``max_abs`` over pairs of tensors (an extra or missing tensor, or a pair of different
    shapes, is a mismatch: infinite)."""
    device = (a or b or [torch.zeros(0)])[0].device
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return torch.full((), float("inf"), device=device)
    if not a:
        return torch.zeros((), device=device)
    return max_abs(_flat(a), _flat(b))


def magnitude(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Scale of the real-row tolerance: the largest finite |value| of ``tensors``, at least 1
    (0-dim, on the device)."""
    flat = _flat(tensors)
    peak = torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0).abs().max() if flat.numel() else flat.sum()
    return torch.clamp(peak, min=1.0)


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Whether every element of ``tensors`` is finite (0-dim bool, on the device)."""
    return torch.isfinite(_flat(tensors)).all()


def tokens_agree(reference: torch.Tensor, replayed: torch.Tensor, tol: Tolerance) -> torch.Tensor:
    """Whether the greedy tokens of two passes' logits ``[rows, vocab]`` agree (0-dim bool).

    A row may pick another token only at a near tie that the two passes' own rounding explains:
    the reference scores the replay's token within twice the row's largest |logit difference| of
    its own pick, and that difference is within the real-row tolerance (scaled by the logits'
    magnitude, as the hidden states' bound is). The unpadded reference recomputes each row from
    position 0 (prefill attention, other row counts), so its logits differ from a decode replay's
    in the last bits; on SmolLM2 at batch 116 with random verification contexts two tokens tied
    within 1e-4 and the strict check failed a graph whose replay equalled eager bit for bit. A
    padding leak moves logits by O(1), far past the bound, and fails as before."""
    if reference.shape != replayed.shape:
        return torch.zeros((), dtype=torch.bool, device=reference.device)
    if reference.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=reference.device)
    ref, rep = reference.float(), replayed.float()
    a, b = ref.argmax(-1, keepdim=True), rep.argmax(-1, keepdim=True)
    delta = (ref - rep).abs().amax(-1, keepdim=True)
    limit = tol.real_rows * magnitude([ref]) if tol.relative else tol.real_rows
    gap = ref.gather(-1, a) - ref.gather(-1, b)
    near_tie = (gap <= 2 * delta) & (delta <= limit)
    return ((a == b) | near_tie).all()


def same_tokens(a: torch.Tensor | None, b: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Whether two passes picked the same greedy tokens (None: the pass picks none; 0-dim bool)."""
    if a is None:
        return torch.ones((), dtype=torch.bool, device=device)
    if b is None or a.shape != b.shape:
        return torch.zeros((), dtype=torch.bool, device=device)
    return (a == b).all()
