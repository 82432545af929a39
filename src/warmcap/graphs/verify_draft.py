"""Invariant I4 for drafter graphs: replay equals the eager drafter pass.

For each drafter graph a real pass smaller than the graph (one request fewer for ``draft_decode``,
one token fewer for ``draft_prefill``) is laid out on scratch blocks; the rows' drafter contexts are
written first by eager ``draft_prefill`` passes over their earlier positions. Then

1. the unpadded pass runs eagerly (the reference for real rows),
2. it is padded into the drafter's static buffers and the graph replays,
3. the same padded inputs run eagerly over the graph's metadata.

Replay vs 3 must agree everywhere (bit-equal on CPU); replay vs 1 on the real rows' outputs *and*
on what the real rows wrote into the drafter's cache within the real-row tolerance, with the same
greedy draft tokens (a ``draft_prefill`` that only writes context, DFlash's, has none).

What the real rows wrote depends on the group's spec: attention and latent (MLA) groups hold one
entry per token, compared at the real tokens' slots; Mamba groups hold one whole state per block,
compared at the blocks the pass's ``write_blocks`` name for real tokens (never the PAD sink).
Before 2 and 3 those locations are put back as they were before 1, so a replay that writes
nothing there cannot pass on what the reference left behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from warmcap.core.kv_spec import MambaSpec
from warmcap.drafters.base import DRAFT_PREFILL
from warmcap.drafters.paged import DraftPass
from warmcap.graphs.verify import (
    GraphCheck,
    PoolTooSmallError,
    context_chunks,
    layout_for,
    max_abs,
    scratch_tables,
)
from warmcap.runner_v2.kv_cache import KV_LAYOUTS
from warmcap.runner_v2.mamba_state import MambaMetadata

if TYPE_CHECKING:
    from warmcap.core.kv_cache_manager import KVCacheManager
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.graphs.capture import CapturedGraph, GraphCapturer
    from warmcap.graphs.verify import Tolerance
    from warmcap.runner_v2.attention.base import AttentionMetadata


def verify_draft_graph(
    capturer: GraphCapturer,
    graph: CapturedGraph,
    manager: KVCacheManager,
    tol: Tolerance,
    rng: np.random.Generator,
    vocab: int,
) -> GraphCheck:
    """Verify one drafter graph (see the module docstring)."""
    runner = capturer.runner
    spec = graph.spec
    layout = layout_for(spec, runner.max_model_len)
    if layout is None:
        return GraphCheck(
            spec.label, 0, 0, float("nan"), float("nan"), False, False, "graph exceeds max_model_len"
        )
    lens, contexts = layout.query_lens, list(layout.contexts)
    if any(isinstance(g.spec, MambaSpec) for g in runner.drafter.graph_groups()):
        # NOTE: verification rows belong to no running request, so their Mamba plans are probes
        # (``probe_plan``): a row with a context reads it and writes no state, one starting from
        # zero writes its final state. Even rows start from zero so every graph's state writes are
        # compared; odd rows keep a context so its reads are too.
        contexts = [0 if i % 2 == 0 else c for i, c in enumerate(contexts)]
    sizes = [c + n for c, n in zip(contexts, lens, strict=True)]
    try:
        with scratch_tables(runner, manager, spec.label, sizes) as (tables, num_blocks):
            return _compare(capturer, graph, contexts, lens, tables, num_blocks, tol, rng, vocab)
    except PoolTooSmallError:
        return GraphCheck(spec.label, 0, 0, float("nan"), float("nan"), False, False, "KV pool too small")


def _compare(
    capturer: GraphCapturer,
    graph: CapturedGraph,
    contexts: list[int],
    lens: list[int],
    tables: dict[str, torch.Tensor],
    num_blocks: int,
    tol: Tolerance,
    rng: np.random.Generator,
    vocab: int,
) -> GraphCheck:
    runner = capturer.runner
    drafter = runner.drafter
    statics = capturer.drafts
    spec = graph.spec
    own = {g: tables[g] for g in statics.buffers.block_tables}
    device = runner.device
    feature_spec = {p: drafter.feature_spec(p) for p in (DRAFT_PREFILL, spec.phase)}

    def inputs(phase: str, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = torch.from_numpy(rng.integers(0, vocab, size=n)).to(device)
        fs = feature_spec[phase]
        if fs is None:
            return ids, None
        width, dtype = fs
        return ids, torch.from_numpy(rng.standard_normal((n, width))).to(device, dtype)

    rows = np.arange(len(lens), dtype=np.int64)
    for chunk in context_chunks(contexts, statics.buffers.max_num_tokens):
        # Drafter contexts of these rows, written by one eager draft prefill.
        idx = np.array(chunk, dtype=np.int64)
        lengths = np.array([contexts[i] for i in chunk], dtype=np.int64)
        ctx = DraftPass.spans([f"ctx{i}" for i in chunk], idx, np.zeros(len(chunk), dtype=np.int64), lengths)
        sub = {g: t[chunk] for g, t in own.items()}
        metas = _load(capturer, ctx, sub, num_blocks)
        _forward(capturer, DRAFT_PREFILL, metas, ctx, *inputs(DRAFT_PREFILL, ctx.num_tokens))

    dp = DraftPass.spans(
        [f"row{i}" for i in rows], rows, np.array(contexts, dtype=np.int64), np.array(lens, dtype=np.int64)
    )
    t = dp.num_tokens
    ids, features = inputs(spec.phase, t)
    metas = _load(capturer, dp, own, num_blocks)
    written = _written(capturer, metas, t)
    before = [w.read() for w in written]
    reference = _forward(capturer, spec.phase, metas, dp, ids, features)[:t].clone()
    kv_reference = [w.read() for w in written]

    n = spec.num_tokens
    _restore(written, before)
    statics.load(spec, dp, own, ids, features)
    graph.replay_fn()
    replayed = graph.output[:n].clone()
    kv_replayed = [w.read() for w in written]

    _restore(written, before)
    statics.load(spec, dp, own, ids, features)
    eager_padded = capturer.eager(spec, graph.metas)[:n]

    diff = max_abs(replayed, eager_padded)
    real_diff = max(
        [max_abs(replayed[:t], reference)]
        + [max_abs(a, b) for a, b in zip(kv_replayed, kv_reference, strict=True)]
    )
    greedy_ref = drafter.greedy_drafts(spec.phase, reference)
    greedy_graph = drafter.greedy_drafts(spec.phase, replayed[:t])
    greedy = greedy_ref is None or bool(torch.equal(greedy_ref, greedy_graph))
    real_tol = tol.real_rows_limit([reference, *kv_reference])
    unwritten = sorted({w.group for w in written if w.is_state and w.index.numel() == 0})
    ok = diff <= tol.replay_vs_eager and real_diff <= real_tol and greedy and not unwritten
    reason = f"real rows wrote no state in {', '.join(unwritten)}" if unwritten else ""
    return GraphCheck(spec.label, t, dp.num_reqs, diff, real_diff, greedy, ok, reason)


def _load(
    capturer: GraphCapturer, dp: DraftPass, tables: dict[str, torch.Tensor], num_blocks: int
) -> dict[str, AttentionMetadata]:
    """Load ``dp`` unpadded into the drafter's static buffers (block tables trimmed to
    ``num_blocks`` columns); its metadata, Mamba groups' with their state reads and writes."""
    b = capturer.drafts.buffers
    b.load_layout(
        query_start_loc=dp.query_start_loc, positions=dp.positions, seq_lens=dp.seq_lens, block_tables=tables
    )
    metas = b.attn_metadata(num_columns=num_blocks)
    runner = capturer.runner
    # The state columns the pass itself would plan (rows matched to the persistent batch), made
    # here so the blocks the reference writes are known before it runs.
    return runner.drafter.state_metadata(runner, metas)


def _forward(
    capturer: GraphCapturer,
    phase: str,
    metas: dict[str, AttentionMetadata],
    dp: DraftPass,
    input_ids: torch.Tensor,
    features: torch.Tensor | None,
) -> torch.Tensor:
    """An eager drafter pass over the loaded static buffers with ``metas``."""
    runner = capturer.runner
    positions = capturer.drafts.buffers.positions[: dp.num_tokens]
    return runner.drafter.forward_pass(runner, phase, metas, input_ids, positions, features)


@dataclass(frozen=True, slots=True)
class _Written:
    """Where a pass writes one layer: entries ``index`` along ``dim`` of ``view``, a view of the
    layer's cache tensor (so restoring them writes the cache)."""

    group: str
    is_state: bool
    view: torch.Tensor
    dim: int
    index: torch.Tensor

    def read(self) -> torch.Tensor:
        return self.view.index_select(self.dim, self.index)

    def write(self, values: torch.Tensor) -> None:
        self.view.index_copy_(self.dim, self.index, values)


def _written(capturer: GraphCapturer, metas: dict[str, AttentionMetadata], t: int) -> list[_Written]:
    """What the first ``t`` (real) tokens of a pass over ``metas`` write, per drafter layer."""
    runner = capturer.runner
    out = []
    for group in runner.drafter.graph_groups():
        meta = metas[group.name]
        for layer in group.layer_names:
            cache = runner.kv_caches.tensors[layer]
            out.append(_layer_written(group, meta, cache, t))
    return out


def _layer_written(group: KVCacheGroup, meta: AttentionMetadata, cache: torch.Tensor, t: int) -> _Written:
    if isinstance(group.spec, MambaSpec):
        # ``[num_blocks + 1, state]``: one state per block; the last row is the PAD sink.
        if not isinstance(meta, MambaMetadata) or meta.write_blocks is None:
            raise TypeError(
                f"drafter group {group.name} keeps Mamba state but its pass metadata names no state "
                "blocks: the drafter's state_metadata must plan them"
            )
        blocks = meta.write_blocks[:t].to(torch.int64)
        sink = cache.shape[0] - 1
        blocks = torch.unique(blocks[(blocks >= 0) & (blocks != sink)])
        return _Written(group.name, True, cache, 0, blocks)
    slots = meta.slot_mapping[:t].to(torch.int64).clone()
    if KV_LAYOUTS[group.spec.kind].block_dim == 1:
        # Attention ``[2, num_blocks + 1, block_size, ...]``: K and V of slot s at [:, s].
        return _Written(group.name, False, cache.flatten(1, 2), 1, slots)
    # Latent ``[num_blocks + 1, block_size, D]``: slot s's vector at row s.
    return _Written(group.name, False, cache.flatten(0, 1), 0, slots)


def _restore(written: list[_Written], values: list[torch.Tensor]) -> None:
    for w, v in zip(written, values, strict=True):
        w.write(v)
