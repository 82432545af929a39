"""The speculative setup that matters for a P/D transfer, and D's check that P has the same.

A decode instance whose drafter keeps KV (draft_model, eagle, eagle3, mtp, dflash) attends to the
drafter's KV of the prompt, which only a prefill instance running the same drafter writes (its
``kv_producer`` runs the drafter's prompt pass and proposes nothing). So P states its setup in its
side-channel metadata and D refuses a P whose setup differs, in either direction: reading drafter
KV of another drafter, or none at all, leaves the output right but drops acceptance (the reference
engine's seed bug). ngram keeps no KV, so it is the same setup as none. k does not matter: the
prompt's drafter KV is the same for every k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from warmcap.kv_transfer.params import KVTransferError

if TYPE_CHECKING:
    from warmcap.config import EngineConfig
    from warmcap.core.kv_spec import KVCacheGroup


@dataclass(frozen=True, slots=True)
class TransferSpeculation:
    """What a peer's drafter KV is: the method, its weights and its KV groups (empty without one)."""

    #: the model-based method (None without speculation or for ngram)
    method: str | None
    #: the draft model or head directory as configured (None: the method's default weights)
    model: str | None
    drafter_groups: tuple[str, ...]
    #: the ``--spec`` as the user wrote it, for messages only (not compared)
    spec: str

    @classmethod
    def of(cls, config: EngineConfig, groups: list[KVCacheGroup]) -> TransferSpeculation:
        """This engine's setup, from its config and KV groups."""
        spec = config.speculative
        drafter_groups = tuple(sorted(g.name for g in groups if g.is_drafter))
        if spec is None or spec.entry.extra_lookahead is None:
            return cls(None, None, drafter_groups, "none" if spec is None else spec.short())
        return cls(spec.method, spec.model, drafter_groups, spec.short())

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "model": self.model,
            "drafter_groups": list(self.drafter_groups),
            "spec": self.spec,
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> TransferSpeculation:
        """A peer's setup; a peer that sends none (an older warmcap) has no drafter."""
        if data is None:
            return cls(None, None, (), "not stated")
        try:
            return cls(
                data["method"],
                data["model"],
                tuple(str(g) for g in data["drafter_groups"]),
                str(data["spec"]),
            )
        except (KeyError, TypeError) as exc:
            raise KVTransferError(f"{where} sent a malformed speculative setup ({exc!r})") from None

    def describe(self) -> str:
        if self.method is None:
            return f"--spec {self.spec} (no drafter KV)"
        return f"--spec {self.spec} (drafter KV groups {list(self.drafter_groups)})"


def check_same_speculation(mine: TransferSpeculation, theirs: TransferSpeculation, where: str) -> None:
    """Refuse (``KVTransferError``) a prefill instance whose drafter KV is not this decoder's."""
    key = (mine.method, mine.model, mine.drafter_groups)
    if key != (theirs.method, theirs.model, theirs.drafter_groups):
        raise KVTransferError(
            f"{where} runs {theirs.describe()} but this decode instance runs {mine.describe()}: "
            "its drafter's prompt KV does not match this drafter's; start the prefill server with "
            f"the same --spec as this one (kv_role kv_producer runs the drafter's prompt pass only)"
        )
