"""Prompt-lookup (n-gram) drafting: propose what followed the last earlier occurrence of the suffix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from warmcap.drafters.base import BaseDrafter
from warmcap.drafters.paged import DraftTokens, num_drafts_allowed
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

    def propose(self, ctx: DraftContext) -> DraftTokens:
        view = ctx.view
        k = self.num_speculative_tokens
        budget = num_drafts_allowed(view, k, ctx.max_model_len)
        # Looked up on the host (the tokens live there); the drafts go to the device in one copy.
        tokens = np.full((len(view.req_ids), k), -1, dtype=np.int64)
        num = np.zeros(len(view.req_ids), dtype=np.int64)
        for i, (row, n) in enumerate(zip(view.rows.tolist(), budget.tolist(), strict=True)):
            if n <= 0:
                continue
            history = ctx.token_ids[row, : ctx.num_tokens[row]]
            proposal = ngram_propose(history, min_n=self.min_n, max_n=self.max_n, k=n)
            num[i] = len(proposal)
            tokens[i, : len(proposal)] = proposal
        if not num.any():
            return DraftTokens.none(ctx.device)
        return DraftTokens.from_rows(
            view.req_ids,
            num,
            torch.from_numpy(tokens).to(ctx.device),
            view.next_position + 1,
            host_token_ids=tokens,
        )
