"""Per-request sampling settings (the fields users of vLLM know), checked when built."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum

import numpy as np

from warmcap.errors import ConfigError


def _is_int(value: object) -> bool:
    # NOTE: bool is a subclass of int; True is not a token count. numpy integers are integers.
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_number(value: object) -> bool:
    return (
        isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)
    )


class RequestOutputKind(IntEnum):
    """Which outputs the engine's steps return for a request (vLLM's values and meanings).

    ``CUMULATIVE``: after every step that gave it tokens, its text and tokens so far. ``DELTA``:
    after every such step, only what that step added (tokens, text, logprobs; prompt logprobs once);
    text that a later token may still change (an incomplete character, the start of a possible stop
    string) waits for the output that settles it. ``FINAL_ONLY``: one output, when it finishes (what
    ``LLM.generate`` asks for): its steps build no output and, without stop strings, decode no text
    until then.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature=0`` is greedy.

    vLLM's meanings: ``top_k`` 0 or -1 is off; ``n`` independent samples per prompt (a seeded
    request's i-th sample uses ``seed + i``); ``stop`` strings end generation at their first
    occurrence (excluded from the text unless ``include_stop_str_in_output``), finish reason "stop";
    ``logprobs`` N returns, per generated token, the sampled token's and the N most likely tokens'
    log-probabilities under the model's raw distribution; ``prompt_logprobs`` N returns, per prompt
    position after the first, the prompt token's and the N most likely tokens' log-probabilities
    (computed while the prompt is prefilled; such a request reads no cached prefix, as vLLM's
    V1 engine skips the prefix cache for it, since cached positions would have no logits); ``min_tokens`` tokens are generated before
    EOS, ``stop_token_ids`` or a stop string may end the request; ``repetition_penalty`` divides
    positive (multiplies negative) logits of tokens in the prompt or output, ``presence_penalty`` and
    ``frequency_penalty`` subtract per output token seen (once, or per occurrence);
    ``output_kind`` which outputs :meth:`LLMEngine.step` returns for it (:class:`RequestOutputKind`).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: ``stop_token_ids`` plus the model's EOS unless ``ignore_eos``: the tokens ``min_tokens`` holds
    #: back. The engine fills it (:meth:`with_eos`) when it queues a request.
    all_stop_token_ids: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop):
            stop = tuple(stop)
        else:
            raise ConfigError(f"stop must be a string or a list of strings; got {self.stop!r}")
        stop_ids = self.stop_token_ids
        if not isinstance(stop_ids, Sequence) or isinstance(stop_ids, str):
            raise ConfigError(f"stop_token_ids must be a list of token ids; got {stop_ids!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids))
        object.__setattr__(self, "all_stop_token_ids", self.stop_token_ids)
        kind = self.output_kind
        if isinstance(kind, str) and kind.upper() in RequestOutputKind.__members__:
            kind = RequestOutputKind[kind.upper()]
        elif _is_int(kind) and kind in tuple(RequestOutputKind):
            kind = RequestOutputKind(kind)
        else:
            raise ConfigError(
                f"output_kind must be one of {', '.join(k.name.lower() for k in RequestOutputKind)} "
                f"(a RequestOutputKind, its name or its value); got {kind!r}"
            )
        object.__setattr__(self, "output_kind", kind)
        for ok, message in self._checks():
            if not ok:
                raise ConfigError(message)

    def _checks(self) -> list[tuple[bool, str]]:
        t, k, p, mp = self.temperature, self.top_k, self.top_p, self.min_p
        mt, mn, lp, plp = self.max_tokens, self.min_tokens, self.logprobs, self.prompt_logprobs
        return [
            (_is_number(t) and t >= 0, f"temperature must be a finite number >= 0 (0 is greedy); got {t!r}"),
            (_is_int(k) and k >= -1, f"top_k must be an integer >= -1 (0 or -1 disables it); got {k!r}"),
            (_is_number(p) and 0.0 < p <= 1.0, f"top_p must be a number in (0, 1]; got {p!r}"),
            (_is_number(mp) and 0.0 <= mp <= 1.0, f"min_p must be a number in [0, 1]; got {mp!r}"),
            (self.seed is None or _is_int(self.seed), f"seed must be an integer or None; got {self.seed!r}"),
            (_is_int(mt) and mt >= 1, f"max_tokens must be an integer >= 1; got {mt!r}"),
            (
                all(_is_int(i) and i >= 0 for i in self.stop_token_ids),
                f"stop_token_ids must be non-negative integers; got {list(self.stop_token_ids)!r}",
            ),
            (isinstance(self.ignore_eos, bool), f"ignore_eos must be True or False; got {self.ignore_eos!r}"),
            (_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1; got {self.n!r}"),
            (all(self.stop), f"stop strings must not be empty; got {list(self.stop)!r}"),
            (
                isinstance(self.include_stop_str_in_output, bool),
                f"include_stop_str_in_output must be True or False; got {self.include_stop_str_in_output!r}",
            ),
            (
                lp is None or (_is_int(lp) and lp >= 0),
                f"logprobs must be None or an integer >= 0; got {lp!r}",
            ),
            (
                plp is None or (_is_int(plp) and plp >= 0),
                f"prompt_logprobs must be None or an integer >= 0; got {plp!r}",
            ),
            (_is_int(mn) and mn >= 0, f"min_tokens must be an integer >= 0; got {mn!r}"),
            (
                not (_is_int(mn) and _is_int(mt)) or mn <= mt,
                f"min_tokens ({mn}) must not exceed max_tokens ({mt})",
            ),
            (
                _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
                f"repetition_penalty must be a finite number > 0 (1 is off); got {self.repetition_penalty!r}",
            ),
            (
                _is_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be a number in [-2, 2] (0 is off); got {self.presence_penalty!r}",
            ),
            (
                _is_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be a number in [-2, 2] (0 is off); got {self.frequency_penalty!r}",
            ),
        ]

    def with_eos(self, eos_token_id: int | None) -> SamplingParams:
        """A copy whose ``all_stop_token_ids`` include ``eos_token_id`` (unless ``ignore_eos``)."""
        params = replace(self)
        eos = () if eos_token_id is None or self.ignore_eos else (eos_token_id,)
        object.__setattr__(params, "all_stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids + eos)))
        return params

    def for_sample(self, index: int) -> SamplingParams:
        """The settings of this prompt's ``index``-th of ``n`` samples: one sample each, a seed moved
        on by the index so the samples differ (as vLLM seeds parallel samples). Every surface that
        fans ``n`` out (``LLM.generate``, the server) queues these."""
        if self.n == 1:
            return self
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
