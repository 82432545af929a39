"""Graph capture over static buffers: ``cuda`` records, ``static`` and ``compile`` don't.

Order (docs/graphs.md): one eager pass over every shape first (target and drafter), then capture
largest first into one shared memory pool, target graphs before drafter graphs. Capture inputs are
benign all-padding batches (every slot PAD, every row ``seq_len`` 0), so capture writes nothing
but the sink block. Each shape keeps the metadata objects of its eager pass: backends that plan
per metadata object (FlashInfer) find the plan the eager pass made.

What a graph records is its spec's *subject* (:mod:`warmcap.graphs.capture.subjects`): target graphs
output the final hidden states and, when the runner asks for them (EAGLE-3, DFlash), the auxiliary
hidden states of its ``aux_hidden_state_layers`` as further static outputs; drafter graphs run the
drafter model's ``forward_pass`` through the runner's draft executor, over the buffers it owns.

Mamba state columns are planned on the host per step (``runner_v2.mamba_state``): a shape's
metadata holds *static* ``MambaMetadata`` (made once), which every eager pass over it refills in
place, and which ``cuda`` refills before recording and before each replay (capture itself cannot
plan: planning reads device tensors on the host).

Backends:
- ``cuda``: ``torch.cuda.CUDAGraph`` per shape, one ``graph_pool_handle()`` pool; needs
  ``torch.cuda.is_available()`` and a runner on a CUDA device.
- ``static``: the same code path over the same static buffers without a CUDA graph; replay runs the
  eager forward on the static buffers and copies into the graph's static outputs, or, on CPU for
  a graph of up to :data:`RECORD_MAX_TOKENS` tokens, replays the recording of that forward's kernel
  calls (:mod:`warmcap.graphs.capture.cpu_program`; :meth:`GraphCapturer.why_not_recorded` says
  which graphs cannot). It proves the padding and buffer handling on any machine, not CUDA-graph
  speed. Its capture would be a second forward over the inputs of the eager pass: the graph keeps
  the outputs of that pass (recorded, where it records) as its static outputs instead (one
  forward per shape, not two). Those buffers are all an unrecorded ``static`` graph holds (every
  replay overwrites them before they are read), so when the caller holds the layout of every
  graph's outputs (``layouts``: a warm start's, from the start-up cache), they are allocated from
  it and only the recorded graphs run a forward (their recording); verification still replays
  (``graphs/startup.py``).
- ``compile``: ``torch.compile`` of the forward per shape over the static buffers (no graph).

Capture proves nothing: whether the graphs replay like eager, and would record under CUDA, is
:mod:`warmcap.graphs.proof`'s to say, and ``graphs/startup.py`` asks it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from warmcap.contracts.parallel import parallel_state
from warmcap.errors import ConfigError
from warmcap.graphs.capture.cpu_program import CpuProgram, Refused, record
from warmcap.graphs.capture.layouts import OutputLayout, allocate
from warmcap.graphs.capture.planning import (
    CaptureFacts,
    CapturePlan,
    GraphPlan,
    GraphSpec,
    check_backend,
    plan_capture,
)
from warmcap.graphs.capture.static_inputs import graph_metadata
from warmcap.graphs.capture.subjects import GraphSubject, Outputs, make_subjects
from warmcap.runner_v2.mamba_state import MambaMetadata

if TYPE_CHECKING:
    from collections.abc import Sequence

    from warmcap.config import EngineConfig
    from warmcap.contracts import AttentionMetadata
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.runner_v2.collaborators import DraftModel
    from warmcap.runner_v2.model_runner import ModelRunner


#: the largest pass a ``static`` graph records (:meth:`GraphCapturer.why_not_recorded`): its
#: intermediates stay allocated with the graph, and past decode sizes the Python a replay saves is
#: small beside the pass's arithmetic
RECORD_MAX_TOKENS = 32


def recording_note(graphs: Sequence[CapturedGraph]) -> str:
    """The report's line on which ``static`` CPU graphs replay a recorded program, and why the others
    do not (each reason once, with the graphs it holds for)."""
    recorded = [g for g in graphs if g.program is not None]
    line = f"static on CPU: {len(recorded)} of {len(graphs)} graphs replay a recorded program of kernel calls"
    if recorded:
        calls = sorted({len(g.program) for g in recorded if g.program is not None})
        span = f"{calls[0]}" if len(calls) == 1 else f"{calls[0]}-{calls[-1]}"
        line += f" ({span} calls a replay)"
    reasons: dict[str, list[str]] = {}
    for g in graphs:
        if g.program is None:
            reasons.setdefault(g.not_recorded, []).append(g.spec.label)
    for why, labels in reasons.items():
        shown = ", ".join(labels[:3]) + (f" and {len(labels) - 3} more" if len(labels) > 3 else "")
        line += f"; run the forward at each replay: {shown} ({why})"
    return line


def default_backend_for(device: torch.device) -> str:
    """The capture backend a start-up on ``device`` takes unless told: ``cuda`` on a CUDA device
    (when CUDA works), else ``static``."""
    return "cuda" if device.type == "cuda" and torch.cuda.is_available() else "static"


def planned_capture(
    config: EngineConfig,
    kv_groups: Sequence[KVCacheGroup],
    draft_model: DraftModel | None,
    *,
    device: torch.device,
    backend: str | None = None,
    capture_sizes: list[int] | None = None,
    graph_shapes: str = "all",
) -> CapturePlan:
    """The graphs a start-up of an assembled ``config`` on ``device`` captures (its KV groups, its
    drafter's model), with no runner and no weight: ``warmup plan --html`` draws these. The
    runner's attention backend is chosen as the engine chooses it; ``backend`` as
    ``capture_graphs`` takes it (default :func:`default_backend_for`)."""
    if config.model.enforce_eager:
        return CapturePlan.eager()
    from warmcap.runner_v2.attention.selector import select_backend

    attention = select_backend(
        device, name=config.model.attention_backend, batch_invariant=config.model.batch_invariant
    )
    facts = CaptureFacts.of_config(config, kv_groups, attention, draft_model)
    return plan_capture(
        facts,
        capture_sizes=capture_sizes,
        backend=backend or default_backend_for(device),
        graph_shapes=graph_shapes,
    )


@dataclass(slots=True)
class CapturedGraph:
    """One captured shape: its static metadata and outputs, and how to replay it."""

    spec: GraphSpec
    metas: dict[str, AttentionMetadata]
    output: torch.Tensor
    replay_fn: Callable[[], None]
    capture_seconds: float = 0.0
    memory_bytes: int = 0
    #: static auxiliary hidden states ``[num_tokens, H]`` (target graphs of EAGLE-3 / DFlash runners)
    aux: list[torch.Tensor] = field(default_factory=list)
    #: ``static`` on CPU: the recorded forward a replay runs (None: a replay runs the forward)
    program: CpuProgram | None = None
    #: ``static`` on CPU, when the forward was not recorded: why
    not_recorded: str = ""

    @property
    def layout(self) -> OutputLayout:
        """Shape and dtype of the static outputs (what a warm ``static`` capture allocates)."""
        return OutputLayout.of(self.output, self.aux)


@dataclass(slots=True)
class CaptureResult:
    """Every captured graph (target largest first, then drafter largest first), the plans, and the
    order things ran in."""

    plan: GraphPlan
    graphs: list[CapturedGraph]
    #: ``("eager" | "capture", label)`` in the order they ran
    order: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    draft_plan: GraphPlan = field(default_factory=lambda: GraphPlan([], [], []))


class GraphCapturer:
    """Captures the target graphs of ``runner`` and its drafter's graphs with one backend."""

    def __init__(
        self,
        runner: ModelRunner,
        backend: str = "cuda",
        *,
        capture_sizes: list[int] | None = None,
        drafter_graphs: bool = True,
        plan_backend: str | None = None,
        record: bool = True,
        graph_shapes: str = "all",
    ):
        check_backend(backend)
        if backend == "cuda" and not (torch.cuda.is_available() and runner.device.type == "cuda"):
            raise ConfigError(
                "graph backend 'cuda' needs a CUDA device and a runner on it; "
                f"runner is on {runner.device}: use backend 'static' on this machine"
            )
        self.runner = runner
        self.backend = backend
        #: whether ``static`` graphs on CPU record their forward (:meth:`why_not_recorded`)
        self.record = record
        self.capture_sizes = capture_sizes
        self.graph_shapes = graph_shapes
        # ``plan_backend``: capture the graphs another backend would (``static`` following the
        # ``cuda`` plan shows on CPU which steps a GPU run replays).
        planned = plan_capture(
            CaptureFacts.of_runner(runner),
            capture_sizes=capture_sizes,
            backend=plan_backend or backend,
            drafter_graphs=drafter_graphs,
            graph_shapes=graph_shapes,
        )
        self.plan = planned.target
        self.draft_plan = planned.draft
        self.subjects: dict[str, GraphSubject[Any]] = make_subjects(runner)
        self._metas: dict[str, dict[str, AttentionMetadata]] = {}
        self._pool: Any = torch.cuda.graph_pool_handle() if backend == "cuda" else None

    def subject(self, spec: GraphSpec) -> GraphSubject[Any]:
        """What ``spec`` records."""
        subject = self.subjects.get(spec.subject)
        if subject is None:
            raise ConfigError(f"{spec.label!r} records the {spec.subject}, which this runner does not have")
        return subject

    def load(self, spec: GraphSpec, inputs: Any | None = None) -> None:
        """Fill ``spec``'s static buffers with ``inputs`` (default: all padding) in its shape: a
        ``StepInputs`` for a target graph, a :class:`~warmcap.graphs.capture.subjects.DraftInputs` for a
        drafter graph."""
        self.subject(spec).load(spec, inputs)

    def metadata(self, spec: GraphSpec) -> dict[str, AttentionMetadata]:
        """``spec``'s fixed metadata over its static buffers (made once, right after a load), Mamba
        groups' entries included (static: refilled in place for whatever is loaded)."""
        metas = self._metas.get(spec.label)
        if metas is None:
            buffers = self.subject(spec).buffers
            metas = self.refresh_states(spec, graph_metadata(buffers, spec, self.runner.max_model_len))
            self._metas[spec.label] = metas
        return metas

    def refresh_states(
        self, spec: GraphSpec, metas: dict[str, AttentionMetadata]
    ) -> dict[str, AttentionMetadata]:
        """State columns of the pass loaded in ``spec``'s buffers, written into ``metas``' static
        entries in place (plain entries become static ones: keep the returned dict)."""
        return self.subject(spec).refresh(spec, metas)

    def forward(self, spec: GraphSpec, metas: dict[str, AttentionMetadata]) -> Outputs:
        """Output and auxiliary outputs of one eager pass over the loaded static buffers."""
        return self.subject(spec).forward(spec, metas)

    @torch.inference_mode()
    def capture(
        self,
        on_graph: Callable[[int, int, str], None] | None = None,
        *,
        layouts: Mapping[str, OutputLayout] | None = None,
    ) -> CaptureResult:
        """Eager pass over every shape, then capture largest first (target, then drafter);
        ``on_graph(done, total, label)`` is called after each capture (start-up progress).
        ``layouts`` (``static`` only, used when it has every graph's): the outputs' layouts of an
        earlier identical start, allocated instead of running any forward."""
        result = CaptureResult(
            self.plan, [], notes=[*self.plan.notes, *self.draft_plan.notes], draft_plan=self.draft_plan
        )
        specs = [*self.plan.specs, *self.draft_plan.specs]
        if self.backend != "static" or (layouts is not None and any(s.label not in layouts for s in specs)):
            layouts = None
        eager_outputs: dict[str, Outputs] = {}
        recordings: dict[str, CpuProgram | Refused] = {}
        if layouts is None:
            for spec in specs:
                self.load(spec)
                metas = self.metadata(spec)
                if self.backend == "static" and not self.why_not_recorded(spec, metas):
                    # The eager pass is the recording (``static`` runs one forward per shape).
                    outputs, recordings[spec.label] = self._record(spec, metas)
                else:
                    outputs = self.forward(spec, metas)
                if self.backend == "static":
                    eager_outputs[spec.label] = outputs
                result.order.append(("eager", spec.label))
            self._sync()
        for group in (self.plan.specs, self.draft_plan.specs):
            for spec in sorted(group, key=lambda s: (s.num_tokens, s.rows), reverse=True):
                graph = self._capture_one(
                    spec,
                    eager_outputs.pop(spec.label, None),
                    None if layouts is None else layouts[spec.label],
                    recordings.pop(spec.label, None),
                )
                result.graphs.append(graph)
                result.order.append(("capture", spec.label))
                if on_graph is not None:
                    on_graph(len(result.graphs), len(specs), spec.label)
        if self.backend == "static" and self.runner.device.type == "cpu":
            result.notes.append(recording_note(result.graphs))
        return result

    def _capture_one(
        self,
        spec: GraphSpec,
        eager_outputs: Outputs | None = None,
        layout: OutputLayout | None = None,
        recorded: CpuProgram | Refused | None = None,
    ) -> CapturedGraph:
        """Capture ``spec``. ``static`` only: ``eager_outputs``, its eager pass's outputs, kept as the
        static outputs instead of running the same forward again, and ``recorded``, that pass's
        recording when it was recorded; or ``layout``, the cached layout of those outputs,
        allocated (zeroed) without any forward unless the graph records (then its forward is
        recorded here)."""
        runner = self.runner
        self.load(spec)
        metas = self.metadata(spec)
        backend = runner.attn_backend
        program: CpuProgram | None = None
        why_not = ""
        self._sync()
        start = time.perf_counter()
        if self.backend == "cuda":
            free_before = torch.cuda.mem_get_info(runner.device)[0]
            graph = torch.cuda.CUDAGraph()
            self.refresh_states(spec, metas)
            backend.prepare_for_capture(metas)
            with torch.cuda.graph(graph, pool=self._pool):
                output, aux = self.forward(spec, metas)
            self._sync()
            memory = max(0, free_before - torch.cuda.mem_get_info(runner.device)[0])

            def replay() -> None:
                # The recorded graph reads the static Mamba block tensors: refill them first.
                self.refresh_states(spec, metas)
                backend.prepare_for_replay(metas)
                graph.replay()

        else:
            forward = self._compiled(spec, metas) if self.backend == "compile" else None
            backend.prepare_for_capture(metas)
            why_not = self.why_not_recorded(spec, metas)
            if not why_not and (recorded is None or eager_outputs is None):
                eager_outputs, recorded = self._record(spec, metas)
            if isinstance(recorded, Refused):
                why_not = recorded.reason
            elif recorded is not None:
                program = recorded
            if eager_outputs is not None:
                output, aux = eager_outputs
            elif layout is not None and forward is None:
                output, aux = allocate(layout, runner.device)
            else:
                output, aux = forward() if forward is not None else self.forward(spec, metas)
            memory = sum(t.numel() * t.element_size() for t in (output, *aux))
            if program is not None:
                # The recording's intermediates stay allocated with it (the outputs among them).
                memory = max(memory, program.scratch_bytes)
                recorded_program = program

                def replay() -> None:
                    backend.prepare_for_replay(metas)
                    recorded_program.replay()

            else:

                def replay() -> None:
                    backend.prepare_for_replay(metas)
                    new, new_aux = forward() if forward is not None else self.forward(spec, metas)
                    output.copy_(new)
                    for static, fresh in zip(aux, new_aux, strict=True):
                        static.copy_(fresh)

        seconds = time.perf_counter() - start
        return CapturedGraph(spec, metas, output, replay, seconds, memory, aux, program, why_not)

    def _record(
        self, spec: GraphSpec, metas: dict[str, AttentionMetadata]
    ) -> tuple[Outputs, CpuProgram | Refused]:
        """One forward of ``spec``, recorded (:func:`.cpu_program.record`): its outputs are the
        graph's, and the program recomputes them in place."""
        # Attention plans are derived inside the recording, so replays rederive them.
        self.runner.attn_backend.prepare_for_capture(metas)
        return record(lambda: self.forward(spec, metas))

    def why_not_recorded(self, spec: GraphSpec, metas: Mapping[str, AttentionMetadata]) -> str:
        """Why ``spec``'s forward is not recorded (:mod:`.cpu_program`) but run again at each replay
        ('' when it is recorded): only ``static`` graphs on CPU record, up to
        :data:`RECORD_MAX_TOKENS` tokens; never with Mamba state columns (planned on the host before
        each pass), nor on tensor-parallel ranks whose all-reduces are not the shared-memory one in C
        (gloo's synchronise on the host)."""
        if self.backend != "static" or self.runner.device.type != "cpu":
            return f"the {self.backend} backend on {self.runner.device.type} does not record CPU programs"
        if not self.record:
            return "recording is off (--no-record-cpu-graphs)"
        if spec.num_tokens > RECORD_MAX_TOKENS:
            return f"{spec.num_tokens} tokens, past the recording limit of {RECORD_MAX_TOKENS}"
        comm = parallel_state().comm
        if self.runner.config.tensor_parallel_size > 1 and (comm is None or not comm.replayable):
            return "tensor-parallel ranks synchronise their all-reduces on the host (gloo: only the shared-memory all-reduce in C records)"
        if any(isinstance(m, MambaMetadata) for m in metas.values()):
            return "Mamba state columns are planned on the host before each pass"
        return ""

    def _compiled(self, spec: GraphSpec, metas: dict[str, AttentionMetadata]) -> Callable[[], Outputs]:
        return torch.compile(lambda: self.forward(spec, metas), dynamic=False, fullgraph=False)

    def _sync(self) -> None:
        if self.backend == "cuda":
            torch.cuda.synchronize(self.runner.device)
