"""What the NIXL connector's scheduler side tells its worker side each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from warmcap.kv_transfer.base import KVConnectorMetadata
from warmcap.kv_transfer.params import RemotePrefill


@dataclass(frozen=True, slots=True)
class ReadJob:
    """D: read ``remote``'s blocks into ``block_ids`` (this engine's, by group), skipping the first
    ``num_local_tokens`` tokens (prefix-cache hits already here)."""

    request_id: str
    remote: RemotePrefill
    block_ids: dict[str, list[int]]
    num_local_tokens: int
    num_external_tokens: int
    num_prompt_tokens: int


@dataclass(slots=True)
class NixlMetadata(KVConnectorMetadata):
    #: D: reads that start this step
    reads: list[ReadJob] = field(default_factory=list)
    #: P: finished requests whose blocks are kept for a reader, by id -> monotonic deadline
    sends: dict[str, float] = field(default_factory=dict)
    #: requests that finished or were aborted since the last step (a read of theirs must stop)
    stopped: set[str] = field(default_factory=set)
    #: D: P's requests whose blocks D will not read (nothing to load): P may free them now
    releases: list[RemotePrefill] = field(default_factory=list)
