"""Serving through captured graphs: dispatch a pass, pad it into the graph's buffers, replay.

Target steps: the runner calls :meth:`GraphRunner.forward` with the step's host inputs; ``None``
means no graph fits and the runner runs its eager path. The hook in ``ModelRunner.execute_model``::

    hidden = self.graph_runner.forward(step) if self.graph_runner is not None else None

placed before the eager ``copy_from`` / ``forward_batch``, which then run only when ``hidden is None``.
After a replay ``runner.last_aux_hidden_states`` are the graph's static auxiliary outputs.

Drafter passes: ``drafters.paged.run_pass`` calls :meth:`GraphRunner.draft_forward` first and runs
the pass eagerly when it returns ``None``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from warmcap.drafters.base import DRAFT_DECODE
from warmcap.graphs.descriptors import BatchDescriptor, BatchShape, Dispatcher
from warmcap.graphs.static_inputs import load_padded
from warmcap.runner_v2.kv_writes import KVWriteRecord

if TYPE_CHECKING:
    import torch

    from warmcap.drafters.base import Drafter
    from warmcap.drafters.paged import DraftPass
    from warmcap.graphs.capture import CapturedGraph
    from warmcap.graphs.static_inputs import DraftStatics
    from warmcap.runner_v2.input_batch import StepInputs
    from warmcap.runner_v2.model_runner import ModelRunner


def step_shape(step: StepInputs) -> BatchShape:
    """The dispatch shape of a step. A request is decoding when every token it runs samples (the
    sampled token plus its drafts); a prompt chunk samples at most its last token."""
    all_decode = bool(np.array_equal(step.num_logits, step.num_scheduled))
    lens = step.num_scheduled
    uniform = int(lens[0]) if len(lens) and bool((lens == lens[0]).all()) else None
    return BatchShape(step.num_tokens, step.num_reqs, step.max_query_len, all_decode, uniform)


def pass_shape(phase: str, dp: DraftPass) -> BatchShape:
    """The dispatch shape of a drafter pass: a ``draft_decode`` pass may use uniform graphs, a
    ``draft_prefill`` (ragged spans) only mixed ones."""
    lens = dp.query_lens
    uniform = int(lens[0]) if len(lens) and bool((lens == lens[0]).all()) else None
    return BatchShape(dp.num_tokens, dp.num_reqs, int(lens.max(initial=0)), phase == DRAFT_DECODE, uniform)


class GraphRunner:
    """Replays captured graphs for the passes they fit; counts replays per graph.

    ``replays`` counts target replays per descriptor, ``draft_replays`` drafter replays per
    ``(phase, descriptor)``; ``eager_steps`` / ``eager_draft_passes`` count what no graph fitted.
    """

    def __init__(
        self, runner: ModelRunner, graphs: list[CapturedGraph], drafts: DraftStatics | None = None
    ) -> None:
        self.runner = runner
        target = [g for g in graphs if not g.spec.is_draft]
        self.graphs: dict[BatchDescriptor, CapturedGraph] = {g.spec.descriptor: g for g in target}
        self.dispatcher = Dispatcher(self.graphs)
        self.replays: dict[BatchDescriptor, int] = dict.fromkeys(self.graphs, 0)
        self.eager_steps = 0
        self.drafts = drafts
        # The drafter whose passes the drafter graphs recorded (runner.drafter may be wrapped later).
        self.drafter = runner.drafter
        self.draft_graphs: dict[tuple[str, BatchDescriptor], CapturedGraph] = {
            (g.spec.phase, g.spec.descriptor): g for g in graphs if g.spec.is_draft
        }
        phases = {phase for phase, _ in self.draft_graphs}
        self.draft_dispatchers = {
            phase: Dispatcher(d for p, d in self.draft_graphs if p == phase) for phase in phases
        }
        self.draft_replays: dict[tuple[str, BatchDescriptor], int] = dict.fromkeys(self.draft_graphs, 0)
        self.eager_draft_passes = 0

    def install(self) -> None:
        """Make the runner use these graphs (``runner.graph_runner``)."""
        self.runner.graph_runner = self

    def forward(self, step: StepInputs) -> torch.Tensor | None:
        """Hidden states ``[num_tokens, H]`` of ``step`` from a graph, or None to run eagerly."""
        if step.num_reqs == 0:
            return None
        descriptor = self.dispatcher.dispatch(step_shape(step))
        if descriptor is None:
            self.eager_steps += 1
            return None
        graph = self.graphs[descriptor]
        runner = self.runner
        load_padded(runner.buffers, step, graph.spec)
        if runner.record_kv_writes:
            runner.record_pass("target", step.req_ids, graph.metas)
        graph.replay_fn()
        self.replays[descriptor] += 1
        t = step.num_tokens
        runner.last_aux_hidden_states = [a[:t] for a in graph.aux]
        return graph.output[:t]

    def draft_forward(
        self,
        drafter: Drafter,
        phase: str,
        dp: DraftPass,
        input_ids: torch.Tensor,
        features: torch.Tensor | None,
        log_phase: str,
    ) -> torch.Tensor | None:
        """Output ``[T, H]`` of drafter pass ``dp`` from a ``phase`` graph, or None to run it
        eagerly. The padded pass is logged under ``log_phase`` when the runner records KV writes."""
        dispatcher = self.draft_dispatchers.get(phase)
        if dispatcher is None or self.drafts is None or dp.num_reqs == 0 or drafter is not self.drafter:
            return None
        descriptor = dispatcher.dispatch(pass_shape(phase, dp))
        if descriptor is None:
            self.eager_draft_passes += 1
            return None
        graph = self.draft_graphs[(phase, descriptor)]
        runner = self.runner
        groups = list(self.drafts.buffers.block_tables)
        tables = {g: runner.batch.block_tables[g].gather(dp.rows) for g in groups}
        self.drafts.load(graph.spec, dp, tables, input_ids, features)
        if runner.record_kv_writes:
            self._record(dp, log_phase)
        graph.replay_fn()
        self.draft_replays[(phase, descriptor)] += 1
        return graph.output[: dp.num_tokens]

    def _record(self, dp: DraftPass, log_phase: str) -> None:
        """Log the padded drafter pass like the eager path logs its own (padding must be PAD)."""
        runner = self.runner
        b = self.drafts.buffers
        tp = b.num_tokens_padded
        positions = b.positions[:tp].cpu().clone()
        for group, slots in b.slot_mappings.items():
            table = runner.batch.block_tables[group]
            runner.kv_write_log.add(
                KVWriteRecord(
                    phase=log_phase,
                    group=group,
                    req_ids=list(dp.req_ids),
                    query_start_loc=dp.query_start_loc.tolist(),
                    positions=positions,
                    slot_mapping=slots[:tp].cpu().clone(),
                    step=runner.num_steps,
                    block_ids={r: table.row(int(row)) for r, row in zip(dp.req_ids, dp.rows, strict=True)},
                )
            )
