"""Speculative-decoding drafters, one class per method of ``spec_methods.METHODS`` (registered in
``drafters/registry.py``): ngram, draft_model, eagle, eagle3, mtp, dflash.

Each drafter says which KV groups it writes (``kv_groups``) and how far past the scheduled tokens
(``lookahead``, equal to ``EngineConfig.num_lookahead_tokens``), and proposes greedy drafts after
every target step through the runner's ``drafter`` hook.
"""

from __future__ import annotations

from warmcap.drafters.base import DRAFT_GROUP_PREFIX, BaseDrafter, DraftGraphShape
from warmcap.drafters.factory import build_drafter

__all__ = ["DRAFT_GROUP_PREFIX", "BaseDrafter", "DraftGraphShape", "build_drafter"]
