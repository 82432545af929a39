"""One step's records, admitted and allocated by one set of rules.

The scheduler (``core/scheduler.py``) and the warmup planner (``warmup/planner.py``) both put
every request into a :class:`SchedulerOutput` through :class:`StepBuilder`, so a warmup step is
exactly a step the scheduler would build for the same requests. The builder owns, per request:

- **admission**: whether another request may join (the sequence limit and a token left in the
  step's budget), and how many tokens it computes: what it still has to compute plus its drafts,
  cut to the step's budget and to the length cap. NOTE: the cap keeps computed + scheduled at most
  ``max_model_len - 1``, so even the bonus token of a fully accepted verify step leaves the
  request at most ``max_model_len`` long. Without chunked prefill a prompt that does not fit the
  budget waits for a step with room.
- **the prompt allowance**: while any request decodes, the prompt tokens of a step (new prompts,
  their chunks, recomputed ones) are capped at ``max_prefill_tokens_with_decodes``
  (:meth:`StepBuilder.prompt_allowance`), so a burst of prompts cannot hold the decodes beside it
  for a whole budget's forward; a step with nothing decoding keeps the whole budget.
- **allocation**: the request's blocks grown by the one rule with the step's lookahead
  (``KVCacheManager``, ``core/reservation.py``).
- **the records**: ``NewRequestData`` / ``CachedRequestData``, scheduled tokens, lookahead and the
  drafts to verify; and the request's computed count moved past the scheduled tokens.

Which requests run, in what order, and what happens when the pool is short (preemption, or a
warmup layout that does not fit) stay with the caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from warmcap.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from warmcap.core.step_rules import step_lookahead

if TYPE_CHECKING:
    from collections.abc import Iterable

    from warmcap.config import EngineConfig
    from warmcap.core.kv_cache_manager import KVCacheManager
    from warmcap.core.request import Request


class StepBuilder:
    """Admits requests into one step's :class:`SchedulerOutput` and allocates their blocks.

    ``reserved_lookahead`` replaces the lookahead reserved per request (never the one declared to
    the runner); it is the warmup planner's seam for the broken plans its audit must catch, and
    equals the config's lookahead everywhere else.
    """

    __slots__ = (
        "_allocate_running",
        "chunked_prefill",
        "kv",
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_prefill_tokens_with_decodes",
        "num_lookahead_tokens",
        "reserved_lookahead",
    )

    def __init__(
        self, config: EngineConfig, kv: KVCacheManager, *, reserved_lookahead: int | None = None
    ) -> None:
        self.kv = kv
        self._allocate_running = kv.allocate_running
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.chunked_prefill = config.scheduler.enable_chunked_prefill
        cap = config.scheduler.max_prefill_tokens_with_decodes
        #: None when the cap never binds (unset, or not below the budget)
        self.max_prefill_tokens_with_decodes = (
            cap if cap is not None and cap < self.max_num_batched_tokens else None
        )
        #: what every locally computed request's drafter may write past its tokens (step_rules.py)
        self.num_lookahead_tokens = step_lookahead(config)
        self.reserved_lookahead = (
            self.num_lookahead_tokens if reserved_lookahead is None else reserved_lookahead
        )

    def has_seat(self, num_running: int, budget: int) -> bool:
        """Whether a request may join ``num_running`` others with ``budget`` tokens left."""
        return budget > 0 and num_running < self.max_num_seqs

    def prompt_allowance(self, scheduled: Iterable[Request]) -> int:
        """Prompt tokens a step may compute beside the already running requests ``scheduled``:
        ``max_prefill_tokens_with_decodes`` when one of them decodes (every known token but the
        last computed), else the whole budget."""
        cap = self.max_prefill_tokens_with_decodes
        if cap is not None:
            for req in scheduled:
                if req.in_decode:
                    return cap
        return self.max_num_batched_tokens

    def room(self, request: Request) -> int:
        """Tokens the request may still schedule before the length cap."""
        return self.max_model_len - 1 - request.num_computed_tokens

    def add_running(self, out: SchedulerOutput, req: Request, budget: int) -> int | None:
        """Schedule a running request's uncomputed tokens and its drafts (``spec_token_ids``), cut
        to ``budget`` and the length cap. Returns the tokens scheduled, or None when the pool is
        short, in which case nothing changed."""
        # NOTE: this runs for every running request every step; it avoids min(), properties and
        # keyword calls, which cost more than the arithmetic they wrap.
        computed = req.num_computed_tokens
        # Placeholders: the outputs a step still in flight adds (async scheduling; 0 otherwise).
        num_real = (
            len(req.prompt_token_ids) + len(req.output_token_ids) + req.num_output_placeholders - computed
        )
        drafts = req.spec_token_ids
        num_new = num_real + len(drafts)
        if num_new > budget:
            num_new = budget
        room = self.max_model_len - 1 - computed
        if num_new > room:
            num_new = room
        new_ids = self._allocate_running(req, num_new, self.reserved_lookahead)
        if new_ids is None:
            return None
        req_id = req.request_id
        out.scheduled_cached_reqs.append(CachedRequestData(req_id, new_ids, computed))
        out.num_scheduled_tokens[req_id] = num_new
        out.num_lookahead_tokens[req_id] = self.num_lookahead_tokens
        if num_new > num_real and drafts:
            # NOTE: drafts are handed over without a copy when all are scheduled: the scheduler
            # only ever replaces ``spec_token_ids``, never changes the list in place.
            num_drafts = num_new - num_real
            out.scheduled_spec_decode_tokens[req_id] = (
                drafts if num_drafts == len(drafts) else drafts[:num_drafts]
            )
        req.num_computed_tokens = computed + num_new
        return num_new

    def add_waiting(
        self,
        out: SchedulerOutput,
        req: Request,
        budget: int,
        *,
        num_hit: int = 0,
        hit_ids: dict[str, list[int]] | None = None,
    ) -> int:
        """Start (or resume) a request after its ``num_hit`` prefix-cache tokens (blocks
        ``hit_ids``), cut to ``budget`` and the length cap. Returns the tokens scheduled, or 0 when
        it cannot start this step (its prompt waits for a step with room, or the pool is short),
        in which case nothing changed."""
        start = req.num_computed_tokens + num_hit
        num_new = req.num_tokens - start
        if num_new > budget:
            # NOTE: without chunking a prompt waits for a step with room; a resumed request longer
            # than the whole budget is still recomputed in chunks, or it could never run again.
            if not self.chunked_prefill and num_new <= self.max_num_batched_tokens:
                return 0
            num_new = budget
        room = self.max_model_len - 1 - start
        if num_new > room:
            num_new = room
        if num_new <= 0:
            return 0
        kv = self.kv
        new_ids = kv.allocate_slots(
            req,
            num_new,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hit_ids,
            num_lookahead_tokens=self.reserved_lookahead,
            num_encoder_tokens=req.num_encoder_tokens,
        )
        if new_ids is None:
            return 0
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        req_id = req.request_id
        out.scheduled_new_reqs.append(
            NewRequestData(
                req_id=req_id,
                prompt_token_ids=req.prompt_token_ids,
                sampling_params=req.sampling_params,
                block_ids=kv.get_block_ids(req_id),
                num_computed_tokens=start,
                output_token_ids=list(req.output_token_ids),
            )
        )
        out.num_scheduled_tokens[req_id] = num_new
        out.num_lookahead_tokens[req_id] = self.num_lookahead_tokens
        req.num_computed_tokens = start + num_new
        return num_new
