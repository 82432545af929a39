"""The model runner of one tensor-parallel rank.

It is a :class:`~warmcap.runner_v2.model_runner.ModelRunner` over the rank's model shard and KV
tensors (its heads) with two additions:

- on rank 0 each step is first broadcast as a :class:`~warmcap.distributed.channel.Step` command, so
  the workers run the same ``SchedulerOutput``; everything that calls ``execute_model`` on the
  engine's runner (serving, warmup, releasing rows) drives every rank without knowing about TP;
- after sampling, rank 0's tokens (sampled and accepted drafts) are broadcast and every rank keeps
  them, so each persistent batch appends the same tokens and seeded or random sampling is exactly
  TP=1's (only rank 0's generators decide).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from warmcap.core.outputs import SchedulerOutput
from warmcap.distributed.channel import CommandChannel, Step
from warmcap.runner_v2.input_batch import StepInputs
from warmcap.runner_v2.model_runner import ModelRunner
from warmcap.runner_v2.step_result import StepResult


class TPModelRunner(ModelRunner):
    """A :class:`ModelRunner` that keeps its rank in step with the others (see the module docstring).

    ``guard`` (rank 0 only): a context manager factory wrapped around every step rank 0 announces;
    it refuses steps once the group has failed and turns a failure into an error naming the rank.
    """

    def __init__(
        self,
        *args: Any,
        channel: CommandChannel,
        guard: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.channel = channel
        self.guard = guard or contextlib.nullcontext

    def _run(self, sched_out: SchedulerOutput, *, defer: bool) -> StepResult:
        """Run one step on every rank; rank 0 announces it unless the ranks are in lockstep."""
        if not self.channel.is_driver or self.channel.lockstep:
            return super()._run(sched_out, defer=defer)
        with self.guard():
            self.channel.share(Step(sched_out))
            return super()._run(sched_out, defer=defer)

    def _sample(self, hidden: torch.Tensor, step: StepInputs, *, defer: bool = False) -> list[list[int]]:
        # Every rank computes the gathered logits (the LM head's all-gather needs all of them), but
        # only rank 0's tokens are kept; they are read within the step (no async scheduling here).
        return self.channel.share(super()._sample(hidden, step))
