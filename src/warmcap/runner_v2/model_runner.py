"""Model Runner V2: ``execute_model(SchedulerOutput) -> ModelRunnerOutput``.

One step = apply the deltas to the persistent batch -> build host inputs -> load the static
buffers (slot mappings computed on the device) -> forward -> logits only where a token is sampled
-> sample / verify drafts -> let the drafter propose. Warmup and serving both come through here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from warmcap.contracts.backends import AttentionBackend
from warmcap.contracts.metadata import AttentionMetadata
from warmcap.contracts.state_handler import StateHandler
from warmcap.core.kv_connector import WorkerConnector
from warmcap.core.kv_spec import KVCacheGroup
from warmcap.core.outputs import ModelRunnerOutput, SchedulerOutput
from warmcap.core.reservation import max_blocks_per_request
from warmcap.models.dtypes import TORCH_DTYPES
from warmcap.models.greedy_head import enabled as greedy_head_enabled
from warmcap.runner_v2.attention.context import StepContext
from warmcap.runner_v2.attention.selector import backend_registry
from warmcap.runner_v2.collaborators import Drafter, GraphDispatcher
from warmcap.runner_v2.draft_buffers import DraftBuffers
from warmcap.runner_v2.draft_context import DraftContext, DraftTokens, StepView
from warmcap.runner_v2.draft_executor import DraftExecutor
from warmcap.runner_v2.host_copy import HostCopy, PendingCopy, to_device
from warmcap.runner_v2.input_batch import InputBatch, StepInputs
from warmcap.runner_v2.kv_cache import KVCaches
from warmcap.runner_v2.kv_writes import KVWriteLog
from warmcap.runner_v2.mamba_state import MambaStates
from warmcap.runner_v2.prompt_logprobs import PromptLogprobsPart, prompt_logprobs_parts
from warmcap.runner_v2.rejection import Verified, greedy_verify_on_device, probabilistic_verify_on_device
from warmcap.runner_v2.sampler import Sampler, SamplingMetadata, row_argmax
from warmcap.runner_v2.step_buffers import StepBuffers
from warmcap.runner_v2.step_result import PendingTokens, StepResult, TokenFeed

if TYPE_CHECKING:
    from warmcap.config import EngineConfig
    from warmcap.models.greedy_head import GreedyHead

#: ``(req_ids, num_logits per request, logits [N, V])`` before sampling; for tests and debugging.
LogitsHook = Callable[[list[str], np.ndarray, torch.Tensor], None]


class ModelRunner:
    """Owns the persistent batch, block tables, KV caches and static step buffers of one model.

    Public state other components build on:
    - ``batch`` (:class:`InputBatch`), ``buffers`` (:class:`StepBuffers`), ``kv_caches`` (:class:`KVCaches`)
    - ``last_step`` (:class:`StepInputs`), ``last_hidden_states`` ``[T, H]`` and ``last_positions``
      ``[T]`` of the latest forward (for the engine and graph verification; the drafter is handed
      them in its :class:`DraftContext`)
    - ``drafter`` (a constructor argument): a callee, called after sampling with a
      :class:`DraftContext`; returns next-step proposals on the device (``draft_tokens``), verified
      as one-hot (greedy) drafts. Its passes run through ``draft_executor``
      (:class:`DraftExecutor`: the drafter buffers, drafter graphs and their KV-write logging),
      which the runner builds for a drafter with a model and binds to the drafter once.
    - ``draft_tokens``: the latest step's drafts (:class:`DraftTokens`, on the device), for the
      next step
    - ``graphs``: the graph dispatcher, set once by :meth:`attach_graphs`
    - ``kv_write_log``: every slot mapping of every pass (target and drafter, eager or replayed)
      while :meth:`recording_kv_writes` is on, for the audit
    - ``backends``: the backend of each KV kind (``attn_backend`` serves full and sliding layers);
      model layers get theirs through the forward context
    - ``state_handlers``: per-step state of some KV groups (Mamba), called at fixed points of a step
    - ``logits_hook``: sees the sampling logits of each step (a step with a hook always computes
      them in full)
    - ``greedy_head``: the screened argmax head (``models/greedy_head.py``); set it to None to
      compute the full logits on every step
    """

    def __init__(
        self,
        config: EngineConfig,
        model: Any,
        kv_groups: Sequence[KVCacheGroup],
        num_blocks: int,
        *,
        device: torch.device | str,
        attn_backend: AttentionBackend,
        drafter: Drafter | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.kv_groups = list(kv_groups)
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.attn_backend = attn_backend
        self.backends = backend_registry(attn_backend)
        self.dtype = TORCH_DTYPES[config.model.dtype]
        sched = config.scheduler
        k = config.num_speculative_tokens
        self.max_model_len = config.max_model_len
        self.max_num_reqs = sched.max_num_seqs
        self.max_num_tokens = max(sched.max_num_batched_tokens, sched.max_num_seqs * (1 + k))
        self.max_blocks_per_req = max_blocks_per_request(
            self.kv_groups,
            num_lookahead_tokens=config.num_lookahead_tokens,
            max_model_len=self.max_model_len,
        )
        names = [g.name for g in self.kv_groups]
        self.batch = InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            max_blocks_per_req=self.max_blocks_per_req,
            group_names=names,
            num_speculative_tokens=k,
        )
        self.buffers = StepBuffers(
            max_num_tokens=self.max_num_tokens,
            max_num_reqs=self.max_num_reqs,
            max_blocks_per_req=self.max_blocks_per_req,
            group_block_sizes={g.name: g.spec.block_size for g in self.kv_groups},
            device=self.device,
        )
        self.kv_caches = KVCaches(self.kv_groups, num_blocks, dtype=self.dtype, device=self.device)
        mamba = MambaStates.for_groups(self.kv_groups)
        self.state_handlers: list[StateHandler] = [] if mamba is None else [mamba]
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.model.seed)
        self.sampler = Sampler(generator)
        # The sampling metadata of the latest composition (rows, batch version), reused until it
        # changes (:meth:`sampling_metadata`).
        self._sampling_key: tuple[int, bytes] | None = None
        self._sampling_meta: SamplingMetadata | None = None
        self.graphs: GraphDispatcher | None = None
        #: the KV connector's worker side (P/D), set once by :meth:`attach_kv_connector`
        self.kv_connector: WorkerConnector | None = None
        self.kv_write_log = KVWriteLog()
        self.drafter = drafter
        self.draft_executor = self._draft_executor(drafter)
        self.draft_tokens: DraftTokens | None = None
        self.logits_hook: LogitsHook | None = None
        #: the exact screened argmax over the LM head, used by steps that need nothing but argmaxes
        #: (:meth:`_greedy_argmax`); None: every step computes the full logits
        self.greedy_head: GreedyHead | None = _build_greedy_head(model, config.kernel.exact_greedy_head)
        self.num_steps = 0
        #: one step in flight (``core/scheduler.py``): the schedule's computed counts are optimistic
        #: and its drafts placeholders; the runner takes both from its own state
        self.async_scheduling = bool(config.scheduler.async_scheduling)
        # The step whose tokens are still on their way to the host (async), read before the next.
        self._pending: list[StepResult] = []
        # The latest step's drafts on the host, per request (what the next async step verifies).
        self._proposals: dict[str, list[int]] = {}
        self.last_step: StepInputs | None = None
        self.last_hidden_states: torch.Tensor | None = None
        # Sampling logits [N, V] of the latest step (rows as in ``logits_hook``), for logprobs and
        # the engine's non-finite check.
        self.last_logits: torch.Tensor | None = None
        # Whether every row of ``last_logits`` is finite, fetched with the sampled tokens (the
        # engine's check reads it instead of reading the device again); None without logits.
        self.last_logits_finite: bool | None = None
        # Prompt logprobs the latest step computed, per request (``runner_v2/prompt_logprobs.py``).
        self.last_prompt_logprobs: dict[str, PromptLogprobsPart] = {}
        # The step's one device-to-host copy (tokens, accepted counts, the finite flag).
        self.host_copy = HostCopy(self.device)
        # Target layers whose input hidden states drafters read (EAGLE-3, DFlash); filled per forward.
        self.aux_hidden_state_layers: tuple[int, ...] = drafter.aux_layers if drafter is not None else ()
        self.last_aux_hidden_states: list[torch.Tensor] = []

    # ---- collaborators -----------------------------------------------------------------------------

    def _draft_executor(self, drafter: Drafter | None) -> DraftExecutor | None:
        """The executor of ``drafter``'s passes, bound to it; None without a drafter model."""
        if drafter is None or drafter.draft_model is None or not drafter.draft_model.graph_groups():
            return None
        executor = DraftExecutor(
            drafter.draft_model,
            batch=self.batch,
            kv_caches=self.kv_caches.tensors,
            backends=self.backends,
            kv_write_log=self.kv_write_log,
            # Drafter passes may cover a step's tokens plus one sampled token per request.
            max_num_tokens=self.max_num_tokens + self.max_num_reqs,
            max_num_reqs=self.max_num_reqs,
            max_blocks_per_req=self.max_blocks_per_req,
            device=self.device,
        )
        drafter.bind(executor)
        return executor

    def attach_graphs(self, graphs: GraphDispatcher | None) -> None:
        """Serve through ``graphs`` from now on (None: run every pass eagerly again)."""
        self.graphs = graphs
        if self.draft_executor is not None:
            self.draft_executor.graphs = graphs

    def attach_kv_connector(self, connector: WorkerConnector) -> None:
        """Load and save KV through ``connector`` from now on; it is given the KV tensors now."""
        connector.register_kv_caches(self.kv_caches.tensors)
        self.kv_connector = connector

    @contextmanager
    def recording_kv_writes(self, on: bool = True) -> Iterator[KVWriteLog]:
        """Record every pass's KV writes in ``kv_write_log`` while inside (``on=False``: don't);
        the previous setting is restored on exit."""
        before = self.kv_write_log.recording
        self.kv_write_log.recording = on
        try:
            yield self.kv_write_log
        finally:
            self.kv_write_log.recording = before

    @contextmanager
    def substituted(
        self, *, buffers: StepBuffers, kv_caches: KVCaches, draft_buffers: DraftBuffers | None
    ) -> Iterator[None]:
        """Run with other static buffers and KV caches (graph safety's fake tensors; the drafter's
        buffers in its executor); the real ones and the latest auxiliary hidden states are back on
        exit."""
        saved = (self.buffers, self.kv_caches, self.last_aux_hidden_states)
        self.buffers, self.kv_caches = buffers, kv_caches
        try:
            if self.draft_executor is None:
                yield
            else:
                with self.draft_executor.substituted(buffers=draft_buffers, kv_caches=kv_caches.tensors):
                    yield
        finally:
            self.buffers, self.kv_caches, self.last_aux_hidden_states = saved

    @property
    def mamba_states(self) -> MambaStates | None:
        """The state handler of the target's Mamba groups; None for a model without Mamba layers."""
        return next((h for h in self.state_handlers if isinstance(h, MambaStates)), None)

    # ---- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and return what each request produced."""
        return self._run(sched_out, defer=False).result()

    @torch.inference_mode()
    def execute_model_result(self, sched_out: SchedulerOutput) -> StepResult:
        """:meth:`execute_model` returning the whole :class:`StepResult` (output, logits, prompt
        logprobs), tokens read."""
        return self._run(sched_out, defer=False)

    @torch.inference_mode()
    def execute_model_async(self, sched_out: SchedulerOutput) -> StepResult:
        """Run one scheduled step and return it with its tokens possibly still on the way to the
        host (``runner_v2/step_result.py``): read by :meth:`StepResult.result`, or at the start of
        the next step. A step with a drafter or stateful layers reads its tokens before it
        returns: the drafter proposes from them on the host, the state handlers commit by them."""
        return self._run(sched_out, defer=self.drafter is None and not self.state_handlers)

    def resolve_pending(self) -> None:
        """Read the tokens of the steps still in flight, if any, into the persistent batch."""
        pending, self._pending = self._pending, []
        for record in pending:
            record.result()

    def _settle(self, sched_out: SchedulerOutput) -> TokenFeed | None:
        """Before a step: read every step still in flight, except the latest when its tokens can
        feed this step from the device (returned): the batch's rows stay theirs (no request leaves
        this step) and no logits processing needs the token ids on the host."""
        if not self._pending:
            return None
        pending = [r for r in self._pending if r.pending]
        latest = pending[-1] if pending else None
        feedable = (
            latest is not None
            and latest.feed is not None
            and not sched_out.finished_req_ids
            and not sched_out.preempted_req_ids
            and not self.batch.may_shape_logits
        )
        for record in pending[:-1] if feedable else pending:
            record.result()
        self._pending = [latest] if feedable else []
        return latest.feed if feedable else None

    @property
    def last_positions(self) -> torch.Tensor | None:
        """The latest target forward's positions ``[T]`` (a view of the step buffers)."""
        step = self.last_step
        return None if step is None else self.buffers.positions[: step.num_tokens]

    def _feed(self, step: StepInputs, feed: TokenFeed) -> None:
        """Have the buffers take ``step``'s token ids the host holds as placeholders from the
        previous step's samples on the device."""
        ids = step.input_ids
        dst = np.flatnonzero(ids < 0)
        if not len(dst):
            return
        owners = (
            step.rows[dst]
            if step.num_tokens == step.num_reqs
            else np.repeat(step.rows, step.num_scheduled)[dst]
        )
        src = feed.index[owners]
        device = self.device
        values = feed.tokens.index_select(0, to_device(torch.from_numpy(src), device)).clamp_min_(0)
        self.buffers.feed_input_ids(to_device(torch.from_numpy(dst), device), values)

    def _run(self, sched_out: SchedulerOutput, *, defer: bool) -> StepResult:
        # The steps in flight's tokens are the next inputs: read them before this step's deltas,
        # unless the latest one's can feed this step on the device.
        feed = self._settle(sched_out)
        if self.async_scheduling and sched_out.scheduled_spec_decode_tokens:
            sched_out = self._with_proposals(sched_out)
        self.batch.update(sched_out)
        if self.async_scheduling:
            self.batch.clamp_computed(sched_out.scheduled_cached_reqs)
        handlers = self.state_handlers
        if handlers:
            gone = sched_out.finished_req_ids | sched_out.preempted_req_ids
            for handler in handlers:
                handler.forget(gone)
        self.num_steps += 1
        self.last_prompt_logprobs = {}
        connector = self.kv_connector
        if connector is not None:
            connector.start_load_kv(sched_out.kv_connector_metadata)
        if sched_out.is_empty:
            return StepResult.ready(self._transfer_report(sched_out, ModelRunnerOutput()))
        step = self.batch.prepare_inputs(sched_out)
        if handlers:
            num_drafts = [len(d) for d in step.draft_token_ids]
            for handler in handlers:
                handler.begin_step(step.req_ids, step.block_tables, num_drafts)
        if feed is not None:
            self._feed(step, feed)
        # A captured graph that fits replays the step; otherwise it runs eagerly.
        replay = self.graphs.replay_step(step) if self.graphs is not None else None
        if replay is None:
            self.buffers.copy_from(step)
            metas = self.buffers.attn_metadata(num_columns=step.max_num_blocks)
            if self.kv_write_log.recording:
                self.record_pass("target", step.req_ids, metas)
            hidden = self.forward_batch(step.num_tokens, metas)
        else:
            if self.kv_write_log.recording:
                self.record_pass("target", step.req_ids, replay.metas)
            hidden, self.last_aux_hidden_states = replay.output, replay.aux
        self.last_step = step
        self.last_hidden_states = hidden

        tokens = self._sample(hidden, step, defer=defer)
        # From the hidden states of every prompt token, whichever way the step ran (a replayed
        # graph returns them all too); before the drafter, whose passes reuse buffers.
        self.last_prompt_logprobs = self._prompt_logprobs(hidden, step)
        record = StepResult(
            step=step,
            logits=self.last_logits,
            prompt_logprobs=self.last_prompt_logprobs,
            _finish=lambda rec: self._finish_step(rec, sched_out, step, hidden, tokens),
        )
        if isinstance(tokens, PendingTokens):
            if tokens.device_tokens is not None:
                # One token a sampling row, still on the device: the next step may take it there.
                rows = step.rows if tokens.samples is None else step.rows[step.num_logits > 0]
                index = np.full(self.max_num_reqs, -1, dtype=np.int64)
                index[rows] = np.arange(len(rows))
                record.feed = TokenFeed(rows, self.batch.reserve_tokens(rows), tokens.device_tokens, index)
            self._pending.append(record)
        else:
            record.result()
        return record

    def _finish_step(
        self,
        record: StepResult,
        sched_out: SchedulerOutput,
        step: StepInputs,
        hidden: torch.Tensor,
        tokens: list[list[int]] | PendingTokens,
    ) -> ModelRunnerOutput:
        """The step's output once its tokens are on the host: they join the persistent batch, the
        state handlers commit, the drafter proposes."""
        feed = record.feed
        if isinstance(tokens, PendingTokens):
            sampled, flag = tokens.read()
            if tokens.flag and record.logits is None and flag:
                # Read late, a row the greedy head declined (non-finite) cannot take the full
                # logits any more: its request fails (engine.py) and a stand-in token keeps the
                # batch's inputs valid until it is dropped.
                record.nonfinite_req_ids = [
                    r for r, t in zip(step.req_ids, sampled, strict=True) if t and t[0] < 0
                ]
                sampled = [[max(t, 0) for t in s] for s in sampled]
            elif tokens.flag and record.logits is not None:
                record.logits_finite = bool(flag)
        else:
            sampled = tokens
            record.logits_finite = self.last_logits_finite
        self.last_logits_finite = record.logits_finite
        handlers = self.state_handlers
        if handlers:
            seq_lens = step.seq_lens.tolist()
            for handler in handlers:
                handler.finish_step(step.req_ids, seq_lens, sampled)
        if feed is None:
            self.batch.append_sampled(step.rows, sampled)
        else:
            # Their places were reserved when the step ran (the next step may have read them).
            self.batch.fill_tokens(feed.rows, feed.positions, [s[0] for s in sampled if s])
            record.feed = None
        self.draft_tokens = self._propose(sched_out, step, sampled, hidden)
        # The scheduler keeps its requests' drafts on the host: one read of the step's drafts.
        drafts = self.draft_tokens.to_lists() if self.draft_tokens is not None else {}
        self._proposals = drafts
        connector = self.kv_connector
        if connector is not None:
            connector.wait_for_save()
        output = ModelRunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=sampled,
            draft_token_ids=drafts,
            num_draft_tokens={r: len(d) for r, d in zip(step.req_ids, step.draft_token_ids, strict=True) if d}
            if sched_out.scheduled_spec_decode_tokens
            else {},
        )
        return self._transfer_report(sched_out, output)

    def _with_proposals(self, sched_out: SchedulerOutput) -> SchedulerOutput:
        """An async step's schedule with its placeholder drafts replaced by the drafter's latest
        proposals (at most as many; a request with fewer computes fewer tokens)."""
        spec: dict[str, list[int]] = {}
        counts = dict(sched_out.num_scheduled_tokens)
        proposals = self._proposals
        for req_id, placeholders in sched_out.scheduled_spec_decode_tokens.items():
            real = proposals.get(req_id, ())[: len(placeholders)]
            if real:
                spec[req_id] = list(real)
            counts[req_id] -= len(placeholders) - len(real)
        return replace(sched_out, num_scheduled_tokens=counts, scheduled_spec_decode_tokens=spec)

    def _transfer_report(self, sched_out: SchedulerOutput, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """``output`` with the KV transfers that finished: the connector's report, or, with no
        connector, every load of this step (nothing to copy: the caller put the KV in place)."""
        if self.kv_connector is None:
            output.finished_recving = set(sched_out.kv_loads)
        else:
            output.finished_sending, output.finished_recving = self.kv_connector.get_finished(
                sched_out.finished_req_ids
            )
            output.failed_recving = self.kv_connector.get_load_errors()
        return output

    def _propose(
        self, sched_out: SchedulerOutput, step: StepInputs, sampled: list[list[int]], hidden: torch.Tensor
    ) -> DraftTokens | None:
        """The drafter's proposals for the next step, on the device; none from a step that reserved
        no lookahead for its drafter's writes (they would land past the requests' blocks). A P/D
        producer's drafter (no lookahead at all, ``num_speculative_tokens`` 0) runs its prompt pass,
        writing the drafter KV the consumer reads, and proposes nothing."""
        if self.drafter is None:
            return None
        lookahead = self.config.num_lookahead_tokens
        if lookahead:
            given = sched_out.num_lookahead_tokens
            short = [r for r in step.req_ids if given.get(r, lookahead) < lookahead]
            if len(short) == len(step.req_ids):
                return None
            if short:
                raise RuntimeError(
                    f"requests {short} reserved less than the drafter's lookahead {lookahead} in a step "
                    "where others draft: the scheduler must give every request of a drafting step the "
                    "lookahead of core/step_rules.py"
                )
        ctx = DraftContext(
            view=StepView.from_step(step, sampled),
            hidden_states=hidden,
            aux_hidden_states=self.last_aux_hidden_states,
            token_ids=self.batch.token_ids,
            num_tokens=self.batch.num_tokens,
            device=self.device,
            max_model_len=self.max_model_len,
        )
        if self.draft_executor is not None:
            self.draft_executor.step = self.num_steps
        return self.drafter.propose(ctx)

    def forward_batch(self, num_tokens: int, attn_metadata: dict[str, AttentionMetadata]) -> torch.Tensor:
        """Run the model eagerly on the first ``num_tokens`` tokens of the static buffers: the seam
        graph capture and replay wrap. Returns hidden states ``[num_tokens, H]``."""
        ctx = StepContext(
            attn_metadata=self.state_metadata(attn_metadata),
            layer_to_group=self.kv_caches.layer_to_group,
            kv_caches=self.kv_caches.tensors,
            backends=self.backends,
            group_kinds=self.kv_caches.group_kinds,
            aux_hidden_state_layers=self.aux_hidden_state_layers,
        )
        hidden = self.model.forward(
            self.buffers.input_ids[:num_tokens], self.buffers.positions[:num_tokens], ctx
        )
        self.last_aux_hidden_states = ctx.aux_hidden_states
        return hidden

    def state_metadata(
        self, metas: dict[str, AttentionMetadata], *, static: bool = False
    ) -> dict[str, AttentionMetadata]:
        """``metas`` extended by every state handler for the pass loaded in the buffers now.
        ``static``: ``metas`` belong to a graph; keep the returned dict and pass it back."""
        for handler in self.state_handlers:
            metas = handler.metadata(metas, static=static)
        return metas

    def record_pass(self, phase: str, req_ids: list[str], metas: dict[str, AttentionMetadata]) -> None:
        """Append the slot mappings of a target pass over the loaded buffers to ``kv_write_log``."""
        r = len(req_ids)
        rows = [self.batch.row_of[req_id] for req_id in req_ids]
        writes = {}
        for group, meta in metas.items():
            handler = next((h for h in self.state_handlers if h.handles(group)), None)
            if handler is not None:
                # Stateful layers (Mamba) write whole states into columns, not tokens into slots.
                positions, slots = handler.write_slots(group, meta)
            else:
                positions = self.buffers.positions[: meta.num_tokens].cpu().clone()
                slots = meta.slot_mapping.cpu().clone()
            writes[group] = (positions, slots)
        self._log_pass(phase, req_ids, rows, self.buffers.query_start_loc_cpu[: r + 1].tolist(), writes)

    def _log_pass(
        self,
        phase: str,
        req_ids: Sequence[str],
        rows: Sequence[int],
        query_start_loc: list[int],
        writes: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        tables = self.batch.block_tables
        block_ids = {
            g: {req_id: tables[g].row(int(row)) for req_id, row in zip(req_ids, rows, strict=True)}
            for g in writes
        }
        self.kv_write_log.add_pass(
            phase,
            step=self.num_steps,
            req_ids=req_ids,
            query_start_loc=query_start_loc,
            block_ids=block_ids,
            writes=writes,
        )

    # ---- sampling --------------------------------------------------------------------------------

    def sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """Sampling settings for logits rows taken from persistent-batch ``rows``; built when the
        rows or the batch's composition change, reused as is by every step in between."""
        b = self.batch
        key = (b.version, rows.tobytes())
        if self._sampling_key == key and self._sampling_meta is not None:
            return self._sampling_meta
        meta = SamplingMetadata.from_rows(
            temperature=b.temperature[rows],
            top_k=b.top_k[rows],
            top_p=b.top_p[rows],
            min_p=b.min_p[rows],
            generators=[b.generators[i] for i in rows.tolist()],
            device=self.device,
        )
        self._sampling_key, self._sampling_meta = key, meta
        return meta

    def _sample(
        self, hidden: torch.Tensor, step: StepInputs, *, defer: bool = False
    ) -> list[list[int]] | PendingTokens:
        """Each request's tokens (accepted drafts + the sampled one; ``[]`` for a prompt chunk).
        ``defer``: return them still on their way to the host (:class:`PendingTokens`)."""
        n = len(step.logits_indices)
        if n == 0:
            self.last_logits = None
            return [[] for _ in step.req_ids]
        # Every token samples (a decode step): the logits rows are the first n hidden rows.
        rows = hidden[:n] if n == step.num_tokens else hidden[self.buffers.logits_indices[:n]]
        every = n == step.num_reqs and n == step.num_tokens
        meta = self.sampling_metadata(step.rows if every else np.repeat(step.rows, step.num_logits))
        samples = None if every else (step.num_logits > 0).tolist()
        # Drafts exist only where a request runs more than one token.
        drafts: list[list[int]] = []
        if samples is not None and step.max_query_len > 1:
            drafts = [d for d, s in zip(step.draft_token_ids, samples, strict=True) if s]
        greedy = self._greedy_argmax(rows, step, meta)
        if greedy is not None:
            # No full logits this step: the engine's logprobs and non-finite check see none (the
            # screen refuses non-finite rows, which then take the full path below).
            self.last_logits = None
            self.last_logits_finite = None
            result = greedy_verify_on_device(greedy, drafts) if any(drafts) else greedy
            # A head that declines rows on the device (a negative id: a non-finite row) says so
            # in the step's one fetch; the step then takes the full logits instead.
            declined = (greedy < 0).any() if getattr(self.greedy_head, "declines_on_device", False) else None
            tokens = self._tokens(result, declined, samples, defer=defer)
            if defer:
                return tokens
            produced, flag = tokens.read()
            if not flag:
                return produced
        logits = self.model.compute_logits(rows)
        self.last_logits = logits
        # NaN or Inf anywhere in a row makes its sum non-finite: one reduction for the batch.
        sums = logits.sum(dim=-1, dtype=torch.float32)
        # On a device the flag rides the step's one fetch (no sync here); host tensors hand the row
        # sums themselves to the reader, whose Python test costs a third of isfinite + all (~10 us).
        finite = sums if sums.device.type == "cpu" else torch.isfinite(sums).all()
        if self.logits_hook is not None:
            self.logits_hook(step.req_ids, step.num_logits, logits)
        logits = self.batch.process_logits(logits, step)
        if not any(drafts):
            result = self.sampler(logits, meta)
        elif meta.all_greedy:
            result = greedy_verify_on_device(row_argmax(logits), drafts)
        else:
            result = self._verify_random(logits, meta, step, drafts)
        tokens = self._tokens(result, finite, samples, defer=defer)
        if defer:
            return tokens
        produced, flag = tokens.read()
        self.last_logits_finite = bool(flag)
        return produced

    def _tokens(
        self,
        result: torch.Tensor | Verified,
        flag: torch.Tensor | None,
        samples: list[bool] | None,
        *,
        defer: bool,
    ) -> PendingTokens:
        """The step's tokens with a device flag (None: none), in one copy: read now, in one wait,
        or (``defer``) still on their way to the host, the sampled ids kept on the device too."""
        verified = isinstance(result, Verified)
        parts = result.parts if verified else [result]
        if flag is not None:
            parts = [*parts, flag]
        if not defer:
            return PendingTokens(
                PendingCopy.done(self.host_copy.fetch(parts)), verified, flag is not None, samples
            )
        device_tokens = None if verified else result.reshape(-1).to(torch.int64)
        return PendingTokens(self.host_copy.start(parts), verified, flag is not None, samples, device_tokens)

    def _prompt_logprobs(self, hidden: torch.Tensor, step: StepInputs) -> dict[str, PromptLogprobsPart]:
        """The prompt logprobs of the step's prompt tokens, for the requests that asked for them.

        NOTE: independent of how the step sampled (the greedy head's argmaxes included): these rows
        are the prompt's own positions, never a sampling row, and go through the full LM head.
        """
        b = self.batch
        if not b.may_want_prompt_logprobs:
            return {}
        num_top = b.prompt_logprobs[step.rows]
        if not (num_top >= 0).any():
            return {}
        return prompt_logprobs_parts(
            self.model.compute_logits,
            hidden,
            req_ids=step.req_ids,
            rows=step.rows,
            num_top=num_top,
            query_start=step.query_start_loc[:-1],
            computed=step.seq_lens - step.num_scheduled,
            num_scheduled=step.num_scheduled,
            num_prompt_tokens=b.num_prompt_tokens[step.rows],
            token_ids=b.token_ids,
        )

    def _greedy_argmax(
        self, rows: torch.Tensor, step: StepInputs, meta: SamplingMetadata
    ) -> torch.Tensor | None:
        """Each logits row's argmax from the screened head when the step needs nothing else: every
        row greedy, no logits processing, no hook, no request returning logprobs. None: compute the
        full logits (also when the head declines a batch, e.g. a non-finite row)."""
        head = self.greedy_head
        if head is None or not meta.all_greedy:
            return None
        if self.batch.wants_logprobs_in(step.rows) or self.batch.shapes_logits(step):
            return None
        # What the step decides, every tensor-parallel rank decides alike (a sharded head's ranks
        # exchange their maxima); a hook only this runner has declines inside the exchange.
        return head.argmax(rows, decline=self.logits_hook is not None)

    def _verify_random(
        self, logits: torch.Tensor, meta: SamplingMetadata, step: StepInputs, drafts: list[list[int]]
    ) -> Verified:
        """Speculative sampling over the processed target distribution (greedy rows one-hot)."""
        probs = self.sampler.probs(logits, meta)
        greedy = (meta.temperature <= 0).to(probs.device)
        one_hot = torch.nn.functional.one_hot(row_argmax(logits), probs.shape[1]).to(probs.dtype)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
        rows = step.rows[step.num_logits > 0].tolist()
        # Every drafter proposes greedily: its drafts are one-hot proposals (no draft probabilities).
        return probabilistic_verify_on_device(
            probs, None, drafts, [self.batch.generators[row] for row in rows]
        )


def _build_greedy_head(model: Any, setting: str) -> GreedyHead | None:
    """The model's screened greedy head when it offers one and the config's
    ``kernel.exact_greedy_head`` (``setting``) is not off; built once, with the runner, so no
    serving step pays for it."""
    build = getattr(model, "greedy_head", None)
    if build is None or not greedy_head_enabled(setting):
        return None
    return build(setting)
