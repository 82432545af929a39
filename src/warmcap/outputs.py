"""What a caller gets back for a request, in vLLM's shape: a ``RequestOutput`` holding one
``CompletionOutput`` per sample, and where a stop string ended its text."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Logprob:
    """One candidate token's log-probability under the model's raw distribution and its rank
    (1 = most likely), as vLLM reports it."""

    logprob: float
    rank: int
    decoded_token: str | None = None


#: Per generated token: ``{token_id: Logprob}`` for the sampled token and the top-N candidates.
SampleLogprobs = list[dict[int, Logprob]]
#: Per prompt position, as vLLM: None for the first (nothing precedes it), then ``{token_id: Logprob}``
#: for the prompt token and the top-N candidates there.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.monotonic``) and counters of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a prompt: ``index`` among the ``n`` samples, its text and tokens so far.

    ``stop_reason`` is the stop string or stop token id that ended it (None for EOS or length);
    ``logprobs`` is set when the request asked for them.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: SampleLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A prompt's progress so far: ``outputs`` holds one completion per sample (``n``).

    ``text``, ``token_ids``, ``finish_reason`` are the first completion's; ``new_token_ids`` are the
    tokens it gained in the step that produced this output. ``prompt_logprobs`` (when the request
    asked for them) is set once the whole prompt has been computed, in every later output.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = False
    new_token_ids: list[int] = field(default_factory=list)
    #: P/D: what the KV connector hands back (a prefill instance's block ids for the decode instance)
    kv_transfer_params: dict | None = None
    #: why the request ended early (a failed KV transfer); None for a request that ran
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass(frozen=True, slots=True)
class StopHit:
    """Where a stop string ended generation: tokens kept, text kept, the string matched."""

    num_tokens: int
    text: str
    stop: str
