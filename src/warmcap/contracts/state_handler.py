"""Model-specific per-step state plugged into the runner (Mamba state columns today).

The runner builds its handlers from its KV groups (an attention-only model has none) and calls each
at fixed points of a step; it knows nothing of what a handler tracks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from warmcap.contracts.metadata import AttentionMetadata


class StateHandler(Protocol):
    """Per-request state the runner keeps for some of its KV groups across steps."""

    def handles(self, group: str) -> bool:
        """Whether ``group``'s layers keep their state through this handler."""
        ...

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop finished or preempted requests."""
        ...

    def begin_step(
        self, req_ids: Sequence[str], block_tables: Mapping[str, torch.Tensor], num_drafts: Sequence[int]
    ) -> None:
        """Register the step's requests (step order), their block tables and draft counts."""
        ...

    def metadata(
        self, metas: dict[str, AttentionMetadata], *, static: bool = False
    ) -> dict[str, AttentionMetadata]:
        """``metas`` with this handler's groups' entries extended for the pass loaded now.
        ``static``: ``metas`` belong to a graph; the caller keeps the result and passes it back."""
        ...

    def finish_step(
        self, req_ids: Sequence[str], seq_lens: Sequence[int], sampled: Sequence[Sequence[int]]
    ) -> None:
        """After sampling and verification: commit what each request accepted."""
        ...

    def write_slots(self, group: str, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The writes a pass over ``meta`` makes in ``group``, as an audit record's
        ``(positions, slot_mapping)``."""
        ...
