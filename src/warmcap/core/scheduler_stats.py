"""What the scheduler reports: per-request results of a step and running counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from warmcap.core.kv_cache_manager import KVCacheStats


@dataclass(frozen=True, slots=True)
class RequestStepOutput:
    """Tokens one request gained in a step, and whether it finished (and why)."""

    req_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS or stop token) or "length"
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class SpecDecodeCounters:
    """Speculative decoding totals: mean acceptance length = 1 + accepted / drafts."""

    num_drafts: int = 0  # verify steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A point-in-time view of the scheduler and its KV cache."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    spec_decode: SpecDecodeCounters = field(default_factory=SpecDecodeCounters)
    kv_cache: KVCacheStats | None = None
