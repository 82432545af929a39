"""A drafter is a callee: it proposes from the context it is handed, with no runner anywhere."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import warmcap
from warmcap.config import EngineConfig, SpeculativeConfig
from warmcap.drafters.ngram import NgramDrafter
from warmcap.runner_v2.draft_context import DraftContext, StepView

DRAFTERS = Path(warmcap.__file__).parent / "drafters"


def _no_pass(*args: object, **kwargs: object) -> torch.Tensor:
    raise AssertionError("ngram runs no model pass")


def test_ngram_drafts_from_a_hand_built_context_alone() -> None:
    k = 3
    drafter = NgramDrafter(EngineConfig(speculative=SpeculativeConfig.parse(f"ngram:{k}")))
    # Two requests in persistent-batch rows 4 and 1; row 4 ends in a suffix seen before.
    token_ids = np.zeros((6, 32), dtype=np.int64)
    token_ids[4, :9] = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    token_ids[1, :4] = [1, 2, 3, 4]
    num_tokens = np.zeros(6, dtype=np.int32)
    num_tokens[4], num_tokens[1] = 9, 4
    view = StepView(
        req_ids=["a", "b"],
        rows=np.array([4, 1]),
        start=np.array([8, 3]),
        num_valid=np.array([0, 0]),
        sampled=np.array([True, True]),
        token_offset=np.array([0, 1]),
    )
    ctx = DraftContext(
        view=view,
        hidden_states=torch.zeros(2, 8),
        aux_hidden_states=[],
        token_ids=token_ids,
        num_tokens=num_tokens,
        device=torch.device("cpu"),
        max_model_len=32,
        run_pass=_no_pass,
    )
    assert drafter.propose(ctx) == {"a": [8, 9, 1]}
    # The length cap reaches the drafter through the context: one slot before max_model_len - 1.
    capped = DraftContext(**{**{f: getattr(ctx, f) for f in ctx.__slots__}, "max_model_len": 10})
    assert drafter.propose(capped) == {"a": [8]}


def test_no_drafter_module_names_the_runner() -> None:
    named = [
        str(p.relative_to(DRAFTERS))
        for p in sorted(DRAFTERS.rglob("*.py"))
        if "ModelRunner" in p.read_text() or "runner_v2.model_runner" in p.read_text()
    ]
    assert named == []
