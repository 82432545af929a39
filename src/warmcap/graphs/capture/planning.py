"""Which graphs a runner gets: target uniform-decode FULL graphs plus mixed graphs on the ladder,
then the drafter's ``draft_prefill`` (on the target's token counts) and ``draft_decode`` graphs.

Mamba layers are graph-safe only on uniform batches of at most ``MAX_UNIFORM_QUERY_LEN`` queries per
row (see :mod:`warmcap.runner_v2.attention.mamba2`); ragged ones run a per-row scan over host lists. With the
``cuda`` backend a model with Mamba layers therefore gets no mixed graphs (and a draft LM with Mamba
layers no draft-prefill graphs); ``static`` and ``compile`` record nothing and keep them all. Such a
plan adds one-query decode graphs when the drafter may draft nothing for a row (ngram), since no
mixed graph would catch those steps.

The plan reads only :class:`CaptureFacts`: the runner's batch limits, its KV groups, its attention
backend and its drafter's passes. Capture takes them from the built runner
(:meth:`CaptureFacts.of_runner`); ``warmup plan --html`` from the config, the KV groups and the drafter
start-up assembles, with no runner and no weight (:meth:`CaptureFacts.of_config`). Both call
:func:`plan_capture`, so the page draws the graphs a run captures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from warmcap.config import check_graph_shapes
from warmcap.contracts.backends import MAX_UNIFORM_QUERY_LEN
from warmcap.core.kv_spec import MambaSpec
from warmcap.errors import ConfigError
from warmcap.graphs.capture.descriptors import BatchDescriptor, CUDAGraphMode, graph_label
from warmcap.graphs.capture.sizes import default_capture_sizes, uniform_decode_sizes
from warmcap.runner_v2.collaborators import DRAFT_DECODE, DRAFT_PREFILL

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from warmcap.config import EngineConfig, SpeculativeConfig
    from warmcap.contracts.backends import AttentionBackend
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.runner_v2.collaborators import DraftGraphShape, DraftModel
    from warmcap.runner_v2.model_runner import ModelRunner


#: the subjects a graph may record (:mod:`warmcap.graphs.capture.subjects`)
TARGET = "target"
DRAFTER = "drafter"
#: the capture backends (:mod:`warmcap.graphs.capture.capturer`)
GRAPH_BACKENDS: tuple[str, ...] = ("cuda", "static", "compile")


def subject_of(phase: str) -> str:
    """What a graph of report phase ``phase`` records: ``drafter`` passes or ``target`` steps."""
    return DRAFTER if phase in (DRAFT_PREFILL, DRAFT_DECODE) else TARGET


def check_backend(backend: str) -> str:
    """``backend`` when it is a capture backend; else one clear error."""
    if backend not in GRAPH_BACKENDS:
        raise ConfigError(f"unknown graph backend {backend!r}: use one of {', '.join(GRAPH_BACKENDS)}")
    return backend


@dataclass(frozen=True, slots=True)
class GraphSpec:
    """One graph to capture: its key, its report phase, and the batch rows its static metadata has.

    ``rows`` exceeds the descriptor's request count by one for mixed graphs: the spare row owns the
    padded tokens, so a batch with as many requests as the graph holds can still be padded.
    """

    phase: str
    descriptor: BatchDescriptor
    rows: int

    @property
    def num_tokens(self) -> int:
        return self.descriptor.num_tokens

    @property
    def max_query_len(self) -> int:
        """Query length the static metadata declares (uniform length, or every token in one row)."""
        q = self.descriptor.uniform_query_len
        return q if q is not None else self.descriptor.num_tokens

    @property
    def label(self) -> str:
        d = self.descriptor
        return graph_label(self.phase, d.mode.value, d.num_tokens, d.num_reqs, d.uniform_query_len)

    @property
    def subject(self) -> str:
        """What the graph records: ``drafter`` passes (over the drafter's buffers) or ``target``
        steps."""
        return subject_of(self.phase)


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """Graphs to capture, the ladder sizes of ragged graphs (target mixed graphs, the drafter's
    draft prefills), and why anything was left out."""

    specs: list[GraphSpec]
    capture_sizes: list[int]
    notes: list[str]


@dataclass(frozen=True, slots=True)
class CapturePlan:
    """What a start-up captures: the target's graphs, then the drafter's, on ``backend``
    (``eager``: none, the config says ``enforce_eager``)."""

    backend: str
    target: GraphPlan
    draft: GraphPlan = field(default_factory=lambda: GraphPlan([], [], []))

    @property
    def specs(self) -> list[GraphSpec]:
        """Every graph, target first, in plan order."""
        return [*self.target.specs, *self.draft.specs]

    @property
    def notes(self) -> list[str]:
        return [*self.target.notes, *self.draft.notes]

    @classmethod
    def eager(cls) -> CapturePlan:
        """No graph: ``enforce_eager`` runs every pass eagerly."""
        return cls(
            "eager",
            GraphPlan([], [], ["enforce_eager is set: no graph is captured, every pass runs eagerly"]),
        )


@dataclass(frozen=True, slots=True)
class CaptureFacts:
    """Everything the capture plan reads, and nothing else: the speculation, the bounds of the
    runner's step buffers, every KV group (target and drafter), the attention backend and the
    drafter model's passes."""

    #: k, the query length of a decode step (1 + k), and the method (None: no speculation)
    num_speculative_tokens: int
    uniform_decode_query_len: int
    speculative: SpeculativeConfig | None
    max_num_reqs: int
    max_num_tokens: int
    kv_groups: tuple[KVCacheGroup, ...]
    attention: str
    full_graph: bool
    #: the drafter model's passes per step, and the KV groups they run over; empty without a
    #: drafter model the runner executes (none, ngram)
    draft_shapes: tuple[DraftGraphShape, ...] = ()
    draft_groups: tuple[KVCacheGroup, ...] = ()

    @classmethod
    def of_runner(cls, runner: ModelRunner) -> CaptureFacts:
        """The facts of a built runner (what capture plans from)."""
        executor = runner.draft_executor
        model = None if executor is None else executor.model
        config = runner.config
        return cls(
            config.num_speculative_tokens,
            config.uniform_decode_query_len,
            config.speculative,
            runner.max_num_reqs,
            runner.max_num_tokens,
            tuple(runner.kv_groups),
            runner.attn_backend.name,
            runner.attn_backend.supports_full_graph,
            tuple(model.graph_shapes()) if model is not None else (),
            tuple(model.graph_groups()) if model is not None else (),
        )

    @classmethod
    def of_config(
        cls,
        config: EngineConfig,
        kv_groups: Sequence[KVCacheGroup],
        attention: AttentionBackend,
        draft_model: DraftModel | None,
    ) -> CaptureFacts:
        """The facts of the runner start-up would build from an assembled ``config``, its
        ``kv_groups`` and its drafter's ``draft_model``, with no runner."""
        sched = config.scheduler
        # NOTE: sized as ``ModelRunner.__init__`` sizes its step buffers (the step budget or a full
        # decode step of every request, whichever is larger); tests/graphs/test_capture_plan.py
        # holds the two to the same facts.
        max_tokens = max(
            sched.max_num_batched_tokens, sched.max_num_seqs * (1 + config.num_speculative_tokens)
        )
        # The runner executes a drafter model only when its passes have KV groups to run over
        # (``ModelRunner._draft_executor``).
        model = draft_model if draft_model is not None and draft_model.graph_groups() else None
        return cls(
            config.num_speculative_tokens,
            config.uniform_decode_query_len,
            config.speculative,
            sched.max_num_seqs,
            max_tokens,
            tuple(kv_groups),
            attention.name,
            attention.supports_full_graph,
            tuple(model.graph_shapes()) if model is not None else (),
            tuple(model.graph_groups()) if model is not None else (),
        )


def plan_capture(
    facts: CaptureFacts,
    *,
    capture_sizes: list[int] | None = None,
    backend: str = "static",
    drafter_graphs: bool = True,
    graph_shapes: str = "all",
) -> CapturePlan:
    """The graphs a ``backend`` capture records for ``facts``: :func:`plan_target`, then
    :func:`plan_draft` (unless ``drafter_graphs`` is off)."""
    check_backend(backend)
    target = plan_target(facts, capture_sizes=capture_sizes, backend=backend, graph_shapes=graph_shapes)
    draft = (
        plan_draft(facts, target, backend=backend, graph_shapes=graph_shapes)
        if drafter_graphs
        else GraphPlan([], [], [])
    )
    return CapturePlan(backend, target, draft)


def _records_mamba(backend: str, groups: Iterable[KVCacheGroup]) -> bool:
    """Whether ``backend`` records graphs over passes through Mamba layers (some of ``groups``)."""
    return backend == "cuda" and any(isinstance(g.spec, MambaSpec) for g in groups)


def _uniform_fits(mamba: bool, q: int, phase: str, notes: list[str]) -> bool:
    """Whether uniform graphs of ``q`` queries per row are graph-safe; notes why not."""
    if mamba and q > MAX_UNIFORM_QUERY_LEN:
        notes.append(
            f"Mamba layers run {q} queries per row through their ragged scan (graph-safe up to "
            f"{MAX_UNIFORM_QUERY_LEN}): {phase} batches run eagerly"
        )
        return False
    return True


def plan_target_graphs(
    runner: ModelRunner,
    *,
    capture_sizes: list[int] | None = None,
    backend: str = "static",
    graph_shapes: str = "all",
) -> GraphPlan:
    """:func:`plan_target` over ``runner``'s facts."""
    return plan_target(
        CaptureFacts.of_runner(runner),
        capture_sizes=capture_sizes,
        backend=backend,
        graph_shapes=graph_shapes,
    )


def plan_target(
    facts: CaptureFacts,
    *,
    capture_sizes: list[int] | None = None,
    backend: str = "static",
    graph_shapes: str = "all",
) -> GraphPlan:
    """Uniform-decode FULL graphs for ``1..max_num_seqs`` requests of ``1 + k`` tokens, then mixed
    graphs on ``capture_sizes`` (default ladder), all bounded by the runner's token buffers.
    ``backend`` is the capture backend: ``cuda`` leaves out what Mamba layers cannot record.
    ``graph_shapes`` (``config.GRAPH_SHAPES``): ``all`` gives every request count its decode graph
    (no decode step padded); ``sizes`` only those whose token count is a capture size, a decode
    step padded to the next (vLLM's way; fewer graphs to verify); ``decode`` those and no mixed
    graphs."""
    check_graph_shapes(graph_shapes)
    k = facts.num_speculative_tokens
    q = facts.uniform_decode_query_len
    max_reqs = facts.max_num_reqs
    max_tokens = facts.max_num_tokens
    notes: list[str] = []
    mamba = _records_mamba(backend, (g for g in facts.kv_groups if not g.is_drafter))
    sizes = capture_sizes if capture_sizes is not None else default_capture_sizes(max_reqs, k)
    decode_sizes = uniform_decode_sizes(max_reqs, k) if _uniform_fits(mamba, q, "decode", notes) else []
    if graph_shapes != "all":
        at = set(sizes)
        decode_sizes = [n for n in decode_sizes if n in at]
    specs = [
        GraphSpec("decode", BatchDescriptor(CUDAGraphMode.FULL, n, n // q, q), n // q)
        for n in decode_sizes
        if n <= max_tokens
    ]
    kept = [s for s in sizes if s <= max_tokens]
    if len(kept) < len(sizes):
        notes.append(
            f"capture sizes above the runner's {max_tokens}-token buffers were dropped: "
            f"{[s for s in sizes if s > max_tokens]}"
        )
    if graph_shapes == "decode":
        notes.append("graph_shapes decode: mixed prefill/decode batches run eagerly")
        return GraphPlan(specs, kept, notes)
    if not facts.full_graph:
        # NOTE: PIECEWISE capture (graphs between attention calls) needs the model split at every
        # attention call; without it mixed batches stay eager rather than pretend to be captured.
        notes.append(
            f"attention backend {facts.attention!r} cannot run inside a FULL graph: "
            "mixed prefill/decode batches run eagerly"
        )
        return GraphPlan(specs, [], notes)
    if mamba:
        # NOTE: the sizes stay in the plan: a drafter without Mamba layers (EAGLE on a hybrid
        # target) still captures its draft prefills on them.
        notes.append(
            "CUDA graphs cannot record the ragged scan (host lists) of the model's Mamba layers: "
            "mixed prefill/decode batches run eagerly"
        )
        specs += _undrafted_decode_specs(facts, max_tokens, notes)
        return GraphPlan(specs, kept, notes)
    indexed = any(g.spec.kind == "indexer" for g in facts.kv_groups)
    phase = "sparse_mla" if indexed else "mixed"
    for size in kept:
        cap = min(size, max_reqs)
        specs.append(GraphSpec(phase, BatchDescriptor(CUDAGraphMode.FULL, size, cap), cap + 1))
    return GraphPlan(specs, kept, notes)


def _undrafted_decode_specs(facts: CaptureFacts, max_tokens: int, notes: list[str]) -> list[GraphSpec]:
    """Uniform decode graphs of one query per row, for a drafter that may draft nothing (ngram) on
    a plan without mixed graphs: there a step whose rows found no draft (the common case on text
    without repeats) fits no ``1 + k`` graph, and nothing else would replay it."""
    k = facts.num_speculative_tokens
    spec = facts.speculative
    if k == 0 or spec is None or spec.entry.fixed_drafts:
        return []
    notes.append(
        f"{spec.method} drafts 0..{k} tokens a row: decode graphs of 1 and {1 + k} "
        "queries a row; decode steps whose rows differ in length run eagerly"
    )
    return [
        GraphSpec("decode", BatchDescriptor(CUDAGraphMode.FULL, n, n, 1), n)
        for n in uniform_decode_sizes(facts.max_num_reqs, 0)
        if n <= max_tokens
    ]


def plan_draft_graphs(
    runner: ModelRunner, target: GraphPlan, *, backend: str = "static", graph_shapes: str = "all"
) -> GraphPlan:
    """:func:`plan_draft` over ``runner``'s facts."""
    return plan_draft(CaptureFacts.of_runner(runner), target, backend=backend, graph_shapes=graph_shapes)


def plan_draft(
    facts: CaptureFacts, target: GraphPlan, *, backend: str = "static", graph_shapes: str = "all"
) -> GraphPlan:
    """The drafter's graphs: ``draft_prefill`` (ragged, like a mixed batch) on the target's mixed
    capture sizes (a prefill after a decode step is ragged, so the uniform sizes would rarely fit
    exactly and only add graphs), and ``draft_decode`` FULL uniform graphs of the drafter's query length for
    ``1..max_num_seqs`` requests. Empty for drafters without graph shapes (ngram). ``backend`` as
    for :func:`plan_target` (a draft LM with Mamba layers gets no draft prefills on ``cuda``);
    ``graph_shapes`` too: other than ``all``, draft decodes only at the capture sizes, and with
    ``decode`` no draft prefill (ragged, like a mixed batch)."""
    check_graph_shapes(graph_shapes)
    if not facts.draft_shapes:
        return GraphPlan([], [], [])
    mamba = _records_mamba(backend, facts.draft_groups)
    max_reqs = facts.max_num_reqs
    notes: list[str] = []
    specs: list[GraphSpec] = []
    for shape in facts.draft_shapes:
        if shape.phase == DRAFT_PREFILL:
            if graph_shapes == "decode":
                continue
            if not facts.full_graph:
                notes.append(
                    f"attention backend {facts.attention!r} cannot run inside a FULL graph: "
                    "draft prefills run eagerly"
                )
                continue
            if mamba:
                notes.append(
                    "CUDA graphs cannot record the ragged scan (host lists) of the draft model's "
                    "Mamba layers: draft prefills run eagerly"
                )
                continue
            for size in target.capture_sizes:
                cap = min(size, max_reqs)
                specs.append(
                    GraphSpec(DRAFT_PREFILL, BatchDescriptor(CUDAGraphMode.FULL, size, cap), cap + 1)
                )
        elif shape.query_len is not None and _uniform_fits(mamba, shape.query_len, DRAFT_DECODE, notes):
            q = shape.query_len
            specs += [
                GraphSpec(DRAFT_DECODE, BatchDescriptor(CUDAGraphMode.FULL, q * n, n, q), n)
                for n in range(1, max_reqs + 1)
                if q * n <= facts.max_num_tokens and (graph_shapes == "all" or q * n in target.capture_sizes)
            ]
    return GraphPlan(specs, [], notes)
