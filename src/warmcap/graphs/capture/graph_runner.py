"""Serving through captured graphs: dispatch a pass, pad it into the graph's buffers, replay.

:class:`GraphRunner` is the runner's graph dispatcher
(:class:`~warmcap.runner_v2.collaborators.GraphDispatcher`), attached once with
``ModelRunner.attach_graphs``. The runner asks it first for every target step
(:meth:`GraphRunner.replay_step`) and every drafter pass (:meth:`GraphRunner.replay_draft`); None
means no graph fits and the runner runs the pass eagerly. A replay returns the output rows of the
real tokens, the graph's static auxiliary outputs and the graph's metadata, from which the runner
logs the pass's KV writes exactly as it logs an eager one.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from warmcap.graphs.capture.descriptors import BatchDescriptor, Dispatcher
from warmcap.graphs.capture.planning import DRAFTER, TARGET
from warmcap.graphs.capture.static_inputs import DraftInputs
from warmcap.runner_v2.collaborators import GraphReplay

if TYPE_CHECKING:
    import torch

    from warmcap.graphs.capture.capturer import CapturedGraph
    from warmcap.graphs.capture.subjects import GraphSubject
    from warmcap.runner_v2.collaborators import DraftPass
    from warmcap.runner_v2.input_batch import StepInputs


class GraphRunner:
    """Replays captured graphs for the passes they fit; counts replays per graph.

    Graphs are grouped per subject by the subject's dispatch key (all target graphs together, the
    drafter's per phase). ``replays`` counts target replays per descriptor, ``draft_replays``
    drafter replays per ``(phase, descriptor)``; ``eager_steps`` / ``eager_draft_passes`` count
    what no graph fitted.
    """

    def __init__(self, subjects: dict[str, GraphSubject[Any]], graphs: list[CapturedGraph]) -> None:
        self.subjects = subjects
        #: (subject, dispatch key) -> descriptor -> graph
        self._graphs: dict[tuple[str, str], dict[BatchDescriptor, CapturedGraph]] = {}
        for g in graphs:
            key = (g.spec.subject, subjects[g.spec.subject].dispatch_key(g.spec.phase))
            self._graphs.setdefault(key, {})[g.spec.descriptor] = g
        self._dispatchers = {key: Dispatcher(graphs) for key, graphs in self._graphs.items()}
        #: replays per (subject, phase, descriptor), and passes no graph fitted per subject
        self._replays: Counter[tuple[str, str, BatchDescriptor]] = Counter(
            {(g.spec.subject, g.spec.phase, g.spec.descriptor): 0 for g in graphs}
        )
        self._eager: Counter[str] = Counter()
        #: per (graph, real tokens): its count key, the replay it returns (views of the graph's
        #: static outputs, the same every time) and replays not yet added to ``_replays``
        self._served: dict[tuple[int, int], list[Any]] = {}

    @property
    def replays(self) -> dict[BatchDescriptor, int]:
        """Target replays per descriptor."""
        return {d: n for (s, _, d), n in self._counts().items() if s == TARGET}

    @property
    def draft_replays(self) -> dict[tuple[str, BatchDescriptor], int]:
        """Drafter replays per ``(phase, descriptor)``."""
        return {(p, d): n for (s, p, d), n in self._counts().items() if s == DRAFTER}

    def _counts(self) -> Counter[tuple[str, str, BatchDescriptor]]:
        for served in self._served.values():
            if served[2]:
                self._replays[served[0]] += served[2]
                served[2] = 0
        return self._replays

    @property
    def eager_steps(self) -> int:
        return self._eager[TARGET]

    @property
    def eager_draft_passes(self) -> int:
        return self._eager[DRAFTER]

    def replay_step(self, step: StepInputs) -> GraphReplay | None:
        """A target step from a graph, or None to run it eagerly."""
        return self._replay(TARGET, "", step)

    def replay_draft(
        self, phase: str, dp: DraftPass, input_ids: torch.Tensor, features: torch.Tensor | None
    ) -> GraphReplay | None:
        """A drafter pass of ``phase`` from a graph, or None to run it eagerly."""
        return self._replay(DRAFTER, phase, DraftInputs(dp, input_ids, features))

    def _replay(self, name: str, phase: str, inputs: Any) -> GraphReplay | None:
        subject = self.subjects.get(name)
        if subject is None or inputs.num_reqs == 0:
            return None
        key = (name, subject.dispatch_key(phase))
        dispatcher = self._dispatchers.get(key)
        if dispatcher is None:
            return None
        descriptor = dispatcher.dispatch(subject.shape(phase, inputs))
        if descriptor is None:
            self._eager[name] += 1
            return None
        graph = self._graphs[key][descriptor]
        subject.load(graph.spec, inputs)
        graph.replay_fn()
        t = inputs.num_tokens
        served = self._served.get((id(graph), t))
        if served is None:
            replay = GraphReplay(graph.output[:t], [a[:t] for a in graph.aux], graph.metas)
            served = self._served[(id(graph), t)] = [(name, graph.spec.phase, descriptor), replay, 0]
        served[2] += 1
        return served[1]
