"""What a graph records: one *subject* per kind of pass, behind one interface.

The target subject runs the runner's model over the runner's :class:`StepBuffers`; the drafter
subject runs the drafter's model through the runner's draft executor
(:class:`~warmcap.runner_v2.draft_executor.DraftExecutor`), over the drafter buffers it owns. Capture, replay, verification and the
CUDA-safety check go through :class:`GraphSubject` only, so ``graphs/`` never asks which kind a
graph is: a :class:`~warmcap.graphs.capture.planning.GraphSpec` names its subject, and the subject
knows how to load its inputs, build and refresh its metadata and run its forward. How a subject's
graphs are *proven* (the passes of their verification) is the proof's business
(:mod:`warmcap.graphs.proof.verify`), which looks a subject up by name: capture never imports proof.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import numpy as np
import torch
from torch import nn

from warmcap.graphs.capture.descriptors import BatchShape
from warmcap.graphs.capture.planning import DRAFTER, TARGET
from warmcap.graphs.capture.static_inputs import DraftInputs, empty_step, load_padded, spread_uniform_padding
from warmcap.runner_v2.collaborators import DRAFT_DECODE
from warmcap.runner_v2.draft_buffers import pass_block_tables
from warmcap.runner_v2.draft_executor import draft_kv

if TYPE_CHECKING:
    from warmcap.contracts import AttentionMetadata
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.graphs.capture.planning import GraphSpec
    from warmcap.runner_v2.collaborators import DraftModel, DraftPass
    from warmcap.runner_v2.draft_buffers import DraftBuffers
    from warmcap.runner_v2.draft_context import DraftKV
    from warmcap.runner_v2.draft_executor import DraftExecutor
    from warmcap.runner_v2.input_batch import StepInputs
    from warmcap.runner_v2.model_runner import ModelRunner
    from warmcap.runner_v2.step_buffers import StepBuffers

#: ``(output, aux outputs)`` of one pass
Outputs = tuple[torch.Tensor, list[torch.Tensor]]

InputsT = TypeVar("InputsT")


class GraphSubject(ABC, Generic[InputsT]):
    """One kind of pass a graph records (``name``: the subject a ``GraphSpec`` names)."""

    name: ClassVar[str]

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @property
    @abstractmethod
    def buffers(self) -> StepBuffers:
        """The layout buffers the subject's graphs record over."""

    @abstractmethod
    def groups(self) -> list[KVCacheGroup]:
        """The KV groups the subject's passes write."""

    @abstractmethod
    def load(self, spec: GraphSpec, inputs: InputsT | None = None) -> None:
        """Load ``inputs`` (None: all padding) padded into ``spec``'s shape."""

    @abstractmethod
    def refresh(self, spec: GraphSpec, metas: dict[str, AttentionMetadata]) -> dict[str, AttentionMetadata]:
        """State columns of the pass loaded for ``spec``, written into ``metas``' static entries in
        place (plain entries become static ones: keep the returned dict)."""

    @abstractmethod
    def forward(self, spec: GraphSpec, metas: dict[str, AttentionMetadata]) -> Outputs:
        """Output and auxiliary outputs of one eager pass over the loaded static buffers."""

    @abstractmethod
    def shape(self, phase: str, inputs: InputsT) -> BatchShape:
        """The dispatch shape of a real pass of ``phase``."""

    @abstractmethod
    def dispatch_key(self, phase: str) -> str:
        """Graphs with the same key share one dispatcher (the phases one call may pick from)."""

    @abstractmethod
    def modules(self) -> list[nn.Module]:
        """Every module the subject's forward may run."""


class TargetSubject(GraphSubject["StepInputs"]):
    """The runner's model over the runner's step buffers; outputs hidden states and the
    auxiliary hidden states the drafter reads."""

    name = TARGET

    @property
    def buffers(self) -> StepBuffers:
        return self.runner.buffers

    def groups(self) -> list[KVCacheGroup]:
        return [g for g in self.runner.kv_groups if not g.is_drafter]

    def load(self, spec: GraphSpec, inputs: StepInputs | None = None) -> None:
        buffers = self.buffers
        load_padded(buffers, inputs if inputs is not None else empty_step(buffers), spec)

    def refresh(self, spec: GraphSpec, metas: dict[str, AttentionMetadata]) -> dict[str, AttentionMetadata]:
        return self.runner.state_metadata(metas, static=True)

    def forward(self, spec: GraphSpec, metas: dict[str, AttentionMetadata]) -> Outputs:
        hidden = self.runner.forward_batch(spec.num_tokens, metas)
        return hidden, list(self.runner.last_aux_hidden_states)

    def shape(self, phase: str, inputs: StepInputs) -> BatchShape:
        return step_shape(inputs)

    def dispatch_key(self, phase: str) -> str:
        # Any target graph may serve a step: decode and mixed graphs compete in one dispatcher.
        return TARGET

    def modules(self) -> list[nn.Module]:
        return [self.runner.model]


class DrafterSubject(GraphSubject[DraftInputs]):
    """The drafter's model, run by the runner's draft executor over the executor's buffers (the
    same eager call a serving pass makes)."""

    name = DRAFTER

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        if runner.draft_executor is None:
            raise ValueError("a drafter subject needs a runner built with a model-backed drafter")
        self.executor: DraftExecutor = runner.draft_executor
        self.model: DraftModel = self.executor.model

    @property
    def statics(self) -> DraftBuffers:
        # Read at each use: graph safety substitutes fakes in the executor.
        return self.executor.buffers

    @property
    def buffers(self) -> StepBuffers:
        return self.statics.buffers

    def groups(self) -> list[KVCacheGroup]:
        return self.model.graph_groups()

    def load(self, spec: GraphSpec, inputs: DraftInputs | None = None) -> None:
        statics = self.statics
        if inputs is None:
            statics.load(spec.phase, None, {}, num_tokens_padded=spec.num_tokens, num_reqs_padded=spec.rows)
            spread_uniform_padding(statics.buffers, spec)
            return
        self.load_tables(spec, inputs, pass_block_tables(self.executor.batch, inputs.dp, statics.group_names))

    def load_tables(self, spec: GraphSpec, inputs: DraftInputs, tables: dict[str, torch.Tensor]) -> None:
        """Load ``inputs`` padded into ``spec``'s shape with the given host block tables (rows of
        no running request: verification's scratch blocks)."""
        self.statics.load(
            spec.phase,
            inputs.dp,
            tables,
            inputs.input_ids,
            inputs.features,
            num_tokens_padded=spec.num_tokens,
            num_reqs_padded=spec.rows,
        )
        spread_uniform_padding(self.statics.buffers, spec)

    def kv(self) -> DraftKV:
        """What the executor's passes run over now (substituted fakes included)."""
        executor = self.executor
        return draft_kv(executor.batch, executor.kv_caches, executor.backends)

    # NOTE: refresh and forward read the executor's fields but call none of its methods: a replay
    # is dispatched from inside DraftExecutor.run, so calling back into it would re-enter it.
    def refresh(self, spec: GraphSpec, metas: dict[str, AttentionMetadata]) -> dict[str, AttentionMetadata]:
        return self.model.state_metadata(self.kv(), metas, static=True)

    def forward(self, spec: GraphSpec, metas: dict[str, AttentionMetadata]) -> Outputs:
        ids, positions, features = self.statics.inputs(spec.phase, spec.num_tokens)
        return self.model.forward_pass(self.kv(), spec.phase, metas, ids, positions, features), []

    def shape(self, phase: str, inputs: DraftInputs) -> BatchShape:
        return pass_shape(phase, inputs.dp)

    def dispatch_key(self, phase: str) -> str:
        # A drafter pass runs one phase: only that phase's graphs may serve it.
        return phase

    def modules(self) -> list[nn.Module]:
        return self.model.modules()


def make_subjects(runner: ModelRunner) -> dict[str, GraphSubject[Any]]:
    """The runner's subjects by name: the target always, the drafter when it has a model."""
    subjects: dict[str, GraphSubject[Any]] = {TARGET: TargetSubject(runner)}
    if runner.draft_executor is not None:
        subjects[DRAFTER] = DrafterSubject(runner)
    return subjects


def step_shape(step: StepInputs) -> BatchShape:
    """The dispatch shape of a step. A request is decoding when every token it runs samples (the
    sampled token plus its drafts); a prompt chunk samples at most its last token."""
    if step.decode:
        # One token a request, each sampled: the steady decode step, known without array work.
        return BatchShape(step.num_reqs, step.num_reqs, 1, True, 1)
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
