"""Drafter passes over the drafter's own KV groups: how many drafts a request may have and the
forward context a pass runs in.

A drafter never builds block ids or metadata itself: its executor (``DraftPasses``, bound once by
the runner) loads each pass into the drafter buffers from the persistent block tables (their rows
are the blocks the KV cache manager reserved for the request in each group, with the same lookahead
rule as the target groups), and records every slot mapping in the KV-write log (invariant I2
covers drafters too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from warmcap.contracts import ForwardContext
from warmcap.runner_v2.attention.context import StepContext
from warmcap.runner_v2.collaborators import DraftPass
from warmcap.runner_v2.draft_context import DraftContext, DraftKV, DraftPasses, DraftTokens, StepView

if TYPE_CHECKING:
    from warmcap.contracts import AttentionMetadata
    from warmcap.core.kv_spec import KVCacheGroup

__all__ = [
    "DraftContext",
    "DraftKV",
    "DraftPass",
    "DraftPasses",
    "DraftTokens",
    "StepView",
    "forward_context",
    "num_drafts_allowed",
]


def num_drafts_allowed(view: StepView, k: int, max_model_len: int) -> np.ndarray:
    """Draft count per request: ``k``, cut so no draft lands at or past ``max_model_len - 1``
    (the scheduler never schedules past it, and the drafter must not write past the cap of the
    reservation rule), and 0 for requests that sampled nothing."""
    room = max_model_len - 1 - view.next_position
    return np.where(view.sampled, np.clip(room, 0, k), 0)


def forward_context(
    kv: DraftKV,
    groups: Sequence[KVCacheGroup],
    metas: dict[str, AttentionMetadata],
    layer_names: dict[str, str],
) -> ForwardContext:
    """A forward context in which the drafter module's layer ``name`` uses the cache of
    ``layer_names[name]`` (the ``draft.``-prefixed layer of a drafter group) in ``kv``."""
    group_of = {layer: g.name for g in groups for layer in g.layer_names}
    return StepContext(
        attn_metadata=metas,
        layer_to_group={name: group_of[full] for name, full in layer_names.items()},
        kv_caches={name: kv.kv_caches[full] for name, full in layer_names.items()},
        backends=kv.backends,
        group_kinds={g.name: g.spec.kind for g in groups},
    )
