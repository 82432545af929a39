"""A record of every slot mapping a forward pass used, for the warmup audit (invariant I2).

Recording copies each slot mapping to the host, so it is off while serving; warmup turns it on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class KVWriteRecord:
    """The slots one pass wrote in one KV group.

    ``query_start_loc`` has ``len(req_ids) + 1`` entries over the real tokens; ``positions`` and
    ``slot_mapping`` (host int64) cover the whole (possibly padded) pass, so every entry at or past
    ``query_start_loc[-1]`` must be PAD. ``block_ids`` is the runner's view of the blocks each request
    held in this group at that step, and ``step`` counts the runner's ``execute_model`` calls.
    """

    phase: str
    group: str
    req_ids: list[str]
    query_start_loc: list[int]
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    step: int = 0
    block_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class KVWriteLog:
    """Records appended in pass order; ``phase`` is ``target`` for the target model, drafters add
    ``draft_prefill`` / ``draft_step_N``."""

    records: list[KVWriteRecord] = field(default_factory=list)

    #: whether passes are being recorded (the runner's ``recording_kv_writes`` turns it on)
    recording: bool = False

    def add(self, record: KVWriteRecord) -> None:
        self.records.append(record)

    def add_pass(
        self,
        phase: str,
        *,
        step: int,
        req_ids: Sequence[str],
        query_start_loc: Sequence[int],
        block_ids: Mapping[str, Mapping[str, list[int]]],
        writes: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Record one pass: per group, ``writes[group]`` is its host ``(positions, slot_mapping)``
        over the whole (padded) pass and ``block_ids[group]`` the blocks each request held."""
        for group, (positions, slots) in writes.items():
            self.records.append(
                KVWriteRecord(
                    phase=phase,
                    group=group,
                    req_ids=list(req_ids),
                    query_start_loc=list(query_start_loc),
                    positions=positions,
                    slot_mapping=slots,
                    step=step,
                    block_ids=dict(block_ids[group]),
                )
            )

    def clear(self) -> None:
        self.records.clear()

    def by_phase(self, phase: str) -> list[KVWriteRecord]:
        return [r for r in self.records if r.phase == phase]

    def __len__(self) -> int:
        return len(self.records)
