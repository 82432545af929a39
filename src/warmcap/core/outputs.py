"""What the scheduler hands the runner each step, and what comes back.

Warmup and serving build the same records; the only difference is who builds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from warmcap.sampling_params import SamplingParams

BlockIds = dict[str, list[int]]  # group name -> block ids


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (or one resumed after preemption): everything it needs."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: BlockIds
    num_computed_tokens: int
    # Tokens past the prompt that are already known (a request resumed after preemption).
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class CachedRequestData:
    """A request already in the runner's persistent batch: only what changed."""

    req_id: str
    new_block_ids: Mapping[str, list[int]]  # group name -> block ids appended (read-only)
    num_computed_tokens: int


@dataclass(slots=True, frozen=True)
class KVLoad:
    """A request whose leading tokens' KV is loaded from outside, starting this step.

    The request runs no forward until the runner reports it in ``ModelRunnerOutput.finished_recving``.
    ``block_ids`` are the request's blocks (all groups); ``num_local_tokens`` leading tokens are
    already here (prefix-cache hits), the next ``num_external_tokens`` are loaded.
    """

    block_ids: BlockIds
    num_local_tokens: int
    num_external_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step: which requests run, how many tokens each, which drafts to verify."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # req_id -> draft tokens to verify this step (scheduled tokens = 1 + len(drafts) for a decode).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Lookahead the drafter may write this step, per request (0 on a P/D consumer's loading step).
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)
    # req_id -> KV loads starting this step (P/D consumer); these requests are not scheduled.
    kv_loads: dict[str, KVLoad] = field(default_factory=dict)
    # What a KV connector's worker side needs this step, built by its scheduler side (opaque here).
    kv_connector_metadata: object | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step produced, per scheduled request (in ``req_ids`` order).

    ``sampled_token_ids[i]`` holds the accepted draft tokens plus the one sampled token (empty for a
    prompt chunk that does not reach the end of the prompt). ``draft_token_ids`` are proposals for
    the next step.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # Requests whose external KV load (``SchedulerOutput.kv_loads``) has completed.
    finished_recving: set[str] = field(default_factory=set)
    # Finished requests whose blocks a producer kept until its peer read them, now read.
    finished_sending: set[str] = field(default_factory=set)
    # Requests whose external KV load failed, with the reason; the engine ends them with it.
    failed_recving: dict[str, str] = field(default_factory=dict)

    def by_request(self) -> dict[str, list[int]]:
        return dict(zip(self.req_ids, self.sampled_token_ids, strict=True))
