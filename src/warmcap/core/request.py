"""The scheduler's record of one request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from warmcap.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # P/D consumer: holds blocks for its loaded tokens and runs no forward until they have arrived.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


@dataclass(slots=True, eq=False)
class Request:
    """Prompt, outputs and progress of one request.

    ``num_computed_tokens`` counts tokens whose KV is written (and verified); ``spec_token_ids`` are
    the drafter's proposals for the next step, which never count as computed until accepted.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    # P/D consumer: tokens whose KV arrives from a remote prefill instead of being computed here.
    num_external_computed_tokens: int = 0
    # P/D: what a connector hands back for this request (a producer's block ids, engine id, ...).
    kv_transfer_params: dict | None = None
    num_encoder_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Async scheduling: tokens a step in flight may still add to the outputs (1 + its drafts per
    # sampling step), counted as known when the next step is scheduled (``core/scheduler.py``).
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus accepted output tokens (drafts excluded)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def in_decode(self) -> bool:
        """True when every known token but the last is computed (the next step samples)."""
        return self.num_computed_tokens >= self.num_tokens - 1

    @property
    def in_prompt(self) -> bool:
        """True while part of the prompt still has to be computed."""
        return self.num_computed_tokens < self.num_prompt_tokens
