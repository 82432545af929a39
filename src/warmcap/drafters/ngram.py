"""Prompt-lookup (n-gram) drafting: propose what followed the last earlier occurrence of the suffix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from warmcap.drafters.base import BaseDrafter
from warmcap.drafters.paged import num_drafts_allowed
from warmcap.drafters.registry import register

if TYPE_CHECKING:
    from warmcap.config import EngineConfig
    from warmcap.drafters.paged import DraftContext


def ngram_propose(token_ids: Sequence[int] | np.ndarray, *, min_n: int, max_n: int, k: int) -> list[int]:
    """Draft up to ``k`` tokens for a request whose tokens so far are ``token_ids``.

    For n from ``max_n`` down to ``min_n``: find the latest start ``j < len - n`` where
    ``tokens[j : j + n]`` equals the last n tokens, and propose ``tokens[j + n : j + n + k]``
    (shorter when the history ends first). The first n that matches wins; no match drafts nothing.
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length - n - 1: every occurrence other than the suffix itself.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


@register
class NgramDrafter(BaseDrafter):
    """Prompt lookup over each request's own tokens; no model, no KV, no lookahead."""

    method = "ngram"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        spec = config.speculative
        assert spec is not None  # checked by BaseDrafter.__init__
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max

    def propose(self, ctx: DraftContext) -> dict[str, list[int]]:
        view = ctx.view
        budget = num_drafts_allowed(view, self.num_speculative_tokens, ctx.max_model_len)
        drafts: dict[str, list[int]] = {}
        for req_id, row, k in zip(view.req_ids, view.rows.tolist(), budget.tolist(), strict=True):
            if k <= 0:
                continue
            tokens = ctx.token_ids[row, : ctx.num_tokens[row]]
            proposal = ngram_propose(tokens, min_n=self.min_n, max_n=self.max_n, k=k)
            if proposal:
                drafts[req_id] = proposal
        return drafts
