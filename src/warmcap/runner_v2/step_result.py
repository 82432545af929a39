"""A step the runner has run whose tokens may still be on their way to the host.

Async scheduling (``SchedulerConfig.async_scheduling``) keeps one step in flight: the engine
schedules step N+1 and launches it before it reads step N's tokens, so the host's scheduling and
output work overlaps the device's. The runner returns each step as a :class:`StepResult`: what
the step computed on the device (logits, prompt logprobs) now, its sampled tokens through a
:class:`~warmcap.runner_v2.host_copy.PendingCopy` read once, by :meth:`StepResult.result`, or by
the runner itself at the start of the next step, whichever comes first. Reading them applies them
to the persistent batch (the next step's inputs are built after them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from warmcap.core.outputs import ModelRunnerOutput
from warmcap.runner_v2.host_copy import PendingCopy
from warmcap.runner_v2.prompt_logprobs import PromptLogprobsPart
from warmcap.runner_v2.rejection import Verified


@dataclass(slots=True)
class PendingTokens:
    """A step's sampled tokens being copied to the host, and how to read them.

    ``verified``: the copy holds a verify step's (tokens, accepted counts); ``flag``: its last part
    is a device flag (the greedy head's "a row declined", or the full path's "all finite"; on CPU
    the full path's float row sums, all finite or not);
    ``samples``: per request whether it sampled (None: every request did).
    """

    copy: PendingCopy
    verified: bool
    flag: bool
    samples: list[bool] | None
    #: the sampled tokens on the device, one a sampling request (None: a verify step's)
    device_tokens: torch.Tensor | None = None

    def read(self) -> tuple[list[list[int]], bool | None]:
        """Each request's tokens (``[]`` for one that sampled nothing) and the flag's value."""
        host = self.copy.wait()
        value = _flag_value(host[-1]) if self.flag else None
        produced = Verified.emit(host[0], host[1]) if self.verified else [[t] for t in host[0].tolist()]
        return spread(produced, self.samples), value


def _flag_value(part: torch.Tensor) -> bool:
    if part.is_floating_point():
        # The full path's row sums, on the host: finite iff every row's is.
        return all(map(math.isfinite, part.tolist()))
    return bool(part)


def spread(produced: list[list[int]], samples: list[bool] | None) -> list[list[int]]:
    """``produced`` (one list per sampling request) placed among the step's requests."""
    if samples is None:
        return produced
    it = iter(produced)
    return [next(it) if s else [] for s in samples]


@dataclass(slots=True)
class TokenFeed:
    """The sampled tokens of a step in flight, kept on the device for the next step's inputs.

    ``rows``: the persistent-batch rows that sampled one token each, in ``tokens`` order;
    ``positions``: where each row's token goes (its length before the step); the host batch holds
    a placeholder (-1) there until the step is read. ``index``: row -> position in ``tokens``.
    """

    rows: np.ndarray
    positions: np.ndarray
    tokens: torch.Tensor
    index: np.ndarray


@dataclass(slots=True)
class StepResult:
    """One executed step: ``result()`` is its :class:`ModelRunnerOutput`.

    ``logits``: the step's sampling logits (None when the greedy head argmaxed without them);
    ``logits_finite``: whether every row of them is finite (known once the tokens are read);
    ``nonfinite_req_ids``: requests the greedy head found a non-finite row for, in a step whose
    tokens were read late (those requests must fail; their token is a stand-in);
    ``prompt_logprobs``: per request, what the step computed (None or empty: none).
    """

    step: object | None = None
    #: set when the step's tokens feed the next step on the device (async, no drafts)
    feed: TokenFeed | None = None
    logits: torch.Tensor | None = None
    logits_finite: bool | None = None
    nonfinite_req_ids: Sequence[str] = ()
    prompt_logprobs: Mapping[str, PromptLogprobsPart] | None = None
    _output: ModelRunnerOutput | None = None
    _finish: Callable[[StepResult], ModelRunnerOutput] | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> StepResult:
        return cls(_output=output)

    @property
    def pending(self) -> bool:
        """Whether the tokens have not been read yet."""
        return self._output is None

    def result(self) -> ModelRunnerOutput:
        """The step's output with its tokens on the host (read now if still in flight)."""
        if self._output is None:
            assert self._finish is not None
            finish, self._finish = self._finish, None
            self._output = finish(self)
        return self._output
