"""Continuous-batching scheduler with chunked prefill, prefix caching, speculative decoding and
recompute preemption.

A P/D consumer's request whose leading prompt tokens' KV is loaded from outside
(``num_external_computed_tokens``) first gets blocks for them and waits, with no forward, in
``WAITING_FOR_REMOTE_KVS`` until the runner reports the load done; then it is scheduled like any
request from its loaded tokens, with the normal lookahead (``core/step_rules.py``).

Each step: running requests first (decodes, verify steps and unfinished prompts, oldest first),
then waiting requests in arrival order while the token budget, the sequence limit and the pool
allow. While any running request decodes, the step's prompt tokens (chunks of running prompts and
waiting requests alike) stay within ``SchedulerConfig.max_prefill_tokens_with_decodes``, so the
decodes never wait a whole budget's prefill for their next token. Each is admitted, allocated and
recorded by ``core/step_builder.py``, which the warmup planner builds its steps with too; the
scheduler picks the requests and preempts. ``num_computed_tokens`` advances when a step is
scheduled and rolls back by the rejected draft count when its results come in.

With async scheduling (``SchedulerConfig.async_scheduling``) the next step is scheduled before
the results of the one in flight are in. A request that samples in a step holds
``num_output_placeholders`` (1 + the drafts verified) until those results come in: the next step
schedules its next token after them, and drafts as ``k`` placeholders that the runner fills with
the drafter's real proposals (fewer when it proposed fewer). ``num_computed_tokens`` is then
optimistic (every draft accepted) and rolls back as results come in, exactly as in the synchronous
schedule; blocks are reserved for the optimistic count, a superset of what the step writes. A
request whose placeholders reach ``max_tokens`` or the context limit waits for its results instead
of running a step it could not use; a stop token or stop string costs at most one discarded token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from warmcap.core.outputs import KVLoad, ModelRunnerOutput, SchedulerOutput
from warmcap.core.request import Request, RequestStatus
from warmcap.core.scheduler_stats import RequestStepOutput, SchedulerStats, SpecDecodeCounters
from warmcap.core.step_builder import StepBuilder
from warmcap.core.step_rules import computed_after_verify, step_lookahead
from warmcap.errors import CapacityError, ConfigError

if TYPE_CHECKING:
    from warmcap.config import EngineConfig
    from warmcap.core.kv_cache_manager import KVCacheManager
    from warmcap.core.kv_connector import SchedulerConnector

_FINISH_REASON = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length"}


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes."""

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        *,
        eos_token_id: int | None = None,
        connector: SchedulerConnector | None = None,
    ) -> None:
        self.config = config
        #: the KV connector's scheduler side (P/D); None: loads only from ``num_external_computed_tokens``
        self.connector = connector
        self.kv = kv_cache_manager
        self.eos_token_id = eos_token_id
        self.max_model_len = config.max_model_len
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.chunked_prefill = config.scheduler.enable_chunked_prefill
        self.num_spec_tokens = config.num_speculative_tokens
        #: admission, allocation with lookahead and the step's records, shared with warmup planning
        self.builder = StepBuilder(config, kv_cache_manager)
        #: what every locally computed request reserves (core/step_rules.py)
        self.num_lookahead_tokens = self.builder.num_lookahead_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: requests holding blocks while their KV is loaded from outside, by id (no forward yet)
        self.loading: dict[str, Request] = {}
        #: finished requests whose blocks a producer keeps until its peer has read them, by id
        self.sending: dict[str, Request] = {}
        self.num_preemptions = 0
        self.spec_counters = SpecDecodeCounters()
        self._finished_ids: set[str] = set()
        #: one step in flight (see the module docstring); the engine resolves the config's auto
        self.async_scheduling = bool(config.scheduler.async_scheduling)
        # The drafts an async step schedules for a decoding request: placeholders the runner fills.
        self._placeholder_drafts: list[int] = [-1] * self.num_spec_tokens

    # ---------------------------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a request; raises when it could never run under this configuration."""
        req_id = request.request_id
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already queued or running")
        n = request.num_prompt_tokens
        if n == 0:
            raise ConfigError(f"request {req_id!r} has an empty prompt: give at least one token")
        if n >= self.max_model_len:
            raise ConfigError(
                f"request {req_id!r}: a prompt of {n} tokens leaves no room for output within "
                f"max_model_len {self.max_model_len}; shorten the prompt or raise --max-model-len"
            )
        if not self.chunked_prefill and n > self.max_num_batched_tokens:
            raise ConfigError(
                f"request {req_id!r}: its {n}-token prompt exceeds max_num_batched_tokens "
                f"{self.max_num_batched_tokens} and chunked prefill is off; enable chunked prefill "
                "or raise --max-num-batched-tokens"
            )
        # The most tokens the request can have in flight at once: drafts may run k past its end.
        most = min(n + request.sampling_params.max_tokens + self.num_spec_tokens, self.max_model_len)
        need = self.kv.blocks_needed(
            most,
            num_lookahead_tokens=self.num_lookahead_tokens,
            num_encoder_tokens=request.num_encoder_tokens,
        )
        usable = self.kv.pool.num_blocks - 1
        if need > usable:
            raise CapacityError(
                f"request {req_id!r} may need {need} KV blocks ({most} tokens) but the pool has "
                f"{usable}; lower max_tokens or max_model_len, or give the KV cache more memory"
            )
        if request.eos_token_id is None and self.eos_token_id is not None:
            request.eos_token_id = self.eos_token_id
        request.status = RequestStatus.WAITING
        self.requests[req_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False when the id is unknown or finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            # NOTE: with a KV connector, a load in flight may still write these blocks; the
            # connector must stop it before they are handed out again.
            del self.loading[request_id]
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self.kv.free(request)
        self._finished_ids.add(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.loading),
            num_preemptions=self.num_preemptions,
            spec_decode=replace(self.spec_counters),
            kv_cache=self.kv.stats,
        )

    # -------------------------------------------------------------------------------- scheduling

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and tokens, allocating their blocks by the one rule."""
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.max_num_batched_tokens
        prompt_left = self.builder.prompt_allowance(self.running)
        budget, prompt_left = self._schedule_running(out, budget, prompt_left)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, min(budget, prompt_left))
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, prompt_left: int) -> tuple[int, int]:
        """Schedule the running requests in order within ``budget`` tokens, the prompt chunks among
        them within ``prompt_left`` too (the step's prompt allowance); returns what is left of both.
        A chunk that finds the allowance spent waits for the next step; its blocks stay."""
        add = self.builder.add_running
        running = self.running
        asynchronous = self.async_scheduling
        capped = prompt_left < budget
        index = 0
        while index < len(running) and budget > 0:
            req = running[index]
            if asynchronous and not self._async_ready(req):
                index += 1
                continue
            limit = budget
            # NOTE: ``not req.in_decode`` inline (this loop runs for every running request).
            prompt = capped and req.num_computed_tokens < req.num_tokens - 1
            if prompt:
                if prompt_left <= 0:
                    index += 1
                    continue
                limit = min(budget, prompt_left)
            num_new = add(out, req, limit)
            while num_new is None:
                victim = running.pop()
                self._preempt(victim, out)
                if victim is req:
                    return budget, prompt_left
                num_new = add(out, req, limit)
            budget -= num_new
            if prompt:
                prompt_left -= num_new
            index += 1
            if asynchronous:
                self._hold_placeholders(req, out)
        return budget, prompt_left

    def _async_ready(self, req: Request) -> bool:
        """Whether a running request may run another step before its results in flight are in
        (async scheduling); drafts become placeholders here. False: those results may end it
        (``max_tokens``, the context limit) or leave no room, so it waits one step for them."""
        pending = req.num_output_placeholders
        if pending:
            if req.num_output_tokens + pending >= req.sampling_params.max_tokens:
                return False
            if (
                req.num_tokens + pending >= self.max_model_len
                or req.num_computed_tokens >= self.max_model_len - 1
            ):
                return False
        # A decoding request verifies drafts (a resumed one recomputing its tokens does not).
        if self.num_spec_tokens and (pending or (req.output_token_ids and req.in_decode)):
            req.spec_token_ids = self._placeholder_drafts
        return True

    def _hold_placeholders(self, req: Request, out: SchedulerOutput) -> None:
        """After an async step scheduled ``req``: when the step samples for it (its computed count
        reaches its known tokens), hold the outputs that step adds, 1 + its drafts."""
        if req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders:
            drafts = out.scheduled_spec_decode_tokens.get(req.request_id)
            req.num_output_placeholders += 1 + (len(drafts) if drafts else 0)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv
        builder = self.builder
        while self.waiting and builder.has_seat(len(self.running), budget):
            req = self.waiting[0]
            if req.num_computed_tokens:
                # NOTE: only a request whose external load has arrived waits with computed tokens
                # (a preempted one is reset to 0); it already holds its blocks.
                hit_ids, num_hit = {}, 0
            else:
                hit_ids, num_hit = kv.get_computed_blocks(req)
            external = 0
            fresh = req.num_preemptions == 0 and not req.num_computed_tokens
            if fresh and self.connector is not None:
                matched = self.connector.get_num_new_matched_tokens(req, num_hit)
                # The last prompt token is always computed here: its logits give the first token.
                external = max(0, min(matched, req.num_tokens - 1 - num_hit))
                req.num_external_computed_tokens = num_hit + external
            elif fresh and req.num_external_computed_tokens:
                # Remote KV covers the prompt from position 0; after a preemption it is gone.
                external = max(0, min(req.num_external_computed_tokens, req.num_tokens - 1) - num_hit)
            if external:
                if not self._start_load(req, out, hit_ids, num_hit, external):
                    return
                continue
            num_new = builder.add_waiting(out, req, budget, num_hit=num_hit, hit_ids=hit_ids)
            if not num_new:
                return
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            budget -= num_new
            if self.async_scheduling:
                self._hold_placeholders(req, out)

    def _start_load(
        self, req: Request, out: SchedulerOutput, hit_ids: dict[str, list[int]], num_hit: int, external: int
    ) -> bool:
        """Give ``req`` blocks for its prefix hits and its ``external`` loaded tokens and park it
        until the load is done; False (nothing changed) when the pool is short."""
        # No forward runs for the request this step, so it drafts nothing and reserves no lookahead.
        new_ids = self.kv.allocate_slots(
            req,
            0,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hit_ids,
            num_lookahead_tokens=step_lookahead(self.config, num_external_tokens=external),
            num_external_computed_tokens=external,
            num_encoder_tokens=req.num_encoder_tokens,
            delay_cache_blocks=True,
        )
        if new_ids is None:
            return False
        self.waiting.popleft()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        self.loading[req.request_id] = req
        block_ids = self.kv.get_block_ids(req.request_id)
        out.kv_loads[req.request_id] = KVLoad(block_ids, num_hit, external)
        if self.connector is not None:
            self.connector.update_state_after_alloc(req, block_ids, external)
        return True

    def _finish_loads(self, req_ids: set[str]) -> None:
        """Requests whose external KV has arrived wait again, at the front: they already hold
        their blocks, and their next step computes the tokens after the loaded ones."""
        for req_id in req_ids:
            req = self.loading.pop(req_id, None)
            if req is None:
                continue  # aborted while it loaded
            load_end = min(req.num_external_computed_tokens, req.num_tokens - 1)
            req.num_computed_tokens = max(load_end, req.num_cached_tokens)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        """Free a finished request's blocks, unless the connector keeps them for a peer to read
        (then they are freed when the runner reports the read in ``finished_sending``)."""
        if self.connector is not None:
            keep, req.kv_transfer_params = self.connector.request_finished(
                req, self.kv.get_block_ids(req.request_id)
            )
            if keep:
                self.sending[req.request_id] = req
                return
        self.kv.free(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        # The step in flight's outputs for it are discarded (its status is no longer running).
        req.num_output_placeholders = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_req_ids.add(req.request_id)

    # ----------------------------------------------------------------------------------- results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[RequestStepOutput]:
        """Apply a step's sampled tokens and drafts; returns what each request gained."""
        if model_runner_output.finished_recving:
            self._finish_loads(model_runner_output.finished_recving)
        for req_id in model_runner_output.finished_sending:
            sent = self.sending.pop(req_id, None)
            if sent is not None:
                self.kv.free(sent)
        results: list[RequestStepOutput] = []
        spec = scheduler_output.scheduled_spec_decode_tokens
        drafts_out = model_runner_output.draft_token_ids
        # Async: the drafts the runner verified (the scheduled ones are placeholders).
        verified = model_runner_output.num_draft_tokens if self.async_scheduling else None
        k = self.num_spec_tokens
        running = RequestStatus.RUNNING
        finished: list[Request] = []
        for req_id, sampled in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True
        ):
            req = self.requests.get(req_id)
            if req is None or req.status is not running:
                continue  # aborted while the step ran
            scheduled_drafts = spec.get(req_id)
            num_drafts = len(scheduled_drafts) if scheduled_drafts else 0
            if len(sampled) > num_drafts + 1:
                raise ValueError(
                    f"runner returned {len(sampled)} tokens for {req_id!r} with {num_drafts} drafts; "
                    "at most drafts + 1 can be accepted"
                )
            num_accepted = len(sampled) - 1 if sampled else 0
            num_verified = num_drafts if verified is None else verified.get(req_id, 0)
            if num_drafts:
                # Async: every placeholder draft the runner had no proposal for counts as rejected.
                req.num_computed_tokens = computed_after_verify(
                    req.num_computed_tokens, num_drafts, num_accepted
                )
                if num_verified:
                    self.spec_counters.record(num_verified, num_accepted)
            if not sampled:
                if req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders:
                    raise ValueError(f"runner sampled no token for {req_id!r} after its prompt ended")
                continue
            if verified is not None:
                req.num_output_placeholders -= 1 + num_drafts
            new_tokens = self._append_and_check_stop(req, sampled)
            status = req.status
            if status is not running:
                finished.append(req)
            elif verified is None:
                next_drafts = drafts_out.get(req_id)
                req.spec_token_ids = list(next_drafts[:k]) if next_drafts and k else []
            results.append(
                RequestStepOutput(
                    req_id=req_id,
                    new_token_ids=new_tokens,
                    finished=status is not running,
                    finish_reason=_FINISH_REASON.get(status),
                    num_draft_tokens=num_verified,
                    num_accepted_tokens=num_accepted,
                )
            )
        if finished:
            done = set(finished)
            self.running = [r for r in self.running if r not in done]
            for req in finished:
                self._release(req)
                del self.requests[req.request_id]
                self._finished_ids.add(req.request_id)
        return results

    def _append_and_check_stop(self, req: Request, sampled: list[int]) -> list[int]:
        params = req.sampling_params
        eos = None if params.ignore_eos else req.eos_token_id
        stop_ids = params.stop_token_ids
        room = min(params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        kept: list[int] = []
        for token in sampled:
            if len(kept) == room:
                break
            kept.append(token)
            if token == eos or token in stop_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                break
        req.output_token_ids.extend(kept)
        if req.status is RequestStatus.RUNNING and (
            req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len
        ):
            req.status = RequestStatus.FINISHED_LENGTH
        return kept
