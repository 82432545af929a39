"""Which graphs a runner gets: target uniform-decode FULL graphs plus mixed graphs on the ladder,
then the drafter's ``draft_prefill`` (on the target's token counts) and ``draft_decode`` graphs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from warmcap.drafters.base import DRAFT_DECODE, DRAFT_PREFILL
from warmcap.graphs.descriptors import BatchDescriptor, CUDAGraphMode
from warmcap.graphs.sizes import default_capture_sizes, uniform_decode_sizes

if TYPE_CHECKING:
    from warmcap.runner_v2.model_runner import ModelRunner


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
        return f"{self.phase} {self.descriptor.label}"

    @property
    def is_draft(self) -> bool:
        """Whether this is a drafter pass (its static inputs are the drafter's, not the runner's)."""
        return self.phase in (DRAFT_PREFILL, DRAFT_DECODE)


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """Graphs to capture, the mixed-graph sizes used, and why anything was left out."""

    specs: list[GraphSpec]
    capture_sizes: list[int]
    notes: list[str]


def plan_target_graphs(runner: ModelRunner, *, capture_sizes: list[int] | None = None) -> GraphPlan:
    """Uniform-decode FULL graphs for ``1..max_num_seqs`` requests of ``1 + k`` tokens, then mixed
    graphs on ``capture_sizes`` (default ladder), all bounded by the runner's token buffers."""
    config = runner.config
    k = config.num_speculative_tokens
    q = config.uniform_decode_query_len
    max_reqs = runner.max_num_reqs
    max_tokens = runner.max_num_tokens
    notes: list[str] = []
    specs = [
        GraphSpec("decode", BatchDescriptor(CUDAGraphMode.FULL, n, n // q, q), n // q)
        for n in uniform_decode_sizes(max_reqs, k)
        if n <= max_tokens
    ]
    sizes = capture_sizes if capture_sizes is not None else default_capture_sizes(max_reqs, k)
    kept = [s for s in sizes if s <= max_tokens]
    if len(kept) < len(sizes):
        notes.append(
            f"capture sizes above the runner's {max_tokens}-token buffers were dropped: "
            f"{[s for s in sizes if s > max_tokens]}"
        )
    if not runner.attn_backend.supports_full_graph:
        # NOTE: PIECEWISE capture (graphs between attention calls) needs the model split at every
        # attention call; without it mixed batches stay eager rather than pretend to be captured.
        notes.append(
            f"attention backend {runner.attn_backend.name!r} cannot run inside a FULL graph: "
            "mixed prefill/decode batches run eagerly"
        )
        return GraphPlan(specs, [], notes)
    indexed = any(g.spec.kind == "indexer" for g in runner.kv_groups)
    phase = "sparse_mla" if indexed else "mixed"
    for size in kept:
        cap = min(size, max_reqs)
        specs.append(GraphSpec(phase, BatchDescriptor(CUDAGraphMode.FULL, size, cap), cap + 1))
    return GraphPlan(specs, kept, notes)


def plan_draft_graphs(runner: ModelRunner, target: GraphPlan) -> GraphPlan:
    """The drafter's graphs: ``draft_prefill`` (ragged, like a mixed batch) on the target's mixed
    capture sizes (a prefill after a decode step is ragged, so the uniform sizes would rarely fit
    exactly and only add graphs), and ``draft_decode`` FULL uniform graphs of the drafter's query length for
    ``1..max_num_seqs`` requests. Empty for drafters without graph shapes (ngram)."""
    drafter = runner.drafter
    shapes_of = getattr(drafter, "graph_shapes", None)
    shapes = shapes_of() if shapes_of is not None else []
    if not shapes or not drafter.graph_groups():
        return GraphPlan([], [], [])
    max_reqs = runner.max_num_reqs
    notes: list[str] = []
    specs: list[GraphSpec] = []
    for shape in shapes:
        if shape.phase == DRAFT_PREFILL:
            if not runner.attn_backend.supports_full_graph:
                notes.append(
                    f"attention backend {runner.attn_backend.name!r} cannot run inside a FULL graph: "
                    "draft prefills run eagerly"
                )
                continue
            for size in target.capture_sizes:
                cap = min(size, max_reqs)
                specs.append(
                    GraphSpec(DRAFT_PREFILL, BatchDescriptor(CUDAGraphMode.FULL, size, cap), cap + 1)
                )
        elif shape.query_len is not None:
            q = shape.query_len
            specs += [
                GraphSpec(DRAFT_DECODE, BatchDescriptor(CUDAGraphMode.FULL, q * n, n, q), n)
                for n in range(1, max_reqs + 1)
                if q * n <= runner.max_num_tokens
            ]
    return GraphPlan(specs, [], notes)
