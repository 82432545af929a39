"""Per-step rules for one request, shared by the scheduler (``core/scheduler.py``) and the warmup
planner's simulator (``warmup/planner.py``), so a plan holds exactly what serving would hold.

- **Lookahead**: the KV slots reserved past a request's scheduled tokens for the drafter's writes.
  Without speculation, and on a P/D producer, there is none (``EngineConfig.num_lookahead_tokens``
  is 0): a producer's drafter, if it has one, writes its prompt KV only and proposes nothing. A request whose KV is loaded from outside runs no forward in the step its load starts
  (``core/scheduler.py`` parks it until the load is done), so that step reserves none. Every locally computed request — a consumer's own warmup requests included — reserves the
  config's full lookahead, because its drafter runs and writes past the scheduled tokens.
- **Draft rollback**: after verification a request keeps its accepted drafts and drops the rejected
  ones from its computed count; it keeps every block it holds (the next step writes over the
  rejected slots, and a block freed here would have to be reserved again next step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from warmcap.config import EngineConfig


def step_lookahead(config: EngineConfig, *, num_external_tokens: int = 0) -> int:
    """Lookahead slots a request reserves in a step.

    ``num_external_tokens``: tokens of this request whose KV is loaded from outside (a P/D
    consumer's remote prefill) in this step; 0 for every locally computed request.
    """
    if num_external_tokens > 0:
        return 0
    return config.num_lookahead_tokens


def computed_after_verify(num_computed_tokens: int, num_draft_tokens: int, num_accepted_tokens: int) -> int:
    """A request's computed-token count once a verify step's results are in.

    ``num_computed_tokens`` already counts the scheduled drafts; the rejected ones
    (``num_draft_tokens - num_accepted_tokens``) are rolled back. The request keeps its blocks.
    """
    if not 0 <= num_accepted_tokens <= num_draft_tokens:
        raise ValueError(
            f"{num_accepted_tokens} accepted of {num_draft_tokens} drafts: accepted must be in 0..drafts"
        )
    return num_computed_tokens - (num_draft_tokens - num_accepted_tokens)
