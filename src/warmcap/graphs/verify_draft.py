"""Invariant I4 for drafter graphs: replay equals the eager drafter pass.

For each drafter graph a real pass smaller than the graph (one request fewer for ``draft_decode``,
one token fewer for ``draft_prefill``) is laid out on scratch blocks; the rows' drafter contexts are
written first by eager ``draft_prefill`` passes over their earlier positions. Then

1. the unpadded pass runs eagerly (the reference for real rows),
2. it is padded into the drafter's static buffers and the graph replays,
3. the same padded inputs run eagerly over the graph's metadata.

Replay vs 3 must agree everywhere (bit-equal on CPU); replay vs 1 on the real rows' outputs *and*
on the drafter KV written at the real rows' slots within a tight (scale-relative) tolerance, with the same greedy
draft tokens (a ``draft_prefill`` that only writes context, DFlash's, has none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from warmcap.drafters.base import DRAFT_PREFILL
from warmcap.drafters.paged import DraftPass
from warmcap.graphs.verify import (
    GraphCheck,
    PoolTooSmallError,
    context_chunks,
    layout_for,
    magnitude,
    max_abs,
    scratch_tables,
)

if TYPE_CHECKING:
    from warmcap.core.kv_cache_manager import KVCacheManager
    from warmcap.graphs.capture import CapturedGraph, GraphCapturer
    from warmcap.graphs.static_inputs import DraftStatics
    from warmcap.graphs.verify import Tolerance


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
    lens, contexts = layout.query_lens, layout.contexts
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
    groups = list(statics.buffers.block_tables)
    own = {g: tables[g] for g in groups}
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
        _eager(capturer, DRAFT_PREFILL, ctx, sub, *inputs(DRAFT_PREFILL, ctx.num_tokens), num_blocks)

    dp = DraftPass.spans(
        [f"row{i}" for i in rows], rows, np.array(contexts, dtype=np.int64), np.array(lens, dtype=np.int64)
    )
    t = dp.num_tokens
    ids, features = inputs(spec.phase, t)
    reference = _eager(capturer, spec.phase, dp, own, ids, features, num_blocks)[:t].clone()
    real_slots = {g: statics.buffers.slot_mappings[g][:t].clone() for g in groups}
    kv_reference = _kv_at(capturer, real_slots)

    n = spec.num_tokens
    statics.load(spec, dp, own, ids, features)
    graph.replay_fn()
    replayed = graph.output[:n].clone()
    kv_replayed = _kv_at(capturer, real_slots)

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
    real_tol = tol.real_rows * magnitude([reference, *kv_reference])
    ok = diff <= tol.replay_vs_eager and real_diff <= real_tol and greedy
    return GraphCheck(spec.label, t, dp.num_reqs, diff, real_diff, greedy, ok)


def _eager(
    capturer: GraphCapturer,
    phase: str,
    dp: DraftPass,
    tables: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    features: torch.Tensor | None,
    num_blocks: int,
) -> torch.Tensor:
    """An unpadded eager drafter pass over the drafter's static buffers (trimmed block tables)."""
    statics: DraftStatics = capturer.drafts
    b = statics.buffers
    b.load_layout(
        query_start_loc=dp.query_start_loc, positions=dp.positions, seq_lens=dp.seq_lens, block_tables=tables
    )
    metas = b.attn_metadata(num_columns=num_blocks)
    runner = capturer.runner
    return runner.drafter.forward_pass(
        runner, phase, metas, input_ids, b.positions[: dp.num_tokens], features
    )


def _kv_at(capturer: GraphCapturer, slots: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the drafter KV at ``slots`` in every layer of each group (K and V together)."""
    runner = capturer.runner
    out = []
    for group in runner.drafter.graph_groups():
        for layer in group.layer_names:
            cache = runner.kv_caches.tensors[layer]
            out.append(cache.flatten(1, 2)[:, slots[group.name]].clone())
    return out
