"""Invariant I4 for drafter graphs: replay equals the eager drafter pass.

A real pass smaller than the graph (one request fewer for ``draft_decode``, one token fewer for
``draft_prefill``) is laid out on scratch blocks; the rows' drafter contexts are written first by
eager ``draft_prefill`` passes over their earlier positions. The passes and what they are held to
are the target graphs' (:mod:`warmcap.graphs.proof.verify`): outputs, what the real rows wrote into the
drafter's cache, and greedy draft tokens (a ``draft_prefill`` that only writes context, DFlash's,
has none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from warmcap.graphs.capture.static_inputs import DraftInputs
from warmcap.graphs.proof.verify_batch import Passes, context_chunks
from warmcap.runner_v2.collaborators import DRAFT_PREFILL, DraftPass

if TYPE_CHECKING:
    from warmcap.contracts import AttentionMetadata
    from warmcap.graphs.capture.capturer import CapturedGraph
    from warmcap.graphs.capture.subjects import DrafterSubject
    from warmcap.graphs.proof.verify_batch import Layout


def draft_passes(
    subject: DrafterSubject,
    graph: CapturedGraph,
    layout: Layout,
    tables: dict[str, torch.Tensor],
    num_blocks: int,
    rng: np.random.Generator,
    vocab: int,
) -> Passes:
    """The passes of one drafter graph's check over ``layout`` on scratch ``tables``."""
    model = subject.model
    statics = subject.statics
    spec = graph.spec
    own = {g: tables[g] for g in statics.group_names}
    device = subject.executor.device
    feature_spec = {p: model.feature_spec(p) for p in (DRAFT_PREFILL, spec.phase)}
    contexts, lens = layout.contexts, layout.query_lens

    def inputs(phase: str, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = torch.from_numpy(rng.integers(0, vocab, size=n)).to(device)
        fs = feature_spec[phase]
        if fs is None:
            return ids, None
        width, dtype = fs
        return ids, torch.from_numpy(rng.standard_normal((n, width))).to(device, dtype)

    for chunk in context_chunks(contexts, statics.buffers.max_num_tokens):
        # Drafter contexts of these rows, written by one eager draft prefill.
        idx = np.array(chunk, dtype=np.int64)
        lengths = np.array([contexts[i] for i in chunk], dtype=np.int64)
        ctx = DraftPass.spans([f"ctx{i}" for i in chunk], idx, np.zeros(len(chunk), dtype=np.int64), lengths)
        sub = {g: t[chunk] for g, t in own.items()}
        metas = _load(subject, ctx, sub, num_blocks)
        _forward(subject, DRAFT_PREFILL, metas, ctx, *inputs(DRAFT_PREFILL, ctx.num_tokens))

    rows = np.arange(len(lens), dtype=np.int64)
    dp = DraftPass.spans(
        [f"row{i}" for i in rows], rows, np.array(contexts, dtype=np.int64), np.array(lens, dtype=np.int64)
    )
    t, n = dp.num_tokens, spec.num_tokens
    ids, features = inputs(spec.phase, t)
    metas = _load(subject, dp, own, num_blocks)
    real = DraftInputs(dp, ids, features)

    def replay() -> list[torch.Tensor]:
        subject.load_tables(spec, real, own)
        graph.replay_fn()
        return [graph.output[:n]]

    def padded_eager() -> list[torch.Tensor]:
        subject.load_tables(spec, real, own)
        return [subject.forward(spec, graph.metas)[0][:n]]

    return Passes(
        dp.num_reqs,
        metas,
        reference=lambda: [_forward(subject, spec.phase, metas, dp, ids, features)[:t]],
        replay=replay,
        padded_eager=padded_eager,
        greedy=lambda output: model.greedy_drafts(spec.phase, output),
    )


def _load(
    subject: DrafterSubject, dp: DraftPass, tables: dict[str, torch.Tensor], num_blocks: int
) -> dict[str, AttentionMetadata]:
    """Load ``dp``'s layout unpadded into the drafter's static buffers (block tables trimmed to
    ``num_blocks`` columns); its metadata, Mamba groups' with their state reads and writes."""
    b = subject.buffers
    b.load_layout(
        query_start_loc=dp.query_start_loc, positions=dp.positions, seq_lens=dp.seq_lens, block_tables=tables
    )
    metas = b.attn_metadata(num_columns=num_blocks)
    # The state columns the pass itself would plan (rows matched to the persistent batch), made
    # here so the blocks the reference writes are known before it runs.
    return subject.model.state_metadata(subject.kv(), metas)


def _forward(
    subject: DrafterSubject,
    phase: str,
    metas: dict[str, AttentionMetadata],
    dp: DraftPass,
    input_ids: torch.Tensor,
    features: torch.Tensor | None,
) -> torch.Tensor:
    """An eager drafter pass over the loaded static buffers with ``metas`` (the given ids and
    features, the loaded positions)."""
    positions = subject.buffers.positions[: dp.num_tokens]
    kv = subject.kv()
    return subject.model.forward_pass(kv, phase, metas, input_ids, positions, features)
