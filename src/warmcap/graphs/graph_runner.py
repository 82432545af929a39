"""Serving through captured graphs: dispatch a step, pad it into the graph's buffers, replay.

The runner calls :meth:`GraphRunner.forward` with the step's host inputs; ``None`` means no graph
fits and the runner runs its eager path. The hook in ``ModelRunner.execute_model`` is::

    hidden = self.graph_runner.forward(step) if self.graph_runner is not None else None

placed before the eager ``copy_from`` / ``forward_batch``, which then run only when ``hidden is None``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from warmcap.graphs.descriptors import BatchDescriptor, BatchShape, Dispatcher
from warmcap.graphs.static_inputs import load_padded

if TYPE_CHECKING:
    import torch

    from warmcap.graphs.capture import CapturedGraph
    from warmcap.runner_v2.input_batch import StepInputs
    from warmcap.runner_v2.model_runner import ModelRunner


def step_shape(step: StepInputs) -> BatchShape:
    """The dispatch shape of a step. A request is decoding when every token it runs samples (the
    sampled token plus its drafts); a prompt chunk samples at most its last token."""
    all_decode = bool(np.array_equal(step.num_logits, step.num_scheduled))
    lens = step.num_scheduled
    uniform = int(lens[0]) if len(lens) and bool((lens == lens[0]).all()) else None
    return BatchShape(step.num_tokens, step.num_reqs, step.max_query_len, all_decode, uniform)


class GraphRunner:
    """Replays captured graphs for the steps they fit; counts replays per graph."""

    def __init__(self, runner: ModelRunner, graphs: list[CapturedGraph]) -> None:
        self.runner = runner
        self.graphs: dict[BatchDescriptor, CapturedGraph] = {g.spec.descriptor: g for g in graphs}
        self.dispatcher = Dispatcher(self.graphs)
        self.replays: dict[BatchDescriptor, int] = dict.fromkeys(self.graphs, 0)
        self.eager_steps = 0

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
        return graph.output[: step.num_tokens]
