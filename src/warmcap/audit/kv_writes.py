"""The KV-write audit (invariant I2): every slot written is PAD or inside a block the request holds.

It checks the slot mappings the runner recorded (target and drafter passes, every KV group)
against the blocks the allocator says each request holds at that step — the allocator, not the
runner's own block table, is the authority, so a stale or over-long table row is caught too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from warmcap.errors import WarmcapError
from warmcap.runner_v2.kv_writes import KVWriteRecord

PAD = -1
HeldBlocks = Mapping[str, Mapping[str, list[int]]]  # req_id -> group -> block ids


class AuditViolationError(WarmcapError):
    """A pass wrote KV outside the blocks a request holds (invariant I2): at start-up (warmup) or,
    with ``audit_serving``, during a serving step."""


@dataclass(frozen=True, slots=True)
class Violation:
    """One stray write: where it happened and which slot/block it hit."""

    step: str
    phase: str
    request: str
    group: str
    position: int
    slot: int
    block: int
    reason: str

    def __str__(self) -> str:
        return (
            f"step {self.step} [{self.phase}] {self.request} group {self.group}: position {self.position} "
            f"-> slot {self.slot} (block {self.block}): {self.reason}"
        )


@dataclass(slots=True)
class AuditResult:
    """Counts for the report plus every violation record."""

    steps: int = 0
    passes: int = 0
    slots_checked: int = 0
    violations: list[Violation] = field(default_factory=list)
    #: False: the run was not audited (``--no-audit``), so the counts say nothing
    enabled: bool = True

    @property
    def ok(self) -> bool:
        return not self.violations

    def merge(self, other: AuditResult) -> None:
        self.steps += other.steps
        self.passes += other.passes
        self.slots_checked += other.slots_checked
        self.violations.extend(other.violations)

    def summary(self) -> str:
        if not self.enabled:
            return "audit off: no KV write was checked"
        verdict = "clean" if self.ok else f"{len(self.violations)} VIOLATION(S)"
        return f"{self.steps} steps, {self.passes} passes, {self.slots_checked} slots checked: {verdict}"

    def describe(self, max_samples: int = 3) -> str:
        """The count and the first violations on one line (each names request, group, position,
        slot and block)."""
        first = "; ".join(str(v) for v in self.violations[:max_samples])
        more = len(self.violations) - max_samples
        tail = f"; and {more} more" if more > 0 else ""
        return f"{len(self.violations)} stray KV write(s): {first}{tail}"

    def to_json(self, max_samples: int = 20) -> dict:
        return {
            "enabled": self.enabled,
            "steps": self.steps,
            "passes": self.passes,
            "slots_checked": self.slots_checked,
            "violations": len(self.violations),
            "violation_samples": [str(v) for v in self.violations[:max_samples]],
        }


def audit_records(
    step: str,
    records: Iterable[KVWriteRecord],
    held: HeldBlocks,
    block_sizes: Mapping[str, int],
) -> AuditResult:
    """Audit one step's passes. ``held`` is what the allocator gave each request in each group."""
    result = AuditResult(steps=1)
    for rec in records:
        result.passes += 1
        bs = block_sizes[rec.group]
        slots = rec.slot_mapping.to(torch.int64)
        positions = rec.positions.to(torch.int64)
        qsl = rec.query_start_loc
        for i, req_id in enumerate(rec.req_ids):
            lo, hi = qsl[i], qsl[i + 1]
            if hi <= lo:
                continue
            ids = held.get(req_id, {}).get(rec.group)
            if ids is None:
                result.violations.append(
                    Violation(
                        step,
                        rec.phase,
                        req_id,
                        rec.group,
                        -1,
                        -1,
                        -1,
                        "request holds no blocks in this group",
                    )
                )
                continue
            result.slots_checked += hi - lo
            _check_request(result, step, rec, req_id, ids, slots[lo:hi], positions[lo:hi], bs)
        tail = slots[qsl[-1] :]
        stray = torch.nonzero(tail != PAD).flatten()
        result.slots_checked += tail.numel()
        for j in stray.tolist():
            slot = int(tail[j])
            result.violations.append(
                Violation(
                    step,
                    rec.phase,
                    "<padding>",
                    rec.group,
                    int(positions[qsl[-1] + j]),
                    slot,
                    slot // bs,
                    "a padded token wrote a real slot (must be PAD -1)",
                )
            )
    return result


def _check_request(
    result: AuditResult,
    step: str,
    rec: KVWriteRecord,
    req_id: str,
    held_ids: list[int],
    slots: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
) -> None:
    live = slots != PAD
    if not bool(live.any()):
        return
    owned = torch.tensor([b for b in held_ids if b != 0], dtype=torch.int64)
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    in_owned = torch.isin(blocks, owned) & live
    columns = torch.div(positions, block_size, rounding_mode="floor")
    past_end = (columns >= len(held_ids)) & live
    # A trailing -1 column stands for "past the end", so an empty allocation indexes safely too.
    table = torch.tensor([*held_ids, -1], dtype=torch.int64)
    expected = table[columns.clamp(min=0, max=len(held_ids))]
    misplaced = (
        live & in_owned & ~past_end & ((blocks != expected) | (slots % block_size != positions % block_size))
    )
    bad = torch.nonzero((live & ~in_owned) | past_end | misplaced).flatten()
    for j in bad.tolist():
        block = int(blocks[j])
        if past_end[j]:
            reason = f"column {int(columns[j])} is past the {len(held_ids)} block(s) the request holds"
        elif block == 0:
            reason = "wrote the null block 0"
        elif not in_owned[j]:
            reason = "block is not held by this request"
        else:
            reason = f"slot does not match the block table (expected block {int(expected[j])})"
        result.violations.append(
            Violation(step, rec.phase, req_id, rec.group, int(positions[j]), int(slots[j]), block, reason)
        )
